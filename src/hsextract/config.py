"""Semantic checks of a workflow config, run at parse time before any job starts.

The JSON Schema (workflow/schemas/config.schema.yaml) checks types, ranges and unknown keys;
this module checks what a schema cannot: layer ids against the model's depth, that the model
and the reference sample can be read, and that the reference sample's layout is comparable
with what the run will write. Every failure is a ConfigError that names the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsextract.capture import resolve_aux_layers
from hsextract.errors import ConfigError

# Keys that hold sizes or counts, checked > 0 (also when the config did not come through the schema).
POSITIVE_KEYS: tuple[str, ...] = (
    "prompts_per_chunk",
    "max_seq_len",
    "transformers.token_budget",
    "extract.threads",
    "extract.mem_mb",
    "shard.threads",
    "shard.compression_level",
    "stats.position_bins",
    "stats.seq_len_bins",
)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    source: str  # where the shape was read from, for messages
    vocab_size: int | None = None


@dataclass(frozen=True)
class ReferenceLayout:
    num_tensors: int
    hidden_size: int
    seq_len: int


@dataclass(frozen=True)
class Plan:
    """What the checks learned, used by the workflow to lay out its jobs."""

    n_records: int
    n_chunks: int
    model: ModelShape
    reference: ReferenceLayout
    aux_layers: list[int]  # resolved from `capture` and `aux_layers` (hsextract.capture)


def lookup(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    # Multimodal checkpoints (Kimi-K2.5) nest the language model's settings.
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(cfg.get(key), dict) and "num_hidden_layers" in cfg[key]:
            return cfg[key]
    return cfg


def read_model_shape(model: str) -> ModelShape:
    """Depth and hidden size of a local model directory, or of a hub id (its config.json, fetched or cached).

    Only config.json is read, as JSON: no code of the checkpoint runs (Kimi-K2.5's config class is custom
    code), and no weights are needed, so a dry run plans a production run from a config directory alone.
    """
    path = Path(model)
    if path.is_dir():
        cfg_path = path / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"model: cannot read {cfg_path} ({e}); `model` must be a Hugging Face model "
                f"directory with a config.json, or a hub id this machine can reach"
            ) from None
        source = str(cfg_path)
    else:
        try:
            from huggingface_hub import hf_hub_download

            cfg = json.loads(Path(hf_hub_download(model, "config.json")).read_text())
        except Exception as e:  # noqa: BLE001 - any failure means the model cannot be read
            raise ConfigError(
                f"model: {model!r} is not a readable model directory and its config could not be "
                f"loaded as a hub id ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                f"set `model` to a local Hugging Face model directory"
            ) from None
        source = f"hub config of {model}"
    if not isinstance(cfg, dict):
        raise ConfigError(f"model: {source} is not a JSON object; `model` must be a causal LM that transformers loads")
    text = _text_config(cfg)
    try:
        vocab = text.get("vocab_size", cfg.get("vocab_size"))
        return ModelShape(
            int(text["num_hidden_layers"]), int(text["hidden_size"]), source, int(vocab) if vocab is not None else None
        )
    except (KeyError, TypeError, ValueError):
        raise ConfigError(
            f"model: {source} has no integer num_hidden_layers/hidden_size; "
            f"`model` must be a causal LM that transformers loads"
        ) from None


def tiny_model_shape() -> ModelShape:
    from hsextract import tinymodel

    cfg = tinymodel.TINY_CONFIG
    return ModelShape(int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), "the tiny model (hsextract.tinymodel)")


def read_reference(path: str) -> ReferenceLayout:
    """Load and check one speculators v1 sample: the layout every shard must match."""
    key = "reference_sample"
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"{key}: {path} is not a file; point it at one sample (.pt) of a speculators v1 dataset"
        )
    try:
        sample = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors vary
        raise ConfigError(
            f"{key}: {path} cannot be loaded with torch.load(weights_only=True) ({type(e).__name__}); "
            f"it must be a speculators v1 sample (dict of input_ids, hidden_states, loss_mask)"
        ) from None

    def bad(what: str) -> ConfigError:
        return ConfigError(
            f"{key}: {path} is not a speculators v1 sample: {what}. Expected a dict with "
            f"input_ids int64 [seq], hidden_states list of [seq, H] tensors, loss_mask int64 [seq]"
        )

    if not isinstance(sample, dict) or set(sample) != {"input_ids", "hidden_states", "loss_mask"}:
        keys = sorted(sample) if isinstance(sample, dict) else type(sample).__name__
        raise bad(f"it holds {keys}")
    ids, hs, mask = sample["input_ids"], sample["hidden_states"], sample["loss_mask"]
    for name, t in (("input_ids", ids), ("loss_mask", mask)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            raise bad(f"{name} is not a 1-D int64 tensor")
    seq = ids.shape[0]
    if mask.shape[0] != seq:
        raise bad(f"loss_mask has {mask.shape[0]} tokens, input_ids {seq}")
    if not isinstance(hs, (list, tuple)) or not hs:
        raise bad("hidden_states is not a non-empty list of tensors")
    sizes = set()
    for i, t in enumerate(hs):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != seq or not t.is_floating_point():
            raise bad(f"hidden_states[{i}] is not a float [seq={seq}, H] tensor")
        sizes.add(t.shape[1])
    if len(sizes) != 1:
        raise bad(f"hidden_states have different hidden sizes {sorted(sizes)}")
    return ReferenceLayout(num_tensors=len(hs), hidden_size=sizes.pop(), seq_len=seq)


def check_sizes(config: Mapping[str, Any]) -> None:
    for key in POSITIVE_KEYS:
        value = lookup(config, key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{key}: {value!r} is not allowed; it must be an integer > 0")


def check_tiny_model_path(config: Mapping[str, Any]) -> None:
    if not config.get("make_tiny_model"):
        return
    model = Path(str(config["model"]))
    if model.is_absolute() or not model.parts or model.parts[0] != "resources" or ".." in model.parts:
        raise ConfigError(
            f"make_tiny_model: true builds a random-weight model at `model`, so model must be a "
            f"relative path under resources/ (got {config['model']!r}); for a real model set "
            f"make_tiny_model: false"
        )
    if not any(str(src.get("path", "")).endswith(".jsonl") for src in config["sources"]):
        raise ConfigError(
            "make_tiny_model: true trains the tiny model's tokenizer on the first .jsonl source, "
            "but `sources` has none; add one or set make_tiny_model: false"
        )


def check_engine(config: Mapping[str, Any]) -> None:
    if config.get("engine") == "sglang":
        try:
            import hsextract.sglang.client  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                f"engine: sglang is not usable in this installation ({e}); use engine: transformers "
                f"or install the sglang extra"
            ) from None


def check_layers(config: Mapping[str, Any], shape: ModelShape) -> list[int]:
    """The run's aux layer ids (preset or explicit list), each checked against the model's depth."""
    layers = resolve_aux_layers(config, shape.num_layers)
    for i, layer in enumerate(layers):
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ConfigError(f"aux_layers[{i}]: {layer!r} is not a layer id; ids are integers >= 0")
        if layer >= shape.num_layers:
            raise ConfigError(
                f"aux_layers[{i}]: layer {layer} is beyond the model's depth: {shape.source} has "
                f"{shape.num_layers} decoder layers, so ids 0..{shape.num_layers - 1} are allowed"
            )
    if len(set(layers)) != len(layers):
        raise ConfigError(f"aux_layers: {layers} repeats a layer id; each id must appear once")
    return layers


def check_reference(config: Mapping[str, Any], shape: ModelShape, ref: ReferenceLayout,
                    aux_layers: list[int] | None = None) -> None:
    aux = list(config["aux_layers"]) if aux_layers is None else aux_layers
    want = len(aux) + 1
    if ref.num_tensors != want:
        raise ConfigError(
            f"reference_sample: {config['reference_sample']} holds {ref.num_tensors} hidden-state "
            f"tensors, but aux_layers {aux} (capture: {config.get('capture') or 'custom'}) has {len(aux)} layers, "
            f"so shards hold {want} (aux layers + final state); use a reference sample with {want} tensors "
            f"or change aux_layers"
        )
    # The shipped reference is Kimi-shaped and checks layout only; the workflow's own tiny model
    # is therefore not comparable by hidden size. A real model is: its reference should come
    # from a dataset of the same model.
    if not config.get("make_tiny_model") and ref.hidden_size != shape.hidden_size:
        raise ConfigError(
            f"reference_sample: {config['reference_sample']} has hidden size {ref.hidden_size}, but "
            f"model {config['model']} has hidden size {shape.hidden_size}; point reference_sample at "
            f"a sample of a dataset of this model"
        )


def check_tokenizer(config: Mapping[str, Any]) -> None:
    """Custom tokenizer code (tokenizer_config.json auto_map) only with trust_remote_code: true."""
    from hsextract.tokenizer_loading import KEY, check_tokenizer_source

    source = str(config.get("tokenizer") or config["model"])
    trusted = bool(config.get(KEY))
    built_here = config.get("make_tiny_model") and not config.get("tokenizer")
    if built_here and config.get("tiny_model_tokenizer") == "kimi" and not trusted:
        raise ConfigError(
            f"{KEY}: make_tiny_model builds {source} with tiny_model_tokenizer: kimi, a tokenizer that is custom "
            f"code (tokenization_kimi.py behind a tokenizer_config.json auto_map, packaged as Kimi-K2.5's is), "
            f"which transformers runs only with {KEY}: true. Set `{KEY}: true` in the config, or "
            f"tiny_model_tokenizer: fast")
    if not built_here:  # a tiny model on disk may be stale: the rule rebuilds it as configured
        check_tokenizer_source(source, trusted)


def count_chunks(n_records: int, prompts_per_chunk: int) -> int:
    return math.ceil(n_records / prompts_per_chunk)


def check(config: Mapping[str, Any]) -> Plan:
    """All semantic checks, in the order a user would fix them; returns the run's plan."""
    check_sizes(config)
    check_tiny_model_path(config)
    check_engine(config)
    model = str(config["model"])
    if config.get("make_tiny_model") and not Path(model, "config.json").is_file():
        shape = tiny_model_shape()
    else:
        shape = read_model_shape(model)
    aux_layers = check_layers(config, shape)
    check_tokenizer(config)
    ref = read_reference(str(config["reference_sample"]))
    check_reference(config, shape, ref, aux_layers)

    from hsextract.conversations import count_records

    sources = list(config["sources"])
    for i, src in enumerate(sources):
        if not Path(src["path"]).exists():
            raise ConfigError(f"sources[{i}].path: {src['path']} does not exist")
    try:
        n_records = int(count_records(sources))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a reader error means the source is unusable
        raise ConfigError(f"sources: cannot count records ({type(e).__name__}: {e})") from None
    if n_records == 0:
        raise ConfigError("sources: the sources hold no records; nothing to extract")
    return Plan(
        n_records=n_records,
        n_chunks=count_chunks(n_records, int(config["prompts_per_chunk"])),
        model=shape,
        reference=ref,
        aux_layers=aux_layers,
    )
