"""The target model's final norm, as every shard records it: post-norm = norm(pre-norm) at export time.

A run that captures `final_state: pre_norm` can feed a post-norm consumer (SpecForge) because the
shard carries the norm's kind, epsilon and weight; the reverse (post -> pre) is impossible.

Metadata entry (JSON, in every shard's metadata under `final_norm`):

    {"kind": "rms_norm", "eps": 1e-06, "dtype": "bfloat16", "hidden_size": H,
     "weight": "<base64 of the weight's little-endian bytes>", "source": "<file>:<tensor name>"}

Kinds, each computed as transformers computes it for the families named (x32 = x in float32,
y = x32 * rsqrt(mean(x32^2) + eps)):

    rms_norm         weight * y.to(dtype), the weight in the model dtype (Llama, DeepSeek-V3, Kimi, Qwen,
                     Mistral, GLM-4.5, MiniMax-M2, ...)
    rms_norm_f32     (weight * y).to(dtype): the weight applied in float32, one rounding (gpt-oss)
    rms_norm_offset  (y * (1 + weight in float32)).to(dtype): the weight stored as an offset from 1 (Gemma,
                     Qwen3-Next)

The weight is read from the checkpoint (not from an engine), so the sglang engine, which never loads the
model in the client, records the same entry as the transformers engine.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsextract.config.model_info import text_config
from hsextract.errors import ConfigError, ShardError

RMS_NORM, RMS_NORM_F32, RMS_NORM_OFFSET = "rms_norm", "rms_norm_f32", "rms_norm_offset"
# model_type of the (text) config -> norm kind; each checked against the model's own norm in tests/test_final_norm
NORM_KINDS = {
    **dict.fromkeys(("llama", "llama4_text", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                     "deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "kimi_vl", "glm4", "glm4_moe",
                     "glm4_moe_lite", "minimax_m2", "ernie4_5_moe", "hunyuan_v1_moe", "exaone4", "phi3"), RMS_NORM),
    "gpt_oss": RMS_NORM_F32,
    **dict.fromkeys(("gemma", "gemma2", "gemma3_text", "qwen3_next"), RMS_NORM_OFFSET),
}
_KINDS = sorted(set(NORM_KINDS.values()))
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_WEIGHT_SUFFIX = "model.norm.weight"


@dataclass(frozen=True)
class FinalNorm:
    kind: str
    eps: float
    weight: torch.Tensor  # [H], model dtype
    source: str = ""

    def to_metadata(self) -> dict[str, Any]:
        w = self.weight.contiguous()
        return {
            "kind": self.kind,
            "eps": float(self.eps),
            "dtype": str(w.dtype).removeprefix("torch."),
            "hidden_size": int(w.numel()),
            "weight": base64.b64encode(w.view(torch.uint8).numpy().tobytes()).decode("ascii"),
            "source": self.source,
        }

    @classmethod
    def from_metadata(cls, entry: Mapping[str, Any], where: str) -> FinalNorm:
        try:
            kind, eps, dtype, h = entry["kind"], float(entry["eps"]), _DTYPES[entry["dtype"]], int(entry["hidden_size"])
            raw = base64.b64decode(entry["weight"], validate=True)
        except (KeyError, TypeError, ValueError) as e:
            raise ShardError(f"{where}: the final_norm metadata entry is damaged ({type(e).__name__}: {e}); "
                             "re-extract the run") from None
        weight = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
        if weight.numel() != h:
            raise ShardError(f"{where}: final_norm weight holds {weight.numel()} values, hidden_size says {h}")
        return cls(str(kind), eps, weight, str(entry.get("source", "")))

    def apply(self, pre: torch.Tensor) -> torch.Tensor:
        """post-norm = norm(pre-norm), [seq, H] in pre's dtype (the kinds: module docstring)."""
        if self.kind not in _KINDS:
            raise ConfigError(f"final norm kind {self.kind!r}: only {', '.join(_KINDS)} can be applied at export")
        if pre.shape[-1] != self.weight.numel():
            raise ShardError(f"final norm of hidden size {self.weight.numel()} applied to states of "
                             f"width {pre.shape[-1]}")
        x = pre.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind == RMS_NORM_F32:
            return (self.weight.to(torch.float32) * x).to(pre.dtype)
        if self.kind == RMS_NORM_OFFSET:
            return (x * (1.0 + self.weight.to(torch.float32))).to(pre.dtype)
        return self.weight.to(pre.dtype) * x.to(pre.dtype)


def _resolve(model: str, filename: str) -> Path | None:
    """A file of a local model directory, or of a hub id from the local Hugging Face cache."""
    local = Path(model)
    if local.is_dir():
        p = local / filename
        return p if p.is_file() else None
    try:
        from transformers.utils import cached_file

        got = cached_file(model, filename, _raise_exceptions_for_missing_entries=False)
    except Exception:  # noqa: BLE001 - not in the cache, no hub access: the caller reports it
        return None
    return Path(got) if got else None


def _weight_name(names: list[str], where: str) -> str:
    cands = sorted((n for n in names if n == _WEIGHT_SUFFIX or n.endswith("." + _WEIGHT_SUFFIX)), key=len)
    if not cands:
        raise ConfigError(f"{where}: no tensor named *{_WEIGHT_SUFFIX}: cannot find the model's final norm")
    return cands[0]  # the decoder's own norm: "model.norm.weight" before "language_model.model.norm.weight"


def read_final_norm(model: str, dtype: str = "bfloat16") -> FinalNorm:
    """The final norm of a checkpoint (local directory or cached hub id); ConfigError says what is missing."""
    cfg_path = _resolve(model, "config.json")
    if cfg_path is None:
        raise ConfigError(f"model {model}: no readable config.json, so its final norm cannot be recorded")
    text = text_config(json.loads(cfg_path.read_text(encoding="utf-8")))
    model_type = str(text.get("model_type", ""))
    kind = NORM_KINDS.get(model_type)
    if kind is None:
        raise ConfigError(f"model {model}: model_type {model_type!r} has no known final-norm formula "
                          f"(known: {', '.join(sorted(NORM_KINDS))})")
    eps = text.get("rms_norm_eps")
    if not isinstance(eps, (int, float)):
        raise ConfigError(f"{cfg_path}: no numeric rms_norm_eps; the final norm cannot be recorded")
    from safetensors import safe_open

    index = _resolve(model, "model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        name = _weight_name(list(weight_map), str(index))
        file = _resolve(model, weight_map[name])
    else:
        file = _resolve(model, "model.safetensors")
        name = None
    if file is None:
        raise ConfigError(f"model {model}: no safetensors weights found (model.safetensors or its index), "
                          "so its final norm cannot be recorded")
    with safe_open(str(file), framework="pt") as f:
        name = name or _weight_name(list(f.keys()), str(file))
        weight = f.get_tensor(name)
    return FinalNorm(kind, float(eps), weight.to(_DTYPES[dtype]).contiguous(), f"{file.name}:{name}")


def final_norm_metadata(model: str, dtype: str = "bfloat16") -> tuple[dict[str, Any] | None, str | None]:
    """(metadata entry, None), or (None, why it could not be read): a post-norm run needs no norm."""
    try:
        return read_final_norm(model, dtype).to_metadata(), None
    except (ConfigError, OSError, ValueError, KeyError) as e:
        return None, str(e)


def from_shard_metadata(meta: Mapping[str, Any], where: str) -> FinalNorm | None:
    entry = meta.get("final_norm")
    return None if entry is None else FinalNorm.from_metadata(entry, where)
