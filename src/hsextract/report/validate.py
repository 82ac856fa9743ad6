"""Validate shards: layout against a reference sample, content checks on every sample, a JSON report.

Checks, in the order a shard's one-line failure message prefers them:

    integrity  the shard opens (header, index, footer intact, not truncated)
    checksum   a sample's record decodes and matches its checksums
    layout     keys, types, dtypes and ranks equal the reference sample's (hidden size too, with
               same_model=True: only when the reference comes from the same model); hidden_states holds
               as many tensors as the shard's aux layers + the final state (num_hidden_tensors)
    seq_len    input_ids, loss_mask and every hidden tensor have one sequence length
    finite     every hidden-state value is finite (no NaN, no inf)
    zero_row   no token row of any hidden-state tensor is all zeros (padding saved as data)
    loss_mask  loss_mask holds only 0 and 1, and at least one 1
    input_ids  every id lies in [0, vocab_size) (vocab_size from the shard metadata or the caller)

Why hidden size needs same_model: a reference sample shows the layout a trainer reads; the bundled
one is shaped like Kimi-K2.5 (7168) while the embedded default model is tiny. Its hidden size says
something only when the reference was captured from the shard's own model.

Why the tensor count is the shard's: the reference shows what each hidden-state tensor looks like to the
trainer, but how many a sample holds follows from the run's `capture` (eagle3 4, dflash 6, mtp 1), which
every shard records in its metadata, while public speculators samples (and the shipped one) hold 4. With a
reference of another count, each of the shard's tensors is compared with the layout its tensors share
(config.reference: one dtype, rank 2, one hidden size), the count with the shard's, and the report's notes
say so.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hsextract import __version__
from hsextract.atomic import write_json_atomic
from hsextract.config import chunks
from hsextract.config import reference as reference_sample
from hsextract.errors import CorruptShardError, ShardError, ValidationFailure
from hsextract.layers import shard_hidden_states
from hsextract.report.stats import tensor_names
from hsextract.shard import SHARD_SUFFIX, ShardReader

CHECKS = ("integrity", "checksum", "layout", "seq_len", "finite", "zero_row", "loss_mask", "input_ids")


def _describe(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"type": "tensor", "dtype": str(value.dtype).removeprefix("torch."), "rank": value.dim(),
                "width": value.shape[-1] if value.dim() >= 2 else None}
    if isinstance(value, (list, tuple)):
        return {"type": "list", "len": len(value), "items": [_describe(v) for v in value]}
    return {"type": type(value).__name__}


def reference_layout(ref: dict[str, Any]) -> dict[str, Any]:
    """What a sample must look like: per key its type, dtype, rank (and list length)."""
    return {k: _describe(v) for k, v in ref.items()}


def _layout_problem(sample: dict[str, Any], layout: dict[str, Any], same_model: bool,
                    num_tensors: int | None = None) -> str | None:
    if sorted(sample) != sorted(layout):
        return f"keys {sorted(sample)}, reference has {sorted(layout)}"
    for key, want in layout.items():
        got = _describe(sample[key])
        if got["type"] != want["type"]:
            return f"{key} is a {got['type']}, reference has a {want['type']}"
        if want["type"] == "list":
            count = want["len"] if num_tensors is None else num_tensors
            if got["len"] != count:
                whose = "reference has" if count == want["len"] else "the shard's aux layers + final state make"
                return f"{key} has {got['len']} tensors, {whose} {count}"
            if got["len"] != want["len"] and not want["items"]:
                return f"{key} has {got['len']} tensors, reference has none to compare them with"
            # as many as the reference: tensor by tensor; another count (the run's): each like the reference's
            # tensors, which are alike (config.reference.layout: one dtype, rank 2, one hidden size)
            items = want["items"] if got["len"] == want["len"] else [want["items"][0]] * got["len"]
            pairs = [(f"{key}[{k}]", g, w) for k, (g, w) in enumerate(zip(got["items"], items, strict=True))]
        else:
            pairs = [(key, got, want)]
        for name, g, w in pairs:
            if g["type"] != w["type"]:
                return f"{name} is a {g['type']}, reference has a {w['type']}"
            if g.get("dtype") != w.get("dtype"):
                return f"{name} has dtype {g.get('dtype')}, reference has {w.get('dtype')}"
            if g.get("rank") != w.get("rank"):
                return f"{name} has rank {g.get('rank')}, reference has rank {w.get('rank')}"
            if same_model and g.get("width") != w.get("width"):
                return f"{name} has hidden size {g.get('width')}, reference has {w.get('width')}"
    return None


def check_sample(sample: dict[str, Any], layout: dict[str, Any], vocab_size: int | None = None,
                 same_model: bool = False, names: Sequence[str] | None = None,
                 num_tensors: int | None = None) -> list[tuple[str, str]]:
    """Every failed check of one sample as (check, detail); empty when the sample is good. `names`: what each
    hidden tensor is (report.stats.tensor_names: the statistics' and dataset.json's names), so that a failure
    names the layer as they do, not by its place in the list. `num_tensors`: how many hidden-state tensors the
    sample must hold (the shard's num_hidden_tensors); None: as many as the reference."""
    failed: list[tuple[str, str]] = []

    def tensor(k: int) -> str:
        return f"tensor {k} ({names[k]})" if names is not None and k < len(names) else f"hidden_states[{k}]"

    problem = _layout_problem(sample, layout, same_model, num_tensors)
    if problem:
        failed.append(("layout", problem))
    ids, mask, hidden = sample.get("input_ids"), sample.get("loss_mask"), sample.get("hidden_states")
    if not (isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and isinstance(hidden, (list, tuple))
            and all(isinstance(h, torch.Tensor) for h in hidden)):
        return failed or [("layout", "input_ids, loss_mask must be tensors and hidden_states a list of tensors")]
    seq = ids.shape[0] if ids.dim() else 0
    lens = {"input_ids": seq, "loss_mask": mask.shape[0] if mask.dim() else 0}
    lens.update({f"hidden_states[{k}]": (h.shape[0] if h.dim() else 0) for k, h in enumerate(hidden)})
    if len(set(lens.values())) != 1:
        failed.append(("seq_len", ", ".join(f"{k} {v}" for k, v in lens.items())))
    for k, h in enumerate(hidden):
        if not h.is_floating_point():
            continue
        finite = torch.isfinite(h)
        if not bool(finite.all()):
            bad = (~finite).nonzero()[0].tolist()
            failed.append(("finite", f"{tensor(k)} has {int((~finite).sum())} non-finite values, "
                                     f"first at {tuple(bad)}"))
            break
    for k, h in enumerate(hidden):
        if h.dim() < 2:
            continue
        zero = (h == 0).all(dim=-1)
        if bool(zero.any()):
            rows = zero.nonzero().flatten().tolist()
            failed.append(("zero_row", f"{tensor(k)} has {len(rows)} all-zero rows, first at token {rows[0]}"))
            break
    values = torch.unique(mask).tolist()
    if any(v not in (0, 1) for v in values):
        failed.append(("loss_mask", f"values {values}, only 0 and 1 allowed"))
    elif 1 not in values:
        failed.append(("loss_mask", "no token has loss_mask 1 (nothing to train on)"))
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or (vocab_size is not None and hi >= vocab_size):
            bad_at = int(((ids < 0) | (ids >= (vocab_size if vocab_size is not None else hi + 1))).nonzero()[0])
            failed.append(("input_ids", f"id {int(ids[bad_at])} at token {bad_at} outside [0, {vocab_size})"))
    return failed


def failure_line(report: dict[str, Any], advice: bool = False) -> str | None:
    """The one line that names the file, the first failing sample and its check; None when passed. `advice`: what
    the workflow's user does next (the failed chunk's shard stays, so the same command alone redoes nothing)."""
    if report["passed"]:
        return None
    first = report["first_failure"]
    sample = "shard structure" if first["sample"] is None else f"sample {first['sample']}"
    if first.get("sample_id"):
        sample += f" (id {first['sample_id']})"
    others = sorted(c for c, v in report["checks"].items() if v["failed"] and c != first["check"])
    more = f" [also failed: {', '.join(others)}]" if others else ""
    line = f"{report['shard']}: {sample}: check {first['check']} failed: {first['detail']}{more}"
    if advice and first["check"] in ("integrity", "checksum"):
        line += f". Delete {report['shard']} and run the same command: its chunk alone is extracted again"
    elif advice:  # the shard holds what the engine computed: extracted again, it would fail again
        line += (f". The shard holds what the engine computed, so extracting it again gives the same: check the "
                 f"model, the reference sample and the config (then delete {report['shard']} and run the same "
                 f"command)")
    return line


def _empty_checks() -> dict[str, dict[str, Any]]:
    return {c: {"failed": 0, "first": None} for c in CHECKS}


def _write_report(report: dict[str, Any], report_path: str | os.PathLike[str] | None) -> None:
    if report_path is None:
        return
    write_json_atomic(report_path, report)  # as the workflow writes its reports


def validate_chunk(shard: str | os.PathLike[str], reference: str | os.PathLike[str],
                   report_path: str | os.PathLike[str], *, same_model: bool) -> dict[str, Any]:
    """Rule validate: the report (printed) is written only for a shard that passed; a failed one raises
    ValidationFailure and leaves no report, so its chunk counts as failed and reruns."""
    report = validate_shard(shard, reference, same_model=same_model)
    print(json.dumps(report, indent=1))
    if not report["passed"]:
        raise ValidationFailure(failure_line(report, advice=True))
    _write_report(report, report_path)
    return report


def validate_shard(path: str | os.PathLike[str], reference: str | os.PathLike[str] | dict[str, Any],
                   vocab_size: int | None = None, report_path: str | os.PathLike[str] | None = None,
                   same_model: bool = False, reference_name: str | None = None) -> dict[str, Any]:
    """Check every sample of one shard; return (and write, if report_path) the JSON report. `reference_name`: the
    path to record for a reference given loaded (a dict)."""
    ref = reference if isinstance(reference, dict) else reference_sample.load(reference)
    layout = reference_layout(ref)
    checks = _empty_checks()
    report: dict[str, Any] = {
        "shard": str(path), "passed": True, "num_samples": None, "num_tokens": None, "distinct_tokens": None,
        "num_trained": None,
        "vocab_size": vocab_size, "same_model": same_model,
        "reference": str(reference) if not isinstance(reference, dict) else reference_name or "<in memory>",
        "checks": checks, "first_failure": None, "validator": f"hsextract {__version__}",
    }
    first: list[tuple[int, int, dict[str, Any]]] = []  # (sample order, check order, failure)

    def fail(check: str, sample: int | None, sample_id: str | None, detail: str) -> None:
        entry = {"sample": sample, "sample_id": sample_id, "detail": detail}
        checks[check]["failed"] += 1
        if checks[check]["first"] is None:
            checks[check]["first"] = entry
        first.append((-1 if sample is None else sample, CHECKS.index(check), {"check": check, **entry}))

    try:
        reader = ShardReader(path)
    except CorruptShardError as e:
        fail("integrity", e.sample, None, e.what)
        reader = None
    except ShardError as e:
        fail("integrity", None, None, str(e).removeprefix(f"{Path(path)}: "))  # named by the report
        reader = None
    if reader is not None:
        meta = reader.metadata
        named = chunks.of_name(os.path.basename(path), SHARD_SUFFIX)
        if named is not None and isinstance(meta.get("chunk"), int) and meta["chunk"] != named:
            fail("integrity", None, None, f"named for chunk {named}, it holds chunk {meta['chunk']} of run "
                 f"{meta.get('run_name')!r} (its metadata): renamed, or swapped with another chunk's shard; give it "
                 f"its name, {chunks.name(meta['chunk'], SHARD_SUFFIX)}")
        if meta.get("vocab_size") is not None:  # the shard's own bound; a given one only where it is smaller
            own = int(meta["vocab_size"])
            if vocab_size is not None and int(vocab_size) != own:
                report.setdefault("notes", []).append(
                    f"vocab_size given {vocab_size}, the shard's {own}: ids checked against the smaller")
            vocab_size = own if vocab_size is None else min(int(vocab_size), own)
            report["vocab_size"] = vocab_size
        try:
            names: list[str] | None = tensor_names(shard_hidden_states(meta), str(meta["final_state"]))
        except (KeyError, TypeError, ValueError):
            names = None
        num_tensors = int(meta["num_hidden_tensors"])  # len(aux_layers) + 1: the reader checked it
        ref_tensors = layout["hidden_states"].get("len") if isinstance(layout.get("hidden_states"), dict) else None
        if ref_tensors is not None and ref_tensors != num_tensors:
            aux = shard_hidden_states(meta)
            which = f"aux_layers {aux} + the final state" if aux else "no aux layer: the final state only"
            report.setdefault("notes", []).append(
                f"the reference holds {ref_tensors} hidden-state tensors, this shard {num_tensors} ({which}): each "
                f"tensor compared with the reference's layout, the count with the shard's aux layers")
        report["num_samples"] = len(reader)
        report["num_tokens"] = reader.num_tokens
        report["distinct_tokens"] = reader.stored_tokens  # the rows stored: a shared prefix once
        report["num_trained"] = reader.num_trained
        for i in range(len(reader)):
            try:
                sample = reader[i]
            except CorruptShardError as e:
                fail("checksum", i, reader.sample_id(i), e.what)
                continue
            for check, detail in check_sample(sample, layout, vocab_size, same_model, names, num_tensors):
                fail(check, i, reader.sample_id(i), detail)
        reader.close()
    if vocab_size is None:
        report.setdefault("notes", []).append(
            "vocab_size unknown (not in shard metadata, not given): input_ids checked for >= 0 only")
    if first:
        report["passed"] = False
        report["first_failure"] = min(first, key=lambda t: (t[0], t[1]))[2]
    _write_report(report, report_path)
    return report
