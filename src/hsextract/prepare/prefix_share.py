"""Shared prefixes within a chunk (docs/SHARED_PREFIX.md, "prepare"): for each sample, the earlier sample it shares
its longest token-identical prefix with, and how many of its leading rows it can take from it.

Candidates come from a dict keyed by a chain of blake2b digests of the ids in blocks of BLOCK tokens (a sample is
entered under the digest of every whole block of its ids), plus the sample just before it from the same record (its
previous turn). Each candidate's common prefix is then measured on the ids themselves, so a digest collision can
only propose a candidate, never make a reference. Time and memory are linear in the chunk's tokens.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hsextract.shard.format import MAX_REFERENCE_DEPTH, NO_PARENT, reference_depth

BLOCK = 64
# Shorter common prefixes are not shared: every sample opens with a few template tokens (`<|im_system|>system
# <|im_middle|>`), and reading a second record to save them costs more than it saves.
MIN_PREFIX = 64


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Tokens at the start of a and b that are equal (on arrays: a chunk's samples, thousands of tokens each, against
    many candidates; masks/ids.py's is on the lists a rendering gives)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def find_parents(ids: Sequence[Sequence[int]], records: Sequence[object] | None = None,
                 min_prefix: int = MIN_PREFIX) -> list[tuple[int, int]]:
    """(parent, prefix length) per sample, (-1, 0) where none shares at least `min_prefix` tokens. A parent is an
    earlier sample; the prefix length k takes at most the parent's tokens and leaves the sample at least one of its
    own (k <= min(len(parent), len(sample) - 1)); the longest common prefix wins, ties go to the shallower sample
    (fewer references above it), then the later one. No parent is MAX_REFERENCE_DEPTH references deep: conversations
    that open alike hang from the first of them instead of from one another, a conversation's turns nest one level
    each, and one of more turns than the limit starts a new chain there.
    `records`: per sample, what it was made from (samples of one record are that conversation's turns)."""
    arrays = [np.asarray(x, dtype=np.int64) for x in ids]
    latest: dict[bytes, int] = {}  # digest of ids[:BLOCK * b] -> the latest sample that starts so
    first: dict[bytes, int] = {}  # ... and the first
    depth: list[int] = []
    out: list[tuple[int, int]] = []
    for i, a in enumerate(arrays):
        digests = []
        h = hashlib.blake2b(digest_size=16)
        for end in range(BLOCK, len(a) + 1, BLOCK):
            h.update(a[end - BLOCK:end].tobytes())
            digests.append(h.copy().digest())
        candidates = set()
        for d in reversed(digests):  # the deepest block another sample shares
            if d in latest:
                candidates.update((latest[d], first[d]))
                break
        if records is not None and i > 0 and records[i - 1] == records[i]:
            candidates.add(i - 1)
        best, best_k = NO_PARENT, 0
        for j in sorted(candidates, key=lambda j: (depth[j], -j)):  # shallower first, then later
            k = min(common_prefix(a, arrays[j]), len(a) - 1)
            if k > best_k and depth[j] < MAX_REFERENCE_DEPTH:
                best, best_k = j, k
        if best_k < min_prefix:
            best, best_k = NO_PARENT, 0
        out.append((best, best_k))
        depth.append(reference_depth(depth, best))
        for d in digests:
            latest[d] = i
            first.setdefault(d, i)
    return out


def distinct_tokens(seq_lens: Sequence[int], refs: Sequence[tuple[int, int]]) -> int:
    """Tokens stored and computed with these references: each sample's, less the prefix it takes from its parent."""
    return sum(seq_lens) - sum(k for _, k in refs)


# what sharing saves, counted from chunk statistics (stats, manifest: kept here, free of pandas, for manifest's env)
def stored_tokens(chunk: Mapping[str, Any]) -> int:
    """A chunk's stored tokens; statistics written before shared prefixes hold none, and came from version-1
    shards, which store every token."""
    return int(chunk.get("stored_tokens", chunk["tokens"]))


def share_saving(tokens: int, stored: int) -> float:
    """Materialized over stored tokens (1.0 without shared prefixes), to 4 decimals."""
    return round(tokens / stored, 4) if stored else 1.0


def raw_stored(chunk: Mapping[str, Any]) -> float:
    """A chunk's raw bytes of what it stores (chunk_stats' bytes_raw_stored: ids and mask of every token, hidden
    rows of the stored ones); statistics written before it hold none: their bytes_raw where every token is stored
    (version 1), else unknown (NaN)."""
    if "bytes_raw_stored" in chunk:
        return int(chunk["bytes_raw_stored"])
    return int(chunk["bytes_raw"]) if stored_tokens(chunk) == int(chunk["tokens"]) else float("nan")


def codec_ratio(stored: float, raw_of_stored: float) -> float | None:
    """The shard codec's ratio: stored bytes over the raw bytes of what is stored, to 4 decimals (None: unknown)."""
    if not raw_of_stored or math.isnan(raw_of_stored):  # a sum with a chunk that does not say (NaN): unknown
        return None
    return round(float(stored) / float(raw_of_stored), 4)
