"""What every exporter shares: the output folder rule, atomic file writes, the final-norm warning."""

from __future__ import annotations

import fnmatch
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from hsextract.atomic import blocked_parent
from hsextract.atomic import write_atomic as atomic_write
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


# What any format writes at the top of its folder (layers.json: export() itself): --force replaces a folder
# of these only, never one that holds something else (a mistyped OUT_DIR such as a home folder)
EXPORT_NAMES = ("data", "token_freq.pt", "layers.json", "data-*-of-*.arrow", "state.json", "dataset_info.json",
                "hidden_states", "rows_*-*")
# what an export writes inside its folders (and the temporary names of a killed write): --force replaces nothing else
EXPORT_FOLDER_NAMES = {
    "data": ("data_*.pt", "sample_lengths.json", "data_config.json"),
    "hidden_states": ("hs_*.safetensors",),
    "rows_*-*": ("data_*.ckpt",),
}


def check_out_dir(out_dir: Path, force: bool) -> None:
    """Refuse an out_dir that is not a folder, or is not empty unless force (then it must hold an earlier
    export only, which the new one replaces whole once complete)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir}: exists and is not a folder; give an export folder")
    blocked = blocked_parent(out_dir)
    if blocked:
        raise ConfigError(f"{blocked[0]}: {blocked[1]}, so the export {out_dir} cannot be made beside it; choose "
                          "another OUT_DIR")
    names = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if names and not force:
        raise ConfigError(f"{out_dir}: folder is not empty; export into an empty folder, or pass --force to replace "
                          f"the export in it")
    other = [n for n in names if not any(fnmatch.fnmatchcase(n, pat) for pat in EXPORT_NAMES)]
    for n in names:
        inner = next((v for k, v in EXPORT_FOLDER_NAMES.items() if fnmatch.fnmatchcase(n, k)), None)
        if inner is not None and (out_dir / n).is_dir() and not (out_dir / n).is_symlink():
            other += [f"{n}/{m}" for m in sorted(os.listdir(out_dir / n))
                      if not any(fnmatch.fnmatchcase(m, pat) for pat in (*inner, ".*.tmp"))]
        elif inner is not None:
            other.append(n)  # a file or a link where an export writes a folder
    if other:
        raise ConfigError(f"{out_dir}: holds {', '.join(other)}, which no export writes; --force replaces an earlier "
                          f"export whole, so move those out first or export into another folder")


def save_torch(path: Path, obj: Any) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a tensor's whole storage: a view of a larger buffer is copied out first."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


__all__ = ["CONSUMER_FINAL_STATE", "FinalNormWarning", "atomic_write", "check_out_dir", "final_norm_message",
           "own_storage", "save_torch", "warn_final_norm"]
