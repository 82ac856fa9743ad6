"""The reference sample: one speculators v1 sample file whose layout every shard must match.

One loader for the config checks (`reference_sample`) and for validation (rule validate, `hsextract
validate --reference`). It loads without pickle (weights_only=True) and checks the v1 layout: a dict of
input_ids int64 [seq], hidden_states a list of float [seq, H] tensors, loss_mask int64 [seq]. Failures are
ReferenceSampleError, whose message starts with the key or option that named the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsextract.errors import ConfigError

V1_KEYS = ("input_ids", "hidden_states", "loss_mask")


class ReferenceSampleError(ConfigError):
    """The reference sample cannot be loaded, or is not a speculators v1 sample."""


@dataclass(frozen=True)
class ReferenceLayout:
    num_tensors: int
    hidden_size: int
    seq_len: int
    dtype: str = "bfloat16"  # the hidden states' (torch's name without "torch.")


def load(path: str | os.PathLike[str], key: str = "reference_sample") -> dict[str, Any]:
    """The sample dict of a speculators v1 sample file; `key` (config key or CLI option) heads any error."""
    p = Path(path)
    if p.is_dir():  # a speculators dataset's folder: name one of its samples (any one: the layout is the same)
        one = next(iter(p.glob("data_*.pt")), None)
        raise ReferenceSampleError(
            f"{key}: {path} is a directory; point it at one sample file "
            + (f"in it (for example {one})" if one else "(.pt, data_N.pt) of a speculators v1 dataset")
        )
    if not p.is_file():
        raise ReferenceSampleError(
            f"{key}: {path}: no such file; point it at one sample (.pt, data_N.pt) of a speculators v1 dataset"
        )
    try:
        sample = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors vary
        raise ReferenceSampleError(
            f"{key}: {path} cannot be loaded with weights_only=True ({type(e).__name__}); it must be a "
            f"speculators v1 sample (dict of input_ids, hidden_states, loss_mask)"
        ) from None
    layout(sample, path, key)
    return sample


def layout(sample: Any, path: str | os.PathLike[str] = "<in memory>", key: str = "reference_sample") -> ReferenceLayout:
    """Tensor count, hidden size and length of a v1 sample; ReferenceSampleError when it is not one."""

    def bad(what: str) -> ReferenceSampleError:
        return ReferenceSampleError(
            f"{key}: {path} is not a speculators v1 sample: {what}. Expected a dict with "
            f"input_ids int64 [seq], hidden_states list of [seq, H] tensors, loss_mask int64 [seq]"
        )

    if not isinstance(sample, dict):
        raise bad(f"it holds a {type(sample).__name__}")
    if set(sample) != set(V1_KEYS):
        raise bad(f"it holds {sorted(sample)}")
    ids, hs, mask = sample["input_ids"], sample["hidden_states"], sample["loss_mask"]
    for name, t in (("input_ids", ids), ("loss_mask", mask)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            raise bad(f"{name} is not a 1-D int64 tensor")
    seq = ids.shape[0]
    if mask.shape[0] != seq:
        raise bad(f"loss_mask has {mask.shape[0]} tokens, input_ids {seq}")
    if not isinstance(hs, (list, tuple)) or not hs:
        raise bad("hidden_states is not a non-empty list of tensors")
    sizes, dtypes = set(), set()
    for i, t in enumerate(hs):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != seq or not t.is_floating_point():
            raise bad(f"hidden_states[{i}] is not a float [seq={seq}, H] tensor")
        sizes.add(t.shape[1])
        dtypes.add(str(t.dtype).removeprefix("torch."))
    if len(sizes) != 1:
        raise bad(f"hidden_states have different hidden sizes {sorted(sizes)}")
    if len(dtypes) != 1:
        raise bad(f"hidden_states have different dtypes {sorted(dtypes)}")
    return ReferenceLayout(num_tensors=len(hs), hidden_size=sizes.pop(), seq_len=seq, dtype=dtypes.pop())


def read_layout(path: str | os.PathLike[str], key: str = "reference_sample") -> ReferenceLayout:
    return layout(load(path, key), path, key)


__all__ = ["ReferenceLayout", "ReferenceSampleError", "V1_KEYS", "layout", "load", "read_layout"]
