"""Exporters: a run's shards rewritten in the layout another trainer reads (one module per format)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hsextract import layers
from hsextract.atomic import atomic_dir, write_json_atomic
from hsextract.errors import ConfigError
from hsextract.export.common import (
    CONSUMER_FINAL_STATE,
    FinalNormWarning,
    check_out_dir,
    final_norm_message,
    warn_final_norm,
)
from hsextract.export.specforge import export_specforge
from hsextract.export.speculators_safetensors import export_speculators_safetensors
from hsextract.export.speculators_v1 import export_speculators_v1
from hsextract.extract.final_norm import from_shard_metadata
from hsextract.progress import ProgressDataset

# Each writes a run into a new, empty folder and returns its summary, paths in it relative to that folder.
EXPORTERS = {
    "speculators-v1": export_speculators_v1,
    "specforge": export_specforge,
    "speculators-safetensors": export_speculators_safetensors,
}
FORMATS = tuple(EXPORTERS)
LAYERS_FILE = "layers.json"
# the entry of hsextract.layers.drafter_config that holds each format's consumer's own ids
CONSUMER_LAYER_KEY = {
    "speculators-v1": "speculators_0.4_data_config",  # data_config.json's layer_ids: layer outputs
    "speculators-safetensors": "vllm",  # speculators >= 0.5 trains drafters that vLLM serves: hidden_states ids
    "specforge": "specforge",  # aux_hidden_states_layers: layer outputs (hidden_states[i + 1])
}


def export(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], fmt: str,
           force: bool = False, allow_missing: bool = False) -> dict[str, Any]:
    """Stream every sample of open_dataset(run_dir) into out_dir in format `fmt`; returns a summary.

    A run folder's shards are checked against dataset.json's sizes and sha256 first (export reads every
    byte anyway): a missing or changed shard is an error unless `allow_missing`.

    The export is built in a temporary folder beside out_dir and renamed onto it once complete: a failure
    (a damaged sample, a full disk) leaves no output, and with `force` the earlier export as it was."""
    from hsextract.dataset import open_dataset

    if fmt not in EXPORTERS:
        raise ConfigError(f"export format {fmt!r}: use one of {', '.join(FORMATS)}")
    ds = open_dataset(run_dir, verify_checksums=True, allow_missing=allow_missing)
    meta = ds.metadata
    if not meta["aux_layers"]:
        raise ConfigError(
            f"export format {fmt}: {run_dir} holds the final state only (capture: mtp, no aux layers), but {fmt} "
            f"stores EAGLE-3 training data, whose drafter reads aux layers beside the final state. Read MTP data "
            f"with hsextract.open_dataset, or extract with capture: eagle3 (or dflash) for this consumer.")
    # a link: the export goes where it points (built beside the target, renamed onto it)
    out = Path(os.path.realpath(out_dir)) if os.path.islink(out_dir) else Path(out_dir)
    if os.path.ismount(out):
        raise ConfigError(f"{out_dir}: a mount point, which an export cannot replace (it is built beside OUT_DIR and "
                          "renamed onto it once complete): export into a folder inside it")
    real_out = Path(os.path.realpath(out))
    for held in (Path(os.path.realpath(run_dir)), *(Path(os.path.realpath(r.path)) for r in ds.readers)):
        if real_out == held or real_out in held.parents:
            raise ConfigError(f"{out_dir}: holds {held}, which this export reads (an export replaces its folder "
                              f"whole); export into a folder outside {run_dir}")
    check_out_dir(out, force)
    notes = []
    listed = _listed_shards(Path(run_dir)) if allow_missing else None
    if listed is not None and len(ds.readers) < listed:  # said in the summary too, not only on stderr
        notes.append(f"{run_dir}: exported from {len(ds.readers)} of the {listed} shards its dataset.json lists "
                     f"(--allow-missing): the others' samples are not in this export")
    if len(meta["aux_layers"]) != 3:
        # SpecForge 0.2.0 read in its code (algorithms/model_providers.py), not run; speculators 0.4.0's
        # Eagle3DraftModel (fc: Linear(3 x hidden, hidden)) fails on other counts, run on CPU by an outside audit.
        # A note, not a refusal: a drafter of the user's own may take them
        trainer = {"specforge": "SpecForge 0.2.0's", "speculators-v1": "speculators 0.4.0's",
                   "speculators-safetensors": "speculators'"}[fmt]
        notes.append(f"{run_dir} holds {len(meta['aux_layers'])} aux layers, and {trainer} EAGLE-3 draft model "
                     f"takes exactly 3 (its trainer would fail on this data); capture: eagle3 stores 3")
        print(f"WARNING: export {fmt}: {notes[-1]}", file=sys.stderr, flush=True)
    final_state = meta["final_state"]
    want = CONSUMER_FINAL_STATE[fmt]
    # pre -> post is computable from the recorded norm (the exporter applies it); post -> pre is not
    norm = from_shard_metadata(meta, str(run_dir)) if (final_state, want) == ("pre_norm", "post_norm") else None
    warning = warn_final_norm(fmt, final_state, convertible=norm is not None)
    pds = ProgressDataset(ds, f"export {fmt}")
    # every consumer's ids for the stored layers (hsextract.layers), this format's own first
    ids = layers.drafter_config(meta["aux_layers"], meta.get("num_hidden_layers"), meta.get("architecture"))
    layer_ids = {"format": fmt, "consumer": CONSUMER_LAYER_KEY[fmt], **ids}
    with _one_export(out), atomic_dir(out) as tmp:
        check_out_dir(out, force)  # again, now that no other export into `out` can be running
        summary = EXPORTERS[fmt](pds, tmp, norm) if norm is not None else EXPORTERS[fmt](pds, tmp)
        write_json_atomic(tmp / LAYERS_FILE, layer_ids, indent=2)
    for key in ("data_path", "token_freq_path"):
        if key in summary:
            summary[key] = str(out / summary[key])
    summary.update(format=fmt, out_dir=str(out), final_state=final_state, consumer_final_state=want,
                   warning=warning, final_norm_applied=norm is not None, layers=layer_ids, notes=notes)
    return summary


@contextlib.contextmanager
def _one_export(out: Path) -> Iterator[None]:
    """One export into `out` at a time: two at once would replace each other unasked, and the later one's start
    would remove the earlier one's folder in the making (atomic_dir cleans a killed build's leftovers). An advisory
    lock (flock: released by the kernel when its holder dies) on `.<name>.lock` beside `out`, removed after."""
    import fcntl

    out = Path(os.path.abspath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / f".{out.name}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{out}: another export into this folder is running (it holds {lock}); wait for it to "
                              "end, or export into another folder") from None
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _listed_shards(path: Path) -> int | None:
    """How many shards a run folder's dataset.json lists (None for a folder of shards outside a run, or a list)."""
    from hsextract.dataset import MANIFEST_NAME, run_folder

    run = run_folder(path)
    return len(json.loads((run / MANIFEST_NAME).read_text(encoding="utf-8"))["shards"]) if run is not None else None


__all__ = ["CONSUMER_FINAL_STATE", "FORMATS", "FinalNormWarning", "export", "final_norm_message"]
