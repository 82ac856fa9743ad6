"""dataset.json: the run's table of contents (shards, counts, checksums, provenance).

Paths inside are relative to the run directory (results/<run_name>/), so a dataset can be
moved or copied whole. Every shard must agree on what it holds (model, tokenizer, layers,
final state, hidden size, dtype); a mixed dataset is an error that names the shard. So is a shard
made from other prompts than its chunk's prompts file holds now (its recorded `prompts_sha256`;
a shard written before shards recorded it is not compared, and dataset.json says so).

`remove_stale_chunks`: the step that writes dataset.json also removes the per-chunk files of chunks
an earlier configuration of more chunks left, which a shard folder or a glob would read with the rest.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hsextract import layers, provenance
from hsextract.atomic import write_json_atomic
from hsextract.config import chunks
from hsextract.config.reruns import beside_manifest
from hsextract.config.settings import Settings
from hsextract.errors import ValidationFailure
from hsextract.prepare import drops
from hsextract.prepare.prefix_share import codec_ratio, raw_stored, share_saving, stored_tokens
from hsextract.shard.format import SHARD_SUFFIX

MANIFEST_FORMAT = "hsextract-dataset"
MANIFEST_VERSION = 1
# Shard metadata every shard of one dataset must share. Not format_version: with share_prefixes a shard whose
# samples took no prefix is version 1 beside version-2 shards (docs/SHARED_PREFIX.md), and a reader reads both.
# Not aux_layers as written: each shard's layers are compared with the run's by meaning (an earlier release's
# shard names the same layers in another convention), before these.
SHARED_KEYS = ("model", "model_hash", "tokenizer_hash", "chat_template_hash", "engine",
               "final_state", "hidden_size", "dtype", "precision")


def config_values(settings: Settings) -> dict[str, tuple[Any, str]]:
    """Shard metadata the run's config decides (metadata key -> (the config's value, the config's words for it)):
    dataset.json records the config's, so a shard must hold them too (one marked up to date by `snakemake --touch`
    may not)."""
    x = settings.extract
    dtype = (f"transformers.dtype: {x.activation_dtype!r}" if x.engine == "transformers" else
             f"engine: {x.engine!r} (which serves {x.activation_dtype})")
    return {"engine": (x.engine, f"engine: {x.engine!r}"),
            "final_state": (x.final_state, f"final_state: {x.final_state!r}"),
            "dtype": (x.activation_dtype, dtype),
            "precision": (x.shard.precision, f"shard.precision: {x.shard.precision!r}")}


# The run folder's per-chunk files (results/<run>/<folder>/chunk-NNNNN<suffix>): what remove_stale_chunks may delete.
# (prompts/: prepare removes its own; listed here too, for the leftovers of a run made before it did.) Regeneration
# has the same chunks (one line per input record).
PER_CHUNK_FILES = (("prompts", ".parquet"), ("shards", SHARD_SUFFIX), ("validation", ".json"), ("stats", ".json"),
                   ("regenerated/chunks", ".jsonl"), ("regenerated/chunks", ".stats.json"))


def remove_stale_chunks(run_dir: str | Path, n_chunks: int) -> list[Path]:
    """Delete the per-chunk files (PER_CHUNK_FILES, exact names) of chunks >= `n_chunks` in the run folder: an
    earlier configuration's, which `hsextract validate results/<run>/shards/*.hss` (and open_dataset on that folder
    before a dataset.json is written) would read with the current ones. One line on stdout per file removed."""
    removed: list[Path] = []
    for folder, suffix in PER_CHUNK_FILES:
        removed += chunks.remove_beyond(Path(run_dir) / folder, suffix, n_chunks)
    return removed


def check_prompts(shard: str | Path, meta: Mapping[str, Any], prompts: str | Path, written: str | None = None,
                  run_name: str | None = None) -> bool:
    """Whether the shard's recorded `prompts_sha256` could be compared with `prompts` (False: the shard was written
    before shards recorded it); a ValidationFailure naming the chunk where they differ. `written`: the sha256
    prepare recorded for the file (summary.json), which tells a damaged prompts file (the shard good) from one
    prepare rewrote (the shard stale); `run_name`: this run's, named where the shard says another."""
    recorded = meta.get("prompts_sha256")
    if recorded is None:
        return False
    try:
        current = provenance.sha256_file(prompts)
    except OSError as e:
        raise ValidationFailure(f"{shard}: cannot read {prompts} to compare it with the prompts the shard was made "
                                f"from ({type(e).__name__}: {e}); rerun the workflow") from None
    if current != recorded:
        chunk = meta.get("chunk")
        named = chunks.of_name(Path(shard).name, SHARD_SUFFIX)
        if isinstance(chunk, int) and named is not None and chunk != named:
            raise ValidationFailure(
                f"{shard}: holds chunk {chunk} (its metadata says so) under chunk {named}'s name: a shard copied or "
                f"renamed over another. Delete it and rerun: only chunk {named} is extracted again.")
        if written == recorded:
            raise ValidationFailure(
                f"{shard}: chunk {chunk} was extracted from prompts of sha256 {recorded}, which prepare wrote, but "
                f"{prompts} now has sha256 {current}: the prompts file was damaged or changed since, the shard is "
                f"good. Restore {prompts} (`cp -p` from a copy); or delete it and run the same command, which "
                f"writes every chunk's prompts again and extracts every chunk again.")
        other = meta.get("run_name")
        if run_name is not None and other is not None and other != run_name:
            raise ValidationFailure(
                f"{shard}: chunk {chunk} of run {other!r}, extracted from prompts of sha256 {recorded}, but this run "
                f"{run_name!r} has {prompts} of sha256 {current}: a shard copied from another run? Delete the shard "
                f"and rerun: only its chunk is extracted again.")
        raise ValidationFailure(
            f"{shard}: chunk {chunk} was extracted from prompts of sha256 {recorded}, but {prompts} now has sha256 "
            f"{current}: the prompts changed after the shard was written (and kept an older modification time, so "
            f"Snakemake did not rerun the chunk). Delete the shard and rerun: only its chunk is extracted again.")
    return True


def _rel(path: str | Path, root: Path) -> str:
    return Path(os.path.relpath(Path(path).resolve(), root.resolve())).as_posix()


def _load_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _without(config: Mapping[str, Any], dotted: tuple[str, ...]) -> dict[str, Any]:
    out = copy.deepcopy(dict(config))
    for key in dotted:
        *parents, leaf = key.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def build_manifest(
    settings: Settings,
    *,
    shards: Sequence[str | Path],
    validation: Sequence[str | Path],
    chunk_stats: Sequence[str | Path],
    prompts: Sequence[str | Path] | None,
    prepare_summary: str | Path,
    token_freq: str | Path,
    out_path: str | Path,
    lock: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Assemble dataset.json; shard i, validation i, chunk_stats i and prompts i describe the same chunk.
    `prompts`: the chunks' prompts files, each compared with the sha256 its shard recorded (check_prompts; None:
    none compared). `lock`: {"path", "sha256"} of the package lock file the workflow's environment was installed
    from."""
    from hsextract.shard import ShardReader

    if not (len(shards) == len(validation) == len(chunk_stats)) or (prompts is not None
                                                                   and len(prompts) != len(shards)):
        raise ValueError("build_manifest: shards, validation, chunk_stats and prompts differ in length")
    root = Path(out_path).parent
    entries: list[dict[str, Any]] = []
    first_meta: dict[str, Any] | None = None
    totals = {"samples": 0, "tokens": 0, "trained_tokens": 0, "bytes_raw": 0, "bytes_stored": 0}
    distinct = 0
    raw_of_stored = 0.0  # NaN once a chunk's is unknown (statistics of an older release)
    versions: set[int] = set()
    unchecked: list[Any] = []  # chunks whose shards were written before shards recorded their prompts' sha256
    prep = _load_json(prepare_summary)
    for i, (shard, report_path, stats_path) in enumerate(zip(shards, validation, chunk_stats, strict=True)):
        meta = ShardReader(shard).metadata
        if layers.shard_hidden_states(meta) != list(settings.extract.aux_layers):
            raise ValidationFailure(
                f"{shard}: holds {layers.describe(layers.shard_hidden_states(meta))}, but this run stores "
                f"{layers.describe(settings.extract.aux_layers)}; a shard of another run or hsextract release. "
                f"Delete it and rerun its chunk.")
        for key, (want, said) in config_values(settings).items():
            if meta.get(key) != want:
                raise ValidationFailure(
                    f"{shard}: was written with {key} {meta.get(key)!r}, but this run's config says {said}; a shard "
                    f"of another configuration (marked up to date by `snakemake --touch`?). Delete it and rerun its "
                    f"chunk.")
        if first_meta is None:
            first_meta = meta
        for key in SHARED_KEYS:
            if meta.get(key) != first_meta.get(key):
                raise ValidationFailure(
                    f"{shard}: {key} is {meta.get(key)!r} but {shards[0]} has {first_meta.get(key)!r}; "
                    f"a dataset mixes shards of different runs. Delete the odd shard and rerun its chunk."
                )
        if prompts is not None and not check_prompts(shard, meta, prompts[i], chunks.written_sha256(prep, i),
                                                     settings.extract.run_name):
            unchecked.append(meta.get("chunk", i))
        report = _load_json(report_path)
        stats = _load_json(stats_path)
        for k in totals:
            totals[k] += int(stats[k])
        distinct += stored_tokens(stats)
        raw_of_stored += raw_stored(stats)
        versions.add(int(meta["format_version"]))
        entries.append(
            {
                "path": _rel(shard, root),
                "chunk": meta.get("chunk"),
                "samples": stats["samples"],
                "tokens": stats["tokens"],
                "distinct_tokens": stored_tokens(stats),
                "trained_tokens": stats["trained_tokens"],
                "format_version": meta["format_version"],
                "bytes": Path(shard).stat().st_size,
                "sha256": provenance.sha256_file(shard),
                "config_hash": meta.get("config_hash"),
                "engine_version": meta.get("engine_version"),
                # the sha256 of the prompts file it was made from, which that file still has (None: a shard written
                # before shards recorded it, not compared)
                "prompts_sha256": meta.get("prompts_sha256"),
                "validation": _rel(report_path, root),
                "valid": bool(report.get("passed")),
            }
        )
    assert first_meta is not None or not shards
    if unchecked:
        print(f"WARNING: the shards of chunks {unchecked} were written before shards recorded the sha256 of their "
              "prompts: not compared with the prompts files (dataset.json: prompts_unchecked); delete them and rerun "
              "to have them checked", file=sys.stderr, flush=True)
    meta = first_meta or {}
    dropped = {str(k): int(v) for k, v in (prep.get("dropped") or {}).items()}
    s = settings
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "run_name": s.extract.run_name,
        "layout": "speculators-v1",  # what a sample reads back as
        "model": s.extract.model,
        "engine": s.extract.engine,
        "engine_version": meta.get("engine_version"),
        "aux_layers": list(s.extract.aux_layers),
        "layer_convention": layers.STORED,
        # what to write in a drafter's (or trainer's) config so that each engine feeds exactly these layers
        "layers": layers.drafter_config(s.extract.aux_layers, meta.get("num_hidden_layers"), meta.get("architecture")),
        "final_state": s.extract.final_state,
        "hidden_size": meta.get("hidden_size"),
        "dtype": meta.get("dtype"),
        "precision": meta.get("precision"),
        # the newest shard format of the dataset (what a reader must read), and every one it holds: with
        # share_prefixes, version 2 where a shard's samples take prefixes from others, else version 1
        "shard_format_version": max(versions) if versions else None,
        "shard_format_versions": sorted(versions),
        "counts": {
            "chunks": len(entries),
            **totals,
            # tokens: materialized (each sample whole, as ds[i] returns it); distinct_tokens: stored and computed,
            # each shared prefix once; share_saving: their ratio (1.0 without shared prefixes)
            "distinct_tokens": distinct,
            "share_saving": share_saving(totals["tokens"], distinct),
            # stored bytes over the speculators v1 size (every sample whole): the codec and the shared prefixes
            "stored_over_raw": round(totals["bytes_stored"] / totals["bytes_raw"], 4) if totals["bytes_raw"] else None,
            # stored bytes over the raw bytes of what is stored (a shared prefix once): the codec alone
            "codec_ratio": codec_ratio(totals["bytes_stored"], raw_of_stored),
            "dropped": dropped,  # by reason; a reason drops records or samples (prepare.drops)
            **drops.totals(dropped),
        },
        "all_valid": all(e["valid"] for e in entries),
        # every shard was compared with its chunk's prompts file (a mismatch is an error), but those of these chunks:
        # written before shards recorded their prompts' sha256 (null: the prompts were not given)
        "prompts_unchecked": unchecked if prompts is not None else None,
        "shards": entries,
        "token_freq": {"path": _rel(token_freq, root), "sha256": provenance.sha256_file(token_freq)},
        "provenance": {
            "versions": provenance.versions(),
            "lock": dict(lock) if lock else None,
            "config_hash": s.config_hash,
            "model_hash": meta.get("model_hash") or provenance.model_hash(s.extract.model),
            "tokenizer_hash": meta.get("tokenizer_hash") or provenance.tokenizer_hash(s.extract.tokenizer_dir),
            "chat_template_hash": meta.get("chat_template_hash"),
            "prepare": {k: v for k, v in prep.items() if k != "dropped"},
            # holds no secret (hsextract.config.redaction): shared with the data; nor the keys of outputs the
            # manifest does not read (a changed histogram bin count does not rerun it)
            "config": _without(s.config, beside_manifest()),
        },
    }


def write_manifest(settings: Settings, *, shards: Sequence[str | Path], out_path: str | Path,
                   **inputs: Any) -> dict[str, Any]:
    """Rule manifest: the per-chunk files of chunks an earlier configuration of more chunks left removed first,
    then dataset.json (build_manifest, whose keyword arguments `inputs` are) written atomically."""
    remove_stale_chunks(Path(out_path).parent, len(shards))
    manifest = build_manifest(settings, shards=shards, out_path=out_path, **inputs)
    write_json_atomic(out_path, manifest)
    return manifest


MANIFEST_MAX_BYTES = 1 << 30  # a dataset.json beyond it (or a FIFO, a device) is not read at parse time


def manifest_stamp(run_dir: str | Path) -> tuple[int, str] | None:
    """The run's dataset.json as a file (inode) and as data (sha256), or None where there is none (or none this
    parse-time check reads: not a regular file, beyond MANIFEST_MAX_BYTES)."""
    from hsextract.config.guard import is_small_regular

    path = Path(run_dir) / "dataset.json"
    if not is_small_regular(path, MANIFEST_MAX_BYTES):
        return None
    try:
        return path.stat().st_ino, provenance.sha256_file(path)
    except OSError:
        return None


def finished_line(run_dir: str | Path, before: tuple[int, str] | None) -> str | None:
    """The run's word on the terminal at its end (Snakefile's onsuccess): what its dataset.json holds and where,
    where this invocation wrote it: another file or other data than `before` (manifest_stamp at the start: no
    clock compared; `--touch` changes neither; a rewrite into the inode Snakemake freed, the data). None otherwise
    (a target short of the manifest, nothing to do)."""
    from hsextract.config.plan import bytes_text

    path = Path(run_dir) / "dataset.json"
    try:
        if (now := manifest_stamp(run_dir)) is None or now == before:
            return None
        d = json.loads(path.read_text(encoding="utf-8"))
        c = d["counts"]
        line = (f"hsextract: {path}: {c['samples']:,} samples, {c['tokens']:,} tokens ({c['trained_tokens']:,} "
                f"trained) in {c['chunks']} shards, {bytes_text(c['bytes_stored'])} stored")
        if c.get("dropped_records"):
            line += f"; prepare dropped {c['dropped_records']:,} records (stats/ says why)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return line
