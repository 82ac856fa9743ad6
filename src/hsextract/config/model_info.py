"""What hsextract reads from a model's config.json: depth, hidden size and vocabulary size.

One lookup of the language model's settings (`text_config`) for every caller: the settings tree (a
preset's layers need the depth), the config checks, the extract job's shard metadata and the capacity
planner. Failures are ModelInfoError (a ConfigError: the `model` key points at something that cannot be read).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsextract.config.guard import resolved_from
from hsextract.errors import ConfigError

# Multimodal checkpoints (Kimi-K2.5) nest the language model's settings under one of these keys.
NESTED_KEYS = ("text_config", "language_config", "llm_config")


class ModelInfoError(ConfigError):
    """The model's config cannot be read, or lacks the sizes hsextract needs."""


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    source: str  # where the shape was read from, for messages
    vocab_size: int | None = None
    # config.json's architectures[0], of the checkpoint (a wrapper's own class): SGLang's layer-id rule
    architecture: str | None = None


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config.json: the nested text config, else the config itself."""
    for key in NESTED_KEYS:
        nested = cfg.get(key)
        if isinstance(nested, dict) and ("num_hidden_layers" in nested or "hidden_size" in nested):
            return nested
    return cfg


def _read_local(path: Path) -> Any:
    cfg_path = path / "config.json"
    try:
        return json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelInfoError(
            f"model: cannot read {cfg_path} ({e}); `model` must be a Hugging Face model "
            f"directory with a config.json, or a hub id this machine can reach"
        ) from None


def _read_hub(model: str) -> Any:
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model, "config.json")).read_text(encoding="utf-8"))
    except Exception as e:  # noqa: BLE001 - any failure means the model cannot be read
        first = str(e).splitlines()[0] if str(e) else ""
        raise ModelInfoError(
            f"model: {model!r} is not a readable model directory{resolved_from(model)} and its config could not be "
            f"loaded as a hub id ({type(e).__name__}: {first}); set `model` to a local Hugging Face model directory"
        ) from None


def _shape(cfg: Any, source: str) -> ModelShape:
    if not isinstance(cfg, dict):
        raise ModelInfoError(
            f"model: {source} is not a JSON object; `model` must be a causal LM that transformers loads")
    text = text_config(cfg)
    try:
        vocab = text.get("vocab_size", cfg.get("vocab_size"))
        arch = cfg.get("architectures")
        return ModelShape(int(text["num_hidden_layers"]), int(text["hidden_size"]), source,
                          # an odd value (true, 0, a string) is no bound: unknown
                          vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None,
                          str(arch[0]) if isinstance(arch, list) and arch else None)
    except (KeyError, TypeError, ValueError):
        raise ModelInfoError(
            f"model: {source} has no integer num_hidden_layers/hidden_size; "
            f"`model` must be a causal LM that transformers loads"
        ) from None


PATH_PREFIXES = ("/", "./", "../", "~")  # a `model` written so is a path, never a hub id


def hub_id(model: str | os.PathLike[str]) -> str | None:
    """`model` as a hub id ("org/name"), or None where it is a path: one here, or one written as a path."""
    name = str(model)
    return None if Path(name).exists() or name.startswith(PATH_PREFIXES) else name


def read_model_shape(model: str) -> ModelShape:
    """Depth and hidden size of a local model directory, or of a hub id (its config.json, fetched or cached).

    Only config.json is read, as JSON: no code of the checkpoint runs (Kimi-K2.5's config class is custom
    code), and no weights are needed, so a dry run plans a production run from a config directory alone.
    """
    path = Path(model)
    if path.is_dir():
        return _shape(_read_local(path), str(path / "config.json"))
    # a path, not a hub id ("org/name"): said at once, not after the hub's retries and its "check your connection"
    if path.exists():
        raise ModelInfoError(f"model: {model!r} is a file, not a model directory; set `model` to the directory that "
                             "holds the checkpoint's config.json")
    if model.startswith(PATH_PREFIXES):
        raise ModelInfoError(f"model: {model!r}: no such directory; set `model` to a local Hugging Face model "
                             "directory (config.json, weights, tokenizer) or a hub id")
    return _shape(_read_hub(model), f"hub config of {model}")


def local_hidden_size(model: str) -> int | None:
    """Hidden size from a local model directory's config.json; None when `model` has none (no hub access)."""
    path = Path(model)
    if not (path / "config.json").is_file():
        return None
    source = str(path / "config.json")
    cfg = _read_local(path)
    if not isinstance(cfg, dict):
        raise ModelInfoError(f"model: {source} is not a JSON object")
    hidden = text_config(cfg).get("hidden_size")
    if isinstance(hidden, bool) or not isinstance(hidden, int):
        raise ModelInfoError(f"model: {source} has no integer hidden_size")
    return hidden


def model_shape(config: Mapping[str, Any]) -> ModelShape:
    """The run's model shape: the tiny model's before the workflow has built it, else its config.json."""
    model = str(config["model"])
    if config.get("make_tiny_model") and not Path(model, "config.json").is_file():
        return tiny_model_shape()
    return read_model_shape(model)


def tiny_model_shape() -> ModelShape:
    """Shape of the workflow's tiny model, known before rule make_tiny_model builds it."""
    from hsextract.tinymodel import build as tinymodel

    cfg = tinymodel.TINY_CONFIG
    return ModelShape(int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), "the tiny model (hsextract.tinymodel)",
                      vocab_size=tinymodel.DEFAULT_VOCAB_SIZE,  # the most ids it holds (its corpus may give fewer)
                      architecture="DeepseekV3ForCausalLM")


__all__ = ["NESTED_KEYS", "PATH_PREFIXES", "ModelInfoError", "ModelShape", "hub_id", "local_hidden_size",
           "model_shape", "read_model_shape", "text_config", "tiny_model_shape"]
