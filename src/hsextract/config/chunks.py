"""Chunks: the unit of work. Input record k of the mixture (0-based) belongs to chunk k // prompts_per_chunk,
so the chunk count is known from the record count alone, before anything is parsed.

One place for the count, the 5-digit label in every per-chunk file name (`chunk-00007.parquet`), the records of
a chunk and the sha256 prepare recorded for its prompts; used by the config checks, prepare, extract, the manifest
and the workflow rules. `remove_beyond`: the per-chunk files an earlier configuration of more chunks left
(prepare's prompts, the manifest step's shards, reports, statistics).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from hsextract.atomic import temp_target
from hsextract.config.guard import is_small_regular
from hsextract.provenance import sha256_file

WIDTH = 5
# the `chunk` wildcard of the rules: a label
WILDCARD = rf"\d{{{WIDTH}}}"


def count(n_records: int, prompts_per_chunk: int) -> int:
    """Chunks of `n_records` input records: ceil(n_records / prompts_per_chunk)."""
    return math.ceil(n_records / prompts_per_chunk)


def written_sha256(summary: Mapping[str, Any], chunk: int) -> str | None:
    """The sha256 prepare recorded for chunk's prompts file (its summary.json's per_chunk; None before it did, or
    where the file is not prepare's summary: a list, entries of another shape)."""
    per_chunk = summary.get("per_chunk") if isinstance(summary, Mapping) else None
    entry = next((c for c in per_chunk if isinstance(c, Mapping) and c.get("chunk") == chunk), None) \
        if isinstance(per_chunk, list) else None
    sha = entry.get("sha256") if entry is not None else None
    return sha if isinstance(sha, str) else None


def label(chunk: int) -> str:
    """The chunk's label in file names and the rules' `chunk` wildcard: zero-padded to 5 digits."""
    return f"{chunk:0{WIDTH}d}"


def labels(n_chunks: int) -> list[str]:
    return [label(i) for i in range(n_chunks)]


def name(chunk: int, suffix: str) -> str:
    """File name of one chunk's output: `chunk-00007` + suffix (`.parquet`, `.hss`, `.json`)."""
    return f"chunk-{label(chunk)}{suffix}"


def records(chunk: int, prompts_per_chunk: int, n_records: int) -> range:
    """Indices of the input records (mixture order) that belong to `chunk`; the last chunk may hold fewer."""
    start = chunk * prompts_per_chunk
    return range(start, min(start + prompts_per_chunk, n_records))


def of_record(index: int, prompts_per_chunk: int) -> int:
    """The chunk input record `index` belongs to."""
    return index // prompts_per_chunk


def of_name(file_name: str, suffix: str) -> int | None:
    """The chunk a per-chunk file's name says (exactly `chunk-NNNNN<suffix>`, 5 digits), else None."""
    m = re.fullmatch(rf"chunk-({WILDCARD}){re.escape(suffix)}", file_name)
    return int(m[1]) if m else None


def beyond(folder: str | os.PathLike[str], suffix: str, n_chunks: int) -> list[tuple[Path, int]]:
    """The per-chunk files in `folder` (named exactly `chunk-NNNNN<suffix>`, 5 digits, or a killed write's temporary
    file of one) of a chunk >= `n_chunks`, with their chunk, in chunk order; nothing else (another name, a folder)
    is listed. A missing folder holds none."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    found = []
    for e in entries:
        chunk = of_name(e.name, suffix)
        if chunk is None and (target := temp_target(e.name)):  # a killed write's temporary file: GBs of a shard
            chunk = of_name(target, suffix)
        if chunk is not None and chunk >= n_chunks and not e.is_dir(follow_symlinks=False):
            found.append((Path(folder) / e.name, chunk))
    return sorted(found, key=lambda f: f[1])


def remove_beyond(folder: str | os.PathLike[str], suffix: str, n_chunks: int, *,
                  out: TextIO | None = None) -> list[Path]:
    """Delete `beyond(folder, suffix, n_chunks)`: the files of chunks an earlier configuration had and this one (of
    `n_chunks` chunks) does not, which would otherwise be read with the current ones (a shard folder, a glob). One
    line on `out` (stdout) per file removed; a symlink is removed, never its target. Returns the paths removed."""
    removed = []
    for path, chunk in beyond(folder, suffix, n_chunks):
        path.unlink(missing_ok=True)
        print(f"removed {path}: chunk {chunk} of an earlier configuration (now {n_chunks} chunks)",
              file=out or sys.stdout, flush=True)
        removed.append(path)
    return removed


def incomplete_prepare(run_dir: str | os.PathLike[str], n_chunks: int, shard_suffix: str) -> str | None:
    """A warning when prepare's output (every chunk's prompts and summary.json, one job) lacks a file while shards
    of the run are there: Snakemake plans nothing for it then, but the next run that extracts any chunk reruns
    prepare first, and every chunk after it (their prompts rewritten): GPU hours for shards already made. Not where
    prepare recorded another chunk count (summary.json): the files are new chunks of a changed config, which reruns
    prepare itself."""
    run = Path(run_dir)
    try:
        summary = _summary(run)
        recorded = summary.get("num_chunks", n_chunks)
    except (OSError, ValueError, RecursionError, AttributeError):
        recorded = n_chunks  # none (lost: said below) or unreadable: the count is taken as unchanged
    if recorded != n_chunks:
        return None
    missing = [p for p in (*(run / "prompts" / name(c, ".parquet") for c in range(n_chunks)),
                           run / "prompts" / "summary.json") if not p.is_file()]
    shards = [c for c in range(n_chunks) if (run / "shards" / name(c, shard_suffix)).is_file()]
    if not missing or not shards:
        return None
    shown = ", ".join(str(p) for p in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return (f"hsextract: WARNING: {shown} {'is' if len(missing) == 1 else 'are'} missing (prepare writes every "
            f"chunk's prompts in one job). Snakemake plans nothing for that, but the next run that extracts any chunk "
            f"runs prepare again first, and then all {n_chunks} chunks: the {len(shards)} shards there would be "
            f"extracted again. To keep them, restore the file(s) with their times (cp -p from a copy) before that run")


def _summary(run: Path) -> Any:
    """prompts/summary.json read at parse time: ValueError for one that is no regular file of at most 256 MiB (a
    FIFO would block the parse, /dev/zero fill the memory)."""
    path = run / "prompts" / "summary.json"
    if not is_small_regular(path, 256 << 20):
        raise ValueError(f"{path}: not a regular file of at most 256 MiB")
    return json.loads(path.read_text(encoding="utf-8"))


def damaged_prompts(run_dir: str | os.PathLike[str], n_chunks: int, shard_suffix: str) -> str | None:
    """An error for a chunk whose prompts file is newer than its shard, so that Snakemake would extract the chunk
    again (deleting the shard first), but is not the file prepare wrote (its summary.json's sha256): damaged or
    changed behind prepare's back, the shard made from the original is good. Only such newer files are hashed."""
    run = Path(run_dir)
    try:
        summary = _summary(run)
    except (OSError, ValueError, RecursionError):
        return None
    for c in range(n_chunks):
        prompts, shard = run / "prompts" / name(c, ".parquet"), run / "shards" / name(c, shard_suffix)
        try:
            if prompts.stat().st_mtime <= shard.stat().st_mtime or (written := written_sha256(summary, c)) is None \
                    or not is_small_regular(prompts, 1 << 40):
                continue
            now = sha256_file(prompts)
        except OSError:
            continue
        if now != written:
            return (f"{prompts} is newer than {shard}, so Snakemake would extract chunk {c} again, deleting that "
                    f"shard first; but it is not the prompts file prepare wrote (sha256 {now}, prepare recorded "
                    f"{written}): it was damaged or changed since, and the shard made from the original is good. "
                    f"Restore {prompts} (`cp -p` from a copy) and run the command again; or delete it and run the "
                    "same command, which writes every chunk's prompts again and extracts every chunk again.")
    return None


__all__ = ["WIDTH", "WILDCARD", "beyond", "count", "damaged_prompts", "incomplete_prepare", "label", "labels",
           "name", "of_name", "of_record", "records", "remove_beyond"]
