"""Chunks: the unit of work. Input record k of the mixture (0-based) belongs to chunk k // prompts_per_chunk,
so the chunk count is known from the record count alone, before anything is parsed.

One place for the count, the 5-digit label in every per-chunk file name (`chunk-00007.parquet`) and the
records of a chunk; used by the config checks, prepare and the workflow rules.
"""

from __future__ import annotations

import math

WIDTH = 5
# the `chunk` wildcard of the rules: a label
WILDCARD = rf"\d{{{WIDTH}}}"


def count(n_records: int, prompts_per_chunk: int) -> int:
    """Chunks of `n_records` input records: ceil(n_records / prompts_per_chunk)."""
    return math.ceil(n_records / prompts_per_chunk)


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


__all__ = ["WIDTH", "WILDCARD", "count", "label", "labels", "name", "of_record", "records"]
