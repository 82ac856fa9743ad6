"""`open_dataset`: every shard of a run as one map-style torch Dataset of speculators v1 dicts, and
`HiddenStateDataset.stream`: the same samples as a shuffled IterableDataset that decodes ahead.

Length: the trainer's one import; both views share the shard list, the checks that the shards form one
training set and the sample index, so they stay one module (the shard format itself is hsextract.shard)."""

from __future__ import annotations

import bisect
import json
import operator
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from hsextract.errors import ShardError
from hsextract.layers import HIDDEN_STATES, describe, shard_convention, shard_hidden_states
from hsextract.shard import SHARD_SUFFIX, ShardReader
from hsextract.shard.inspect import metadata_shown

# Keys that must agree across shards for their samples to form one training set.
# (aux layers are compared as hidden_states ids: a shard written before the convention was recorded holds the
# same layers under other numbers)
CONSISTENT_KEYS = ("final_state", "final_norm", "hidden_size", "dtype", "num_hidden_tensors")
# ... and what the states and ids were made from: by content where both shards record its hash (other weights or
# another tokenizer under the same path are another model; the same under another path, as a run elsewhere names
# it, is not), else by the key beside it (the model's path)
IDENTITY_KEYS = (("model_hash", "model"), ("tokenizer_hash", None), ("chat_template_hash", None))


MANIFEST_NAME = "dataset.json"
# a trainer reads a copy, on a machine without the workflow: the producer's run folder is whole
COPY_AGAIN = "in a copy of a run folder, copy the files named here again from the original instead"


def run_folder(path: str | os.PathLike[str]) -> Path | None:
    """The run folder `path` names, itself, its dataset.json or its shards/ folder, where one holds a dataset.json;
    else None. Read through its manifest: a shard missing from a partial copy is an error, not a smaller dataset."""
    p = Path(path)
    if p.name == MANIFEST_NAME and p.is_file() or p.name == "shards" and p.is_dir():
        p = p.parent
    return p if (p / MANIFEST_NAME).is_file() else None


def manifest_shards(run_dir: Path, *, verify_checksums: bool = False, allow_missing: bool = False) -> list[Path]:
    """The shards dataset.json lists, each checked to exist with the recorded size (and sha256 if asked).

    A run folder is read through its manifest, not by globbing: a deleted or truncated shard must be an
    error, never a silently smaller dataset. `allow_missing` reads what is there, with a warning on stderr.
    """
    manifest = run_dir / MANIFEST_NAME
    try:
        entries = json.loads(manifest.read_text(encoding="utf-8"))["shards"]
        listed = [(run_dir / e["path"], int(e["bytes"]), str(e["sha256"])) for e in entries]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ShardError(f"{manifest}: not a readable hsextract dataset.json ({type(e).__name__}: {e}); "
                         f"delete it and run the workflow's command again, which writes it again (no chunk is "
                         f"extracted again); {COPY_AGAIN}") from None
    for i, e in enumerate(entries):  # relative, inside the folder: a dataset is moved and shared whole
        if Path(e["path"]).is_absolute() or ".." in Path(e["path"]).parts:
            raise ShardError(f"{manifest}: shards[{i}].path {e['path']!r} is not a path inside the run folder "
                             "(dataset.json lists its shards relative to it); delete it and run the workflow's "
                             "command again, which writes it again")
    from hsextract.provenance import sha256_file

    ok: list[Path] = []
    problems: list[str] = []
    damaged: list[str] = []  # present but not what was written: Snakemake sees no reason to redo their chunks
    for path, size, sha in listed:
        if path.exists() and not path.is_file():  # a folder where the shard was: nothing reruns until it goes
            problems.append(f"{path}: listed in {manifest} but not a regular file")
            damaged.append(str(path))
        elif not path.is_file():
            problems.append(f"{path}: listed in {manifest} but missing")
        elif path.stat().st_size != size:
            problems.append(f"{path}: {path.stat().st_size} bytes, {manifest} records {size}")
            damaged.append(str(path))
        elif verify_checksums and sha256_file(path) != sha:
            problems.append(f"{path}: sha256 differs from the one {manifest} records")
            damaged.append(str(path))
        else:
            ok.append(path)
    if problems:
        what = "; ".join(problems)
        # prepare writes every chunk's prompts in one job, after which the workflow extracts every chunk again
        rewritten = _prompts_rewritten(run_dir, entries)
        later = (f"{run_dir} is part way through a later run: prepare rewrote the prompts of chunk "
                 f"{', '.join(map(str, rewritten))} after {manifest} was written, and that run extracts every chunk "
                 f"again") if rewritten else None
        if later and not allow_missing:  # not damage (or not only): finishing that run redoes every chunk
            raise ShardError(
                f"{what}. {later}. Finish it (its command and config file: {MANIFEST_NAME} is written again once "
                f"every chunk is done); deleting shards would throw away chunks it already extracted")
        if not allow_missing:
            delete = f"Delete {' '.join(damaged)}, then rerun" if damaged else "Rerun"
            raise ShardError(f"{what}. {delete} the workflow (`snakemake --cores N`): only these chunks are "
                             f"extracted again; {COPY_AGAIN}; or, to read the other shards, pass allow_missing=True "
                             f"(hsextract export: --allow-missing)")
        print(f"WARNING: reading {len(ok)} of {len(listed)} shards: {what}"
              + (f". {later}: the shards read may be either run's" if later else ""), file=sys.stderr)
    if not ok:
        raise ShardError(f"{manifest}: none of its {len(listed)} shards can be read")
    return ok


def _prompts_rewritten(run_dir: Path, entries: list[dict[str, Any]]) -> list[int]:
    """The chunks whose prompts prepare recorded (prompts/summary.json) with another sha256 than the manifest's
    shard was made from: a later run rewrote them. Unknown (an older summary, none at all): none."""
    from hsextract.config import chunks

    try:
        summary = json.loads((run_dir / "prompts" / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return []
    out = []
    for e in entries:
        now = chunks.written_sha256(summary, e.get("chunk"))
        if now is not None and isinstance(e.get("prompts_sha256"), str) and now != e["prompts_sha256"]:
            out.append(e["chunk"])
    return out


def _each_once(shards: list[Path], where: str) -> list[Path]:
    """`shards`, refused where one file comes twice (its samples would too, and an epoch would hold them twice)."""
    seen: dict[Path, Path] = {}
    for s in shards:
        try:
            key = s.resolve()
        except (OSError, RuntimeError):  # a symlink loop (Python 3.11): the reader refuses the path, saying so
            key = Path(os.path.abspath(s))
        if key in seen:
            raise ShardError(f"{where} names {key} twice (as {seen[key]} and {s}): a dataset holds each shard once")
        seen[key] = s
    return shards


def find_shards(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                verify_checksums: bool = False, allow_missing: bool = False) -> list[Path]:
    """A run's results folder (the shards its dataset.json lists; refused without one), its dataset.json or its
    shards/ folder (the same), a folder of shards, one shard, or a list of any of these."""
    if isinstance(path, (str, os.PathLike)):
        run = run_folder(path)
        if run is not None:
            return _each_once(manifest_shards(run, verify_checksums=verify_checksums, allow_missing=allow_missing),
                              str(run / MANIFEST_NAME))
        p = Path(path)
        if p.exists() and not p.is_dir():  # a FIFO or a device too: the reader refuses it, saying why
            return [p]
        if not p.is_dir():
            raise ShardError(f"{p}: no such shard, run folder or shard folder")
        if (p / "shards").is_dir():  # a run folder whose manifest is not written: the run is unfinished
            raise ShardError(
                f"{p}: no {MANIFEST_NAME}: the run has not finished (its manifest job writes it once every shard is "
                f"valid), so {p / 'shards'} may lack chunks. Finish the run (`snakemake --cores N`: only the missing "
                f"chunks are extracted), or name that shards folder to read the shards present as they are")
        folder = p
        shards = sorted(folder.glob(f"*{SHARD_SUFFIX}"))
        if not shards:
            raise ShardError(f"{folder}: holds no *{SHARD_SUFFIX} shard; has the extract step run?")
        return shards
    entries = list(path)
    if not entries:
        raise ShardError("open_dataset was given an empty list of shards")
    # each entry as one path is read (runs grown by a run of their own per increment are read together)
    return _each_once([s for p in entries for s in find_shards(p, verify_checksums=verify_checksums,
                                                               allow_missing=allow_missing)], "the list of shards")


def _no_copies(readers: Sequence[ShardReader]) -> None:
    """ShardError where two shards are one chunk's (a copy, a hard link, a shard under another name): an epoch
    would hold its samples twice. A chunk is known by the prompts file it was made from (its sha256); a shard too
    old to record it, by its run, chunk and sample ids, against every other shard (a new copy of its chunk too)."""
    by_sha: dict[str, Path] = {}
    by_ids: dict[Any, Path] = {}  # every shard's (run, chunk, sample ids)
    by_ids_unhashed: dict[Any, Path] = {}  # those of shards without the sha256
    for r in readers:
        if not len(r):  # a chunk whose records were all dropped: no sample to hold twice (and every run's empty
            continue  # prompts file has the same bytes)
        meta = r.metadata
        sha = meta.get("prompts_sha256")
        sha = sha if isinstance(sha, str) else None
        run, chunk = meta.get("run_name"), meta.get("chunk")
        ids = (run, chunk, tuple(r.sample_ids)) if _hashable(run) and _hashable(chunk) and chunk is not None else None
        same = "made from the same prompts"
        other = by_sha.get(sha) if sha is not None else None
        if other is None and ids is not None:  # a shard of an earlier release is the same chunk by its ids
            other = (by_ids_unhashed if sha is not None else by_ids).get(ids)
            same = ("the same sample ids, both too old to record their prompts' sha256" if sha is None and ids
                    in by_ids_unhashed else "the same sample ids; one too old to record its prompts' sha256")
        if other is not None:
            raise ShardError(
                f"{r.path} and {other} hold the same samples (chunk {chunk} of run {run!r}, {same}): one is a "
                f"copy of the other, and a dataset holds each sample once. Move the copy out of the shards, or "
                f"name the shards to read")
        if sha is not None:
            by_sha[sha] = r.path
        if ids is not None:
            by_ids.setdefault(ids, r.path)
            if sha is None:
                by_ids_unhashed.setdefault(ids, r.path)


def _hashable(value: Any) -> bool:
    """A hand-made shard's run or chunk may be a list: no key, not a crash."""
    try:
        hash(value)
    except TypeError:
        return False
    return True


class HiddenStateDataset(Dataset):
    """Samples of several shards, indexed 0..N-1 in shard order then sample order.

    `ds[i]` is exactly the speculators v1 dict. Readers open their file lazily in each process,
    so the dataset is safe to use with DataLoader workers (fork or spawn); a process keeps at most
    hsextract.shard.reader.MAX_OPEN shard files open, whatever the number of shards (ShardReader).
    """

    def __init__(self, shards: list[Path], *, decode_threads: int = 1) -> None:
        self.readers = [ShardReader(s, decode_threads=decode_threads) for s in shards]
        first = self.readers[0].metadata
        for r in self.readers[1:]:
            if shard_hidden_states(r.metadata) != shard_hidden_states(first):
                raise ShardError(
                    f"{r.path}: holds {describe(shard_hidden_states(r.metadata))} but {self.readers[0].path} holds "
                    f"{describe(shard_hidden_states(first))}; shards of one dataset must come from the same model "
                    "and capture settings")
            for hashed, fallback in IDENTITY_KEYS:
                both = r.metadata.get(hashed) is not None and first.get(hashed) is not None
                k = hashed if both else fallback
                if k is not None and r.metadata.get(k) != first.get(k):
                    raise ShardError(
                        f"{r.path}: {k} = {r.metadata.get(k)!r} (model {r.metadata.get('model')!r}) but "
                        f"{self.readers[0].path} has {first.get(k)!r} (model {first.get('model')!r}); shards of one "
                        "dataset must come from the same model, tokenizer and chat template")
            for k in CONSISTENT_KEYS:
                if r.metadata.get(k) != first.get(k):
                    a, b = metadata_shown(k, r.metadata.get(k)), metadata_shown(k, first.get(k))
                    raise ShardError(
                        f"{r.path}: {k} = {a!r} but {self.readers[0].path} has {b!r}; "
                        "shards of one dataset must come from the same model and capture settings"
                    )
        _no_copies(self.readers)
        self._starts: list[int] = []
        total = 0
        for r in self.readers:
            self._starts.append(total)
            total += len(r)
        self._len = total

    @property
    def metadata(self) -> dict[str, Any]:
        """The first shard's metadata plus the dataset's shard list, size and shard format versions (the highest
        as `format_version`, as dataset.json's `shard_format_version`)."""
        meta = dict(self.readers[0].metadata)
        # the aux layers as hidden_states ids whatever the shards recorded (the recorded convention kept beside)
        meta["recorded_layer_convention"] = shard_convention(meta)
        meta["aux_layers"], meta["layer_convention"] = shard_hidden_states(meta), HIDDEN_STATES
        meta.pop("chunk", None)
        meta.pop("prompts_sha256", None)  # each shard's own, as its chunk
        # shards of one dataset may differ in version (a chunk whose samples take no prefix is version 1)
        meta["format_versions"] = sorted({int(r.metadata["format_version"]) for r in self.readers})
        meta["format_version"] = meta["format_versions"][-1]
        meta["shards"] = [str(r.path) for r in self.readers]
        meta["num_samples"] = self._len
        return meta

    def __len__(self) -> int:
        return self._len

    def locate(self, i: int) -> tuple[ShardReader, int]:
        k, j = self.locate_shard(i)
        return self.readers[k], j

    def locate_shard(self, i: int) -> tuple[int, int]:
        """(shard number, sample number in that shard) of sample i."""
        if not -self._len <= i < self._len:
            raise IndexError(f"sample {i} out of range (dataset holds {self._len})")
        i %= self._len
        k = bisect.bisect_right(self._starts, i) - 1
        return k, i - self._starts[k]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.sample(i)

    def sample(self, i: int, *, shared_memory: bool = False,
               records: Callable[[int, int], bytes] | None = None) -> dict[str, Any]:
        """Sample i (as `ds[i]`); `shared_memory`: see ShardReader.sample; `records(shard, j)`: where record j of
        that shard comes from when sample i takes rows from it (a stream's cache; by default the file)."""
        # an integer (numpy's, a 0-d integer tensor too), not whatever int() takes: ds["3"], ds[1.5], ds[True]
        if isinstance(i, bool) or not hasattr(type(i), "__index__"):
            raise TypeError(f"sample index must be an integer, not {type(i).__name__} {i!r}")
        k, j = self.locate_shard(operator.index(i))
        fetch = None if records is None else partial(records, k)
        return self.readers[k].sample(j, shared_memory=shared_memory, records=fetch)

    def families(self) -> list[list[int]]:
        """The samples (dataset indices, ascending) of each family: a sample with no parent and every sample that
        takes rows from it, directly or through others (docs/SHARED_PREFIX.md); from the shards' indexes alone.
        A version-1 shard's samples are families of one."""
        out: list[list[int]] = []
        for reader, start in zip(self.readers, self._starts, strict=True):
            root: list[int] = []
            slot: dict[int, int] = {}
            for j, parent in enumerate(reader.parents):
                root.append(j if parent < 0 else root[parent])
                if root[j] not in slot:
                    slot[root[j]] = len(out)
                    out.append([])
                out[slot[root[j]]].append(start + j)
        return out

    def prefetch(self, i: int) -> None:
        """Start reading sample i's record into the page cache (ShardReader.prefetch)."""
        reader, j = self.locate(int(i))
        reader.prefetch(j)

    @property
    def sample_lengths(self) -> list[int]:
        return [n for r in self.readers for n in r.seq_lens]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for r in self.readers:
            yield from r.iter_samples()

    def stream(self, *, shuffle: bool = True, seed: int = 0, readahead: int = 2, prefetch: int = 4,
               batch_size: int | None = 1, rank: int | None = None, world_size: int | None = None,
               group: str | None = None, window: int = 8, cache_bytes: int = 1 << 30) -> SampleStream:
        """These samples as an IterableDataset for a DataLoader: in a fresh random order every epoch, each
        worker decoding its next samples on threads (`readahead` at a time, counting the one it hands out next)
        while the loader collates and sends the current one (a map-style dataset cannot: a worker learns its
        next index only when it asks for it), and asking the disk for the records of the `prefetch` samples
        after those (into the page cache: ShardReader.prefetch), so that a cold read never waits for a hand-over.
        `batch_size`: the DataLoader's; workers take turns by whole batches. With the loader's batch_size=None
        (no collation: each sample arrives as the dataset returns it, without a batch dimension), give None too:
        then each worker decodes its samples straight into shared memory and hands them over without a copy,
        where a collating loader copies every sample once more (into a fresh shared block: about as much as a
        worker's decode costs, on its one main thread).

        `rank`, `world_size`: this rank's share of the data. Left out, they are 0 and 1 (every sample), unless
        torch.distributed is initialized with more than one rank: then they must be given, since the global
        rank is the data-parallel rank only without tensor or pipeline parallelism, and every rank reading
        every sample would train on each sample world_size times without a word.

        `group="family"` (for shards with shared prefixes, docs/SHARED_PREFIX.md): the permutation is drawn over
        families, the samples of `window` families at a time are shuffled together, and each rank takes a
        contiguous share of that order, so a family's samples go to one rank (but those of its share's two ends).
        A worker keeps the records its samples take rows from (compressed, up to `cache_bytes`) until the last of
        its samples that needs them has gone out: each is read once per epoch and worker, not once per sample
        that takes rows from it. Left at None, samples are drawn one by one, as for flat shards."""
        if rank is None and world_size is None:
            rank, world_size = 0, 1
            if (ranks := distributed_ranks()) > 1:
                raise ShardError(
                    f"torch.distributed runs {ranks} ranks: pass stream(rank=..., world_size=...), the "
                    "data-parallel rank and size (under plain DDP or FSDP dist.get_rank() and "
                    "dist.get_world_size()), or world_size=1 for every rank to read every sample")
        elif rank is None or world_size is None:
            raise ShardError(f"rank {rank!r} of world_size {world_size!r}: give both or neither")
        return SampleStream(self, shuffle=shuffle, seed=seed, readahead=readahead, prefetch=prefetch,
                            batch_size=batch_size, rank=rank, world_size=world_size, group=group, window=window,
                            cache_bytes=cache_bytes)


def distributed_ranks() -> int:
    """Ranks of the initialized torch.distributed default group; 1 without one."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class SampleStream(IterableDataset):
    """A HiddenStateDataset's samples, each exactly once per epoch, in a random permutation drawn from
    (seed, epoch); with `world_size` > 1 this rank takes every world_size-th sample of it (the remainder that
    would make ranks unequal is left out of that epoch), and DataLoader worker k of W every W-th batch of
    `batch_size` consecutive samples of those. A loader takes the workers' batches in turn, so it delivers the
    rank's samples in exactly this order.

    Epochs: each further pass over one copy of this object counts one epoch on: in this process, and in
    persistent DataLoader workers (which keep their copy). Workers that are not persistent start every epoch
    from a fresh copy, so there call `set_epoch(e)` before each epoch, as with DistributedSampler, or every
    epoch repeats the first one's order. Resuming from a checkpoint: `set_epoch(e, start=k)`, k = samples of
    epoch e this rank's loader had delivered; the next pass then delivers the rest of that epoch in the same
    order, and the passes after it the epochs after it. `set_epoch` reaches persistent workers too, also once
    they run (a peek at the first batch before it, say): a worker's first pass is the one of the loader iterator
    that made it, and each later one reads epoch and start from a few integers of shared memory, so no copy
    counts on from a pass set_epoch has replaced.
    Memory: up to `readahead` decoded samples per worker (the one being handed out included; the loader's own
    prefetch holds more), and up to `prefetch` records per worker in the page cache, which the kernel reclaims as it
    needs. Use it with `DataLoader(stream, batch_size=B, num_workers=...)`, B the stream's `batch_size` (None for a
    loader that does not collate), and no `shuffle` argument."""

    def __init__(self, dataset: HiddenStateDataset, *, shuffle: bool, seed: int, readahead: int, prefetch: int,
                 batch_size: int | None, rank: int, world_size: int, group: str | None = None, window: int = 8,
                 cache_bytes: int = 1 << 30) -> None:
        if group not in (None, "family"):
            raise ShardError(f"group {group!r}: must be None (samples one by one) or 'family'")
        if not isinstance(window, int) or window < 1:
            raise ShardError(f"window {window!r}: must be an integer >= 1 (families shuffled together)")
        if not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ShardError(f"cache_bytes {cache_bytes!r}: must be an integer >= 0 (a worker's kept records)")
        if not isinstance(readahead, int) or readahead < 0:
            raise ShardError(f"readahead {readahead!r}: must be an integer >= 0 (samples decoded ahead)")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ShardError(f"prefetch {prefetch!r}: must be an integer >= 0 (samples whose records are asked of "
                             "the disk ahead)")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ShardError(f"batch_size {batch_size!r}: must be the DataLoader's batch size, an integer >= 1 or "
                             "None")
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) \
                or not 0 <= rank < world_size:
            raise ShardError(f"rank {rank!r} of world_size {world_size!r}: need 0 <= rank < world_size")
        self.dataset, self.shuffle, self.seed, self.readahead, self.prefetch = (dataset, shuffle, seed, readahead,
                                                                                 prefetch)
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.group, self.window, self.cache_bytes = group, window, cache_bytes
        self._families = dataset.families() if group == "family" else None
        self.records_read = 0  # records read for the rows samples take from others, in this process's last pass
        # [epoch, start, generation, start taken], shared with the DataLoader's workers (forked or spawned, they
        # get this storage, not a copy): set_epoch writes it, and a pass that finds a new generation starts
        # counting from it; `start taken` once a pass has begun from it (len() then counts whole epochs)
        self._state = torch.zeros(4, dtype=torch.int64).share_memory_()
        # (epoch, start, generation) as of this copy's making: a worker's first pass belongs to the loader
        # iterator that made the worker, whenever the worker gets to it (after a later set_epoch, under load)
        self._made = (0, 0, 0)
        self._generation = -1  # the generation this copy's passes count from (-1: no pass yet)
        self._base = (0, 0)  # that generation's epoch and start
        self._passes = 0  # passes of this copy since then

    @property
    def epoch(self) -> int:
        return int(self._state[0])

    @property
    def start(self) -> int:
        return int(self._state[1])

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The next pass is `epoch`, from its `start`-th sample on (this rank's order); the passes after it the
        epochs after it. Reaches persistent workers, started or not."""
        if not isinstance(start, int) or not 0 <= start <= self.per_epoch:
            raise ShardError(f"start {start!r}: must be an integer from 0 to the {self.per_epoch} samples an epoch "
                             "of this rank holds")
        self._state[0], self._state[1], self._state[3] = int(epoch), start, 0
        self._state[2] += 1
        self._made = (int(epoch), start, int(self._state[2]))

    @property
    def per_epoch(self) -> int:
        """Samples an epoch of this rank holds (all its workers together)."""
        return len(self.dataset) // self.world_size

    def __len__(self) -> int:
        """Samples this rank yields in its next pass (less than per_epoch when resumed: set_epoch's start, until a
        pass has begun from it)."""
        return self.per_epoch - (self.start if not int(self._state[3]) else 0)

    def order(self, epoch: int) -> np.ndarray:
        """The indices this rank yields in `epoch`, in order (before the split among workers)."""
        n = len(self.dataset)
        if self._families is not None:  # windows of families, each rank a contiguous share
            rng = np.random.default_rng([self.seed, epoch])
            fams = self._families
            picked = rng.permutation(len(fams)) if self.shuffle else np.arange(len(fams))
            pieces = [np.asarray([i for f in picked[w:w + self.window] for i in fams[f]], dtype=np.int64)
                      for w in range(0, len(fams), self.window)]
            perm = np.concatenate([rng.permutation(p) if self.shuffle else p for p in pieces])
            return perm[self.rank * self.per_epoch:(self.rank + 1) * self.per_epoch]
        perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        return perm[: self.per_epoch * self.world_size][self.rank::self.world_size]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # the pass's epoch is decided here, when the iterator is made, not when its first sample is asked for: a
        # DataLoader worker makes one for a pass that may be asked for nothing until after a set_epoch (a peek's
        # leftover request), which must not take the epoch set_epoch meant for the next pass
        if self._generation < 0:  # this copy's first pass: the state it was made with
            epoch, start, self._generation = self._made
            self._base, self._passes = (epoch, start), 0
        elif int(self._state[2]) != self._generation:  # set_epoch since this copy's last pass
            self._generation, self._passes = int(self._state[2]), 0
            self._base = (int(self._state[0]), int(self._state[1]))
        epoch, start = self._base[0] + self._passes, self._base[1] if self._passes == 0 else 0
        self._passes += 1
        if self._generation == int(self._state[2]):  # not a pass made before a set_epoch (a worker that came late to
            self._state[3] = 1  # a peek's pass): that one does not begin the resumed epoch, whose len() still counts
        return self._pass(self.order(epoch)[start:])

    def _pass(self, mine: np.ndarray) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        if info is not None:
            batch_no = np.arange(len(mine)) // (self.batch_size or 1)
            mine = mine[batch_no % info.num_workers == info.id]
        # uncollated samples leave a worker as they are: in shared memory they cross without a copy
        todo = [int(i) for i in mine]
        cache = _FamilyRecords(self.dataset, todo, self.cache_bytes) if self._families is not None else None
        get = partial(self.dataset.sample, shared_memory=info is not None and self.batch_size is None,
                      records=None if cache is None else cache.get)
        # the disk is asked for the next records on a thread of their own, so that it keeps reading while the
        # samples in hand decode and go out; the decode threads' reads then find them in the page cache
        hints = ThreadPoolExecutor(1, thread_name_prefix="hsx-hint") if self.prefetch else None
        hinted = 0
        # one thread per sample in flight, so `readahead` samples decode side by side; the pools are this
        # pass's own (made in the worker process) and shut down with it, also when the consumer stops early
        pool = ThreadPoolExecutor(self.readahead, thread_name_prefix="hsx-ahead") if self.readahead else None
        pending: deque[Future[dict[str, Any]]] = deque()
        try:
            for k, i in enumerate(todo):
                if hints is not None:  # the records of this sample and the `prefetch` after it
                    for j in todo[hinted:k + 1 + self.prefetch]:
                        hints.submit(self.dataset.prefetch, j)
                    hinted = min(len(todo), k + 1 + self.prefetch)
                if pool is None:
                    out = get(i)
                    if cache is not None:
                        cache.done(k)
                    yield out
                    continue
                pending.append(pool.submit(get, i))
                if len(pending) >= self.readahead:  # readahead - 1 keep decoding while this one goes out
                    yield self._next(pending, cache, k - len(pending) + 1)
            while pending:
                yield self._next(pending, cache, len(todo) - len(pending))
        finally:
            for p in (pool, hints):
                if p is not None:
                    p.shutdown(wait=True, cancel_futures=True)
            if cache is not None:
                self.records_read = cache.reads

    @staticmethod
    def _next(pending: deque[Future[dict[str, Any]]], cache: _FamilyRecords | None, pos: int) -> dict[str, Any]:
        """The oldest sample in flight (position `pos` of the pass); the records no later sample needs go."""
        out = pending.popleft().result()
        if cache is not None:
            cache.done(pos)
        return out


class _FamilyRecords:
    """The records a stream worker's samples take rows from, each kept (compressed, as read) from its first use
    until the last of the worker's samples that needs it, within `limit` bytes (past it a record is read again
    at its next use). Shared by the worker's decode threads: a record is read by the first that needs it."""

    def __init__(self, dataset: HiddenStateDataset, todo: Sequence[int], limit: int) -> None:
        last: dict[tuple[int, int], int] = {}
        for pos, i in enumerate(todo):
            k, j = dataset.locate_shard(i)
            for node, _, _ in dataset.readers[k].supplies(j):
                last[k, node] = pos
        self._ends: dict[int, list[tuple[int, int]]] = {}
        for key, pos in last.items():
            self._ends.setdefault(pos, []).append(key)
        self._readers, self._limit = dataset.readers, limit
        self._kept: dict[tuple[int, int], Future[bytes]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.reads = 0

    def get(self, shard: int, j: int) -> bytes:
        key = (shard, j)
        with self._lock:
            fut = self._kept.get(key)
            mine = fut is None
            if mine:
                fut = self._kept[key] = Future()
        if not mine:
            return fut.result()
        try:
            data = self._readers[shard].record(j)
        except BaseException as e:
            with self._lock:
                del self._kept[key]
            fut.set_exception(e)
            raise
        with self._lock:
            self.reads += 1
            if self._bytes + len(data) <= self._limit:
                self._bytes += len(data)
            else:  # over the limit: used by who waits on it now, then read again
                del self._kept[key]
        fut.set_result(data)
        return data

    def done(self, pos: int) -> None:
        """The sample at position `pos` has gone out: drop the records whose last use it was."""
        with self._lock:
            for key in self._ends.pop(pos, ()):
                fut = self._kept.pop(key, None)
                if fut is not None and fut.done() and fut.exception() is None:
                    self._bytes -= len(fut.result())


def open_dataset(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                 verify_checksums: bool = False, allow_missing: bool = False,
                 decode_threads: int = 1) -> HiddenStateDataset:
    """All samples of a run folder (as its dataset.json lists them; its shards/ folder too), a shard folder, a
    shard or a list of any of these.

    A run folder's listed shards must all be present with their recorded size; `verify_checksums` also
    compares each whole file's sha256 (reads every byte); `allow_missing` reads what is there, warning.
    `decode_threads`: threads that decode one sample's hidden tensors in parallel, per process (ShardReader)."""
    return HiddenStateDataset(find_shards(path, verify_checksums=verify_checksums, allow_missing=allow_missing),
                              decode_threads=decode_threads)
