"""What every exporter shares: the output folder rule, atomic file writes, the final-norm warning."""

from __future__ import annotations

import json
import os
import secrets
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from hsextract.errors import ConfigError

# What each consumer expects as the last hidden tensor, and what goes wrong with the other one.
CONSUMER_FINAL_STATE = {
    "speculators-v1": "pre_norm",
    "speculators-safetensors": "pre_norm",
    "specforge": "post_norm",
}


class FinalNormWarning(UserWarning):
    """The exported data's final-norm convention differs from what its consumer expects."""


def final_norm_message(fmt: str, data_final_state: str, convertible: bool = False) -> str | None:
    """None when the consumer gets the convention it expects: the same one, or pre_norm data converted to
    post_norm with the final norm the shards record (`convertible`)."""
    want = CONSUMER_FINAL_STATE[fmt]
    if data_final_state == want or (convertible and (data_final_state, want) == ("pre_norm", "post_norm")):
        return None
    if want == "pre_norm":
        why = ("speculators >=0.4 applies the verifier's final RMSNorm itself (verifier_norm) before the LM head, "
               "so post_norm states get the norm applied TWICE (pre-norm states cannot be recovered from them)")
    else:
        why = ("SpecForge feeds hidden_state to the LM head as it is, so pre_norm states MISS the final RMSNorm, "
               "and these shards do not record the norm (extracted by an older hsextract, or the model's weights "
               "were unreadable), so the export cannot apply it")
    return (f"WARNING: export format {fmt} expects final_state={want}, but this data was captured with "
            f"final_state={data_final_state}: {why}. Re-extract with `final_state: {want}` for this consumer, "
            f"or make the trainer match the data.")


def warn_final_norm(fmt: str, data_final_state: str, convertible: bool = False) -> str | None:
    """Print the convention mismatch to stderr and raise it as a FinalNormWarning; returns the message."""
    msg = final_norm_message(fmt, data_final_state, convertible)
    if msg:
        print(msg, file=sys.stderr, flush=True)
        warnings.warn(msg, FinalNormWarning, stacklevel=3)
    return msg


def prepare_out_dir(out_dir: Path, force: bool) -> None:
    """Create out_dir; refuse a non-empty one unless force (then files are overwritten in place)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir}: exists and is not a folder; give an export folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ConfigError(f"{out_dir}: folder is not empty; export into an empty folder, or pass --force to overwrite")
    out_dir.mkdir(parents=True, exist_ok=True)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write through a temporary file in the same folder, fsync-free rename: a file exists whole or not at all."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_torch(path: Path, obj: Any) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def save_json(path: Path, obj: Any, indent: int | None = 2) -> None:
    data = json.dumps(obj, indent=indent).encode()
    atomic_write(path, lambda f: f.write(data))


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a tensor's whole storage: a view of a larger buffer is copied out first."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def remove_stale(files: list[Path]) -> list[str]:
    """With --force: files of this format's naming left over from an earlier, larger export."""
    for p in files:
        p.unlink(missing_ok=True)
    return [str(p) for p in files]


__all__ = ["CONSUMER_FINAL_STATE", "FinalNormWarning", "atomic_write", "final_norm_message",
           "own_storage", "prepare_out_dir", "remove_stale", "save_json", "save_torch", "warn_final_norm"]
