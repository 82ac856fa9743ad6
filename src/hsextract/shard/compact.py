"""A shard's index, once parse.index has checked it, kept in a few numpy arrays instead of Python lists.

The JSON index parses to a list of Python ints (28-32 bytes each plus an 8-byte list slot) per column and a str per
sample: ~300 bytes a sample, tens of GB per process for a dataset of tens of millions of samples, and the pages
of a DataLoader worker (forked) copied one by one as refcounts are written. Here a sample costs a few tens of bytes
(its id's UTF-8 bytes plus 32, plus 12 with references) and no Python object exists per sample.

Every value leaves as a Python int or str (never a numpy scalar: JSON refuses those, and numpy arithmetic mixing
uint64 and int64 makes float64), lists as lists: the same types and values as the parsed JSON.

Columns, from the checks of parse.index:
    bounds       int64[n + 1]  record i spans [bounds[i], bounds[i + 1]): the records tile the data exactly, so
                               offsets and record_lens are one array
    payload_xxh3 uint64[n]     [0, 2^64)
    seq_lens     int32[n]      [1, MAX_SEQ = 2^24]; num_trained and prefix_lens are at most seq_len
    num_trained  int32[n]
    parents      int64[n]      -1 or an earlier sample (n is a u32); version 2 only, as prefix_lens
    prefix_lens  int32[n]
    raw_bytes    not kept: parse.index checked it equals seq_len times the metadata's bytes per token
    sample_ids   one bytes buffer of their UTF-8 (lone surrogates, which JSON escapes can make, kept by
                 "surrogatepass") and int64[n + 1] offsets into it
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np

from hsextract.shard import format as fmt
from hsextract.shard import parse

assert parse.MAX_SEQ < 1 << 31  # seq_lens, num_trained, prefix_lens fit int32

_UTF8 = ("utf-8", "surrogatepass")


class CompactIndex:
    """The columns above; one sample's values through memoryviews of the arrays (indexing one makes a Python int
    without a numpy scalar on the way, faster than int(a[i]) or a.item(i)), whole columns and totals
    through the arrays."""

    __slots__ = ("version", "bounds", "payload_xxh3", "seq_lens", "num_trained", "parents", "prefix_lens",
                 "_ids", "_id_bounds", "_row_bytes", "_views")

    def __init__(self, ix: dict[str, list[Any]], meta: dict[str, Any], index_offset: int) -> None:
        """`ix`: parse.index's checked columns of a shard whose index starts at byte `index_offset`, emptied here
        (each list is let go once it is an array, so that opening a shard holds its lists and arrays together
        one column at a time)."""
        self.version: int = meta["format_version"]
        n = len(ix["offsets"])
        self.bounds = np.empty(n + 1, np.int64)
        self.bounds[:n] = ix.pop("offsets")
        self.bounds[n] = index_offset
        del ix["record_lens"], ix["raw_bytes"]  # bounds and seq_lens make them
        self.payload_xxh3 = np.array(ix.pop("payload_xxh3"), np.uint64)
        self.seq_lens = np.array(ix.pop("seq_lens"), np.int32)
        self.num_trained = np.array(ix.pop("num_trained"), np.int32)
        # version 1: no sample has a parent (the accessors answer -1 and 0)
        self.parents = np.array(ix.pop("parents"), np.int64) if "parents" in ix else None
        self.prefix_lens = np.array(ix.pop("prefix_lens"), np.int32) if "prefix_lens" in ix else None
        self._row_bytes = parse.raw_bytes(meta, 1)  # raw_bytes = seq_len x this (parse.index checked it)
        ids = ix.pop("sample_ids")
        self._id_bounds = np.zeros(n + 1, np.int64)
        joined = "".join(ids)
        if joined.isascii():  # a character is a byte
            np.cumsum(np.fromiter(map(len, ids), np.int64, n), out=self._id_bounds[1:])
            self._ids = joined.encode("ascii")
        else:
            del joined
            encoded = [s.encode(*_UTF8) for s in ids]
            np.cumsum(np.fromiter(map(len, encoded), np.int64, n), out=self._id_bounds[1:])
            self._ids = b"".join(encoded)
        self._view()

    def _arrays(self) -> tuple[np.ndarray | None, ...]:
        return (self.bounds, self.payload_xxh3, self.seq_lens, self.num_trained, self.parents, self.prefix_lens,
                self._id_bounds)

    def _view(self) -> None:
        """The arrays made read-only, and their memoryviews (in _arrays' order)."""
        for a in self._arrays():
            if a is not None:
                a.flags.writeable = False
        self._views = tuple(None if a is None else memoryview(a) for a in self._arrays())

    def __getstate__(self) -> dict[str, Any]:  # pickled (a spawned DataLoader worker): arrays, not memoryviews
        return {k: getattr(self, k) for k in self.__slots__ if k != "_views"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._view()

    def __len__(self) -> int:
        return len(self.seq_lens)

    def nbytes(self) -> int:
        """Bytes the index holds (arrays and id buffer)."""
        return len(self._ids) + sum(a.nbytes for a in self._arrays() if a is not None)

    # -- one sample: Python ints and strs; i as a list index (negative from the end) --------------------------
    def _pos(self, i: int) -> int:
        """i as an index into the n + 1 bounds (a list's IndexError past either end)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range ({n} samples)")
        return i % n

    def span(self, i: int) -> tuple[int, int]:
        """(offset, record length) of record i."""
        i = self._pos(i)
        bounds = self._views[0]
        off = bounds[i]
        return off, bounds[i + 1] - off

    def offset(self, i: int) -> int:
        return self._views[0][self._pos(i)]

    def record_len(self, i: int) -> int:
        return self.span(i)[1]

    def digest(self, i: int) -> int:
        return self._views[1][i]

    def seq_len(self, i: int) -> int:
        return self._views[2][i]

    def parent(self, i: int) -> int:
        parents = self._views[4]
        return fmt.NO_PARENT if parents is None else parents[i]

    def prefix_len(self, i: int) -> int:
        prefix = self._views[5]
        return 0 if prefix is None else prefix[i]

    def sample_id(self, i: int) -> str:
        i = self._pos(i)
        ends = self._views[6]
        return self._ids[ends[i]:ends[i + 1]].decode(*_UTF8)

    def supplies(self, i: int) -> list[tuple[int, int, int]]:
        """ShardReader.supplies: (ancestor, lo, hi) per segment of sample i's rows taken from an ancestor."""
        out: list[tuple[int, int, int]] = []
        parents, prefix = self._views[4], self._views[5]
        if parents is None:  # version 1
            return out
        node, hi = parents[i], prefix[i]
        while hi > 0:
            lo = prefix[node]
            if lo < hi:
                out.append((node, lo, hi))
                hi = lo
            node = parents[node]
        return out

    # -- whole columns: Python lists and ints ----------------------------------------------------
    def sample_id_list(self) -> list[str]:
        ends = self._id_bounds.tolist()
        ids = self._ids
        if ids.isascii():  # one str, sliced: byte offsets are character offsets
            text = ids.decode("ascii")
            return [text[a:b] for a, b in pairwise(ends)]
        return [ids[a:b].decode(*_UTF8) for a, b in pairwise(ends)]

    def parent_list(self) -> list[int]:
        return [fmt.NO_PARENT] * len(self) if self.parents is None else self.parents.tolist()

    def prefix_len_list(self) -> list[int]:
        return [0] * len(self) if self.prefix_lens is None else self.prefix_lens.tolist()

    def column(self, name: str) -> list[Any]:
        """Index column `name` as the file's JSON holds it."""
        if name == "sample_ids":
            return self.sample_id_list()
        if name == "offsets":
            return self.bounds[:-1].tolist()
        if name == "record_lens":
            return np.diff(self.bounds).tolist()
        if name == "raw_bytes":
            return [self._row_bytes * s for s in self.seq_lens.tolist()]
        if name == "parents":
            return self.parent_list()
        if name == "prefix_lens":
            return self.prefix_len_list()
        if name in ("payload_xxh3", "seq_lens", "num_trained"):
            return getattr(self, name).tolist()
        raise KeyError(name)

    def columns(self) -> dict[str, list[Any]]:
        """Every column of the file's version, in the file's order, as lists of Python ints and strs."""
        return {c: self.column(c) for c in fmt.index_columns(self.version)}

    def total(self, name: str) -> int:
        """The sum of a numeric column (seq_lens, num_trained, prefix_lens, raw_bytes), a Python int."""
        if name == "raw_bytes":
            return self._row_bytes * self.total("seq_lens")
        if name == "prefix_lens" and self.prefix_lens is None:
            return 0
        return int(getattr(self, name).sum(dtype=np.int64))

    def shared_samples(self) -> int:
        """Samples that take rows from a parent."""
        return 0 if self.parents is None else int(np.count_nonzero(self.parents >= 0))
