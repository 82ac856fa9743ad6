"""`open_dataset`: every shard of a run as one map-style torch Dataset of speculators v1 dicts."""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from hsextract.errors import ShardError
from hsextract.shard import SHARD_SUFFIX, ShardReader

# Keys that must agree across shards for their samples to form one training set.
CONSISTENT_KEYS = ("model", "aux_layers", "final_state", "hidden_size", "dtype", "num_hidden_tensors")


def find_shards(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """A run's results folder (its shards/), a folder of shards, one shard, or a list of shards."""
    if isinstance(path, (str, os.PathLike)):
        p = Path(path)
        if p.is_file():
            return [p]
        if not p.is_dir():
            raise ShardError(f"{p}: no such shard, run folder or shard folder")
        folder = p / "shards" if (p / "shards").is_dir() else p
        shards = sorted(folder.glob(f"*{SHARD_SUFFIX}"))
        if not shards:
            raise ShardError(f"{folder}: holds no *{SHARD_SUFFIX} shard; has the extract step run?")
        return shards
    shards = [Path(s) for s in path]
    if not shards:
        raise ShardError("open_dataset was given an empty list of shards")
    return shards


class HiddenStateDataset(Dataset):
    """Samples of several shards, indexed 0..N-1 in shard order then sample order.

    `ds[i]` is exactly the speculators v1 dict. Readers open their file lazily in each process,
    so the dataset is safe to use with DataLoader workers (fork or spawn).
    """

    def __init__(self, shards: list[Path]) -> None:
        self.readers = [ShardReader(s) for s in shards]
        first = self.readers[0].metadata
        for r in self.readers[1:]:
            for k in CONSISTENT_KEYS:
                if r.metadata.get(k) != first.get(k):
                    raise ShardError(
                        f"{r.path}: {k} = {r.metadata.get(k)!r} but {self.readers[0].path} has {first.get(k)!r}; "
                        "shards of one dataset must come from the same model and capture settings"
                    )
        self._starts: list[int] = []
        total = 0
        for r in self.readers:
            self._starts.append(total)
            total += len(r)
        self._len = total

    @property
    def metadata(self) -> dict[str, Any]:
        """The first shard's metadata plus the dataset's shard list and size."""
        meta = dict(self.readers[0].metadata)
        meta.pop("chunk", None)
        meta["shards"] = [str(r.path) for r in self.readers]
        meta["num_samples"] = self._len
        return meta

    def __len__(self) -> int:
        return self._len

    def locate(self, i: int) -> tuple[ShardReader, int]:
        if not -self._len <= i < self._len:
            raise IndexError(f"sample {i} out of range (dataset holds {self._len})")
        i %= self._len
        k = bisect.bisect_right(self._starts, i) - 1
        return self.readers[k], i - self._starts[k]

    def __getitem__(self, i: int) -> dict[str, Any]:
        reader, j = self.locate(int(i))
        return reader[j]

    @property
    def sample_lengths(self) -> list[int]:
        return [n for r in self.readers for n in r.seq_lens]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for r in self.readers:
            yield from r.iter_samples()


def open_dataset(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> HiddenStateDataset:
    return HiddenStateDataset(find_shards(path))
