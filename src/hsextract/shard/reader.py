"""Shard reader: random access through the index, checked at every step, fork-safe.

Length: one class, ShardReader, because every read path (a sample, a prefix-shared sample assembled from its
parent, prefetch, the parallel read of a large record, verify) goes through the same per-process state: the
file handle (from a cache of at most MAX_OPEN per process, reopened after a fork), the parsed index, the thread
pools and the per-thread buffers. The byte layout is in format.py, footer and index parsing in parse.py, the
tensor codecs in codec.py.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import stat
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard as zstd

from hsextract.errors import CorruptShardError, ShardError
from hsextract.shard import format as fmt
from hsextract.shard import parse
from hsextract.shard.codec import DTYPES, dequantize_fp8, join_planes
from hsextract.shard.compact import CompactIndex

Sample = dict[str, Any]
REUSE_MAX = 256 << 20  # records up to this size are read into a buffer kept per thread (see _record_buffer)
# iter_samples holds decoded samples ahead of its consumer up to this size (at least one): four small samples, one
# long sample of a large model (Kimi-K2.5: 57 KB a token, 7.5 GB at 128k tokens), not four
AHEAD_BYTES = 1 << 30
PARALLEL_READ_MIN = 8 << 20  # with decode threads, records from this size are read in slices in parallel
HINT_PIECE = 128 << 10  # ShardReader.prefetch's piece where the disk's limits are not known (the default read_ahead_kb)
# shard files a process keeps open, all readers together (a dataset may hold thousands of shards, each DataLoader
# worker all of them, under a soft limit of 1024 open files): past it the least recently used idle one is closed,
# and reopened at its next read (ShardReader._file). Read at each open: a value set in a process holds there and in
# the workers it forks (spawned ones import 128 again)
MAX_OPEN = 128

# threads by (job, pool size), shared by every reader of this process; reads and decodes have pools of their own,
# so that slices waiting on the disk never hold up a decode (two samples in flight: HiddenStateDataset.stream)
_POOLS: dict[tuple[str, int], ThreadPoolExecutor] = {}
_LOCK = threading.Lock()  # _POOLS and _HANDLES (decode, read and hint threads race to a reader's first open)
# a thread's record buffer and zstd context, shared by every reader: kept per reader, they would add up to one
# buffer per shard the thread reads from (a Kimi-scale dataset: hundreds of shards, records up to REUSE_MAX)
_THREAD = threading.local()


class _Open:
    __slots__ = ("fd", "users")

    def __init__(self, fd: int) -> None:
        self.fd, self.users = fd, 0


# this process's open shard files by reader key, least recently used first; a file in use (users > 0: a read or a
# prefetch in progress on some thread) is never closed under it, so only those can take the count past MAX_OPEN
_HANDLES: OrderedDict[int, _Open] = OrderedDict()
_KEYS = itertools.count()  # a reader's key in _HANDLES: one per reader object and process (ids are reused)


def _trim() -> None:
    """Close the least recently used idle files past MAX_OPEN (the caller holds _LOCK)."""
    over = len(_HANDLES) - MAX_OPEN
    if over > 0:
        for key in [k for k, h in _HANDLES.items() if h.users == 0][:over]:
            os.close(_HANDLES.pop(key).fd)


def _after_fork_in_child() -> None:
    # a forked child (a DataLoader worker) inherits the pools but not their threads: it starts its own; and the open
    # files, which it closes (its readers reopen theirs, checked to be the same files, at their next read)
    global _LOCK
    _POOLS.clear()
    _LOCK = threading.Lock()
    for h in _HANDLES.values():
        with contextlib.suppress(OSError):
            os.close(h.fd)
    _HANDLES.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _pool(job: str, threads: int) -> ThreadPoolExecutor:
    with _LOCK:
        pool = _POOLS.get((job, threads))
        if pool is None:
            pool = _POOLS[job, threads] = ThreadPoolExecutor(threads, thread_name_prefix=f"hsx-{job}")
        return pool


@functools.cache  # one disk's limits, asked once per process
def hint_piece(dev: int, sys_root: Path = Path("/sys")) -> int:
    """The most bytes one posix_fadvise(WILLNEED) starts reading on block device `dev` (a file's st_dev): Linux
    reads max(read_ahead_kb, max_sectors_kb) of the range and drops the rest without a word. HINT_PIECE where
    sysfs does not say (no sysfs; a file system without a block device of its own, as overlayfs)."""
    node = sys_root / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}"
    for queue in (node / "queue", node / ".." / "queue"):  # a disk, or a partition of one
        try:
            kb = max(int((queue / name).read_text(encoding="utf-8")) for name in ("read_ahead_kb", "max_sectors_kb"))
        except (OSError, ValueError):
            continue
        return max(kb << 10, 4096)  # read_ahead_kb 0 leaves max_sectors_kb, at least a page
    return HINT_PIECE


def _shared_bytes(nbytes: int) -> torch.Tensor:
    """An nbytes uint8 tensor in shared memory, as the DataLoader's default collate makes them (its pages are
    faulted in by whoever writes it first: here the decode threads, not the worker's one main thread)."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes), 0, (nbytes,))


def _identity_of(st: os.stat_result) -> tuple[int, int, int, int]:
    """A file's (st_dev, st_ino, st_size, st_mtime_ns): what a reader compares with the file its index was read
    from."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ShardReader:
    """Read a shard written by ShardWriter.

    Opening checks footer, index and header checksums. `reader[i]` reads and checks one record
    (its checksum, its sample number, every frame's content checksum) and returns exactly the
    speculators v1 dict. The file is opened per process (os.pread, no shared offset), so a
    reader can be handed to DataLoader workers, forked or pickled. A process keeps at most MAX_OPEN shard files
    open, all readers together, and reopens the others as they are read: each reopening must find the file the
    index was read from (same device, inode, size and mtime) or the read raises ShardError, so a shard replaced
    or rewritten on disk after the reader opened it is never read in its place.

    `decode_threads` > 1 decodes a sample's hidden tensors in parallel (zstd and numpy release the GIL):
    a sample arrives sooner for a little more CPU time (4 threads: 2.5x sooner, 16% more CPU; bench/read.py).
    Each DataLoader worker has its own threads: workers x decode_threads should not exceed the loader's cores.
    """

    def __init__(self, path: str | os.PathLike[str], *, decode_threads: int = 1) -> None:
        self.path = Path(path)
        # opened by absolute path: a worker process or a reopen after the cache closed it may run after os.chdir
        self._open_path = Path(path).absolute()
        if not self.path.exists():
            raise ShardError(f"{self.path}: no such shard file")
        if not isinstance(decode_threads, int) or decode_threads < 1:
            raise ShardError(f"decode_threads {decode_threads!r}: must be an integer >= 1")
        self.decode_threads = decode_threads
        self._key = next(_KEYS)
        # (st_dev, st_ino, st_size, st_mtime_ns) of the file the index was read from, taken at its first open
        self._identity: tuple[int, int, int, int] | None = None
        try:
            self.metadata, self._index = self._open()
        except BaseException:
            self.close()  # not left to the cache: a caller may rewrite the file and open it again
            raise
        self._pieces = fmt.piece_layout(self.metadata)
        # per returned tensor (fmt.unit_layout), its pieces with the range of the record's frames each decodes
        self._units: list[list[tuple[dict[str, Any], int, int]]] = []
        fi = 0
        for unit in fmt.unit_layout(self.metadata):
            self._units.append([])
            for piece in unit:
                self._units[-1].append((piece, fi, fi + piece["planes"]))
                fi += piece["planes"]
        self._out_dtype = DTYPES[self.metadata["dtype"]]

    # -- process-local file handle, from the process's cache of open files -----------------
    @contextlib.contextmanager
    def _file(self) -> Iterator[int]:
        """This reader's descriptor, open for the `with` block (the cache closes no file in use)."""
        with _LOCK:
            h = _HANDLES.get(self._key)
            if h is None:
                h = _HANDLES[self._key] = _Open(self._reopen())
            _HANDLES.move_to_end(self._key)
            h.users += 1
            _trim()
        try:
            yield h.fd
        finally:
            with _LOCK:
                h.users -= 1
                _trim()

    def _reopen(self) -> int:
        """The file opened, refused unless it is the regular file the index was read from (the first open: the one
        it is read from)."""
        # O_NONBLOCK: opening a FIFO must not wait for a writer; anything but a regular file is refused
        try:
            fd = os.open(self._open_path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            if self._identity is None:
                raise
            raise ShardError(f"{self.path}: deleted since it was opened (a DataLoader worker, or a read after the "
                             "file was closed, opens it again); rerun its chunk, and open the dataset again") from None
        st = os.fstat(fd)
        identity = _identity_of(st)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise ShardError(f"{self.path}: not a regular file; a shard is a regular *{fmt.SHARD_SUFFIX} file")
        if self._identity is None:
            self._identity = identity
        elif identity != self._identity:
            os.close(fd)
            raise self._changed("replaced or modified on disk", identity)
        return fd

    def _changed(self, what: str, identity: tuple[int, int, int, int]) -> ShardError:
        """The file at the path is not the one the index was read from (`identity` now, `_identity` then)."""
        return ShardError(
            f"{self.path}: {what} since it was opened (device, inode, size, mtime_ns {self._identity} then, "
            f"{identity} now): the index read then does not describe it. Open the dataset (or shard) again to read "
            "the file as it is now")

    @property
    def _dev(self) -> int:
        """The file's disk (prefetch's hint_piece)."""
        assert self._identity is not None
        return self._identity[0]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_key"]  # the receiving process's cache has keys of its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _key=next(_KEYS))

    def close(self, *, wait: bool = True) -> None:
        """Close this reader's file in this process, unless a read is using it (the cache then closes it when it
        needs the room); a later read opens it again, checked to be the same file."""
        if not _LOCK.acquire(blocking=wait):
            return  # __del__ in a garbage collection inside a _LOCK block (or while another thread holds it)
        try:
            h = _HANDLES.get(self._key)
            if h is not None and h.users == 0:
                os.close(_HANDLES.pop(self._key).fd)
        finally:
            _LOCK.release()

    def __del__(self) -> None:
        try:
            self.close(wait=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown; a reader whose __init__ failed has no _key
            pass

    def _pread(self, n: int, offset: int) -> bytes:
        with self._file() as fd:
            return os.pread(fd, n, offset)

    def _record_buffer(self, n: int) -> memoryview:
        """A writable n-byte buffer to read a record into, reused by this thread for its next record, of any
        reader.

        os.pread returns a fresh bytes object: for a record of tens of MB every page of it faulted in on
        first touch, and that took ~30% of a warm-cache read (bench/read.py, "trainer read"). Kept per thread
        (ThreadPool readers, DataLoader workers), so a sample's tensors never point into it; records over
        REUSE_MAX get a one-off buffer so a rare huge sample does not stay resident."""
        buf = getattr(_THREAD, "buf", None)
        if buf is None or len(buf) < n:
            buf = np.empty(n, np.uint8)  # numpy asks for huge pages for large arrays
            if n <= REUSE_MAX:
                _THREAD.buf = buf
        return memoryview(buf)[:n]

    def _read_into(self, buf: memoryview, offset: int) -> int:
        """Fill `buf` from `offset` (one read returns at most ~2 GiB on Linux); the bytes read, short at EOF."""
        got = 0
        with self._file() as fd:
            while got < len(buf):
                n = os.preadv(fd, [buf[got:]], offset + got)
                if n == 0:
                    break
                got += n
        return got

    # -- structure ------------------------------------------------------------------------
    def _corrupt(self, sample: int | None, what: str) -> ShardError:
        """The error of bytes that disagree with the index: the shard's damage, unless the file was rewritten in
        place since the index was read (`cp` or `rsync --inplace` over it while a dataset holds it open: the file
        is whole, and opening it again reads it)."""
        if self._identity is not None:
            try:
                now = _identity_of(os.stat(self._open_path))
            except OSError:
                now = self._identity
            if now != self._identity:
                return self._changed(f"sample {sample}: modified on disk", now)
        return CorruptShardError(self.path, sample, what)

    def _open(self) -> tuple[dict[str, Any], CompactIndex]:
        try:
            with self._file():  # held through the parse: every read of it from the file whose fstat is the identity
                return self._parse()
        except parse.Malformed as e:
            raise self._corrupt(e.sample, e.what) from None

    def _parse(self) -> tuple[dict[str, Any], CompactIndex]:
        """Header, metadata, footer and index, each checked before the next is sized by it; the index kept in
        arrays (compact.py), not as the JSON's lists."""
        assert self._identity is not None  # set by _open's first open of the file
        size = self._identity[2]
        head = self._pread(fmt.HEADER.size, 0)
        if len(head) < fmt.HEADER.size and fmt.HEADER_MAGIC.startswith(head[:8]):  # a shard's start, cut (or empty)
            raise self._corrupt(None, f"file truncated at byte {size}: inside the {fmt.HEADER.size}-byte header")
        if len(head) < fmt.HEADER.size or head[:8] != fmt.HEADER_MAGIC:
            # not a plain "damaged" (whose advice is to delete the file): it may be any other file given by mistake
            raise ShardError(f"{self.path}: not an hsextract shard (bad magic at byte 0); a shard damaged at its "
                             "start reads so too: if this is one of a run's shards, delete it and rerun its chunk")
        _, version, reserved, meta_len, meta_crc = fmt.HEADER.unpack(head)
        if version not in fmt.READ_VERSIONS:
            raise ShardError(
                f"{self.path}: shard format version {version}; this hsextract reads versions "
                f"{' and '.join(map(str, fmt.READ_VERSIONS))}. Use the hsextract release that wrote it, or re-extract."
            )
        if reserved != 0:
            raise self._corrupt(None, f"header bytes 10-11 (reserved) hold {reserved}, not 0")
        if meta_len > parse.MAX_META_BYTES:
            raise self._corrupt(None, f"header metadata length {meta_len} exceeds {parse.MAX_META_BYTES} bytes")
        meta_raw = self._pread(meta_len, fmt.HEADER.size)
        if len(meta_raw) != meta_len:
            raise self._corrupt(None, f"file truncated at byte {size}: inside the header's metadata (bytes "
                                      f"{fmt.HEADER.size}..{fmt.HEADER.size + meta_len - 1}), or its length damaged")
        if fmt.crc32(meta_raw) != meta_crc:
            raise self._corrupt(None, "header metadata checksum mismatch")
        metadata = parse.metadata(meta_raw, version)
        self._data_start = fmt.HEADER.size + meta_len
        if size < self._data_start + fmt.FOOTER.size:
            raise self._truncated(size)
        foot = self._pread(fmt.FOOTER.size, size - fmt.FOOTER.size)
        if foot[-8:] != fmt.FOOTER_MAGIC:
            raise self._truncated(size)
        ix_off, ix_len, ix_crc, n = parse.footer(foot, version, size, self._data_start)
        if n * parse.min_record_len(metadata) > ix_off - self._data_start:
            raise self._corrupt(None, f"footer claims {n} samples, more than bytes [{self._data_start}, {ix_off}) "
                                      "can hold")
        ix_raw = self._pread(ix_len, ix_off)
        if fmt.crc32(ix_raw) != ix_crc:
            raise self._corrupt(None, "index checksum mismatch")
        index = CompactIndex(parse.index(parse.index_bytes(ix_raw), metadata, n, self._data_start, ix_off), metadata,
                             ix_off)
        self._index_offset = ix_off
        return metadata, index

    def _truncated(self, size: int) -> CorruptShardError:
        """Walk the records from the start to name the sample the truncation damaged: the one whose record it
        cuts. Cut between two records or after the last (in the index, say), none is named: how many samples
        followed is in the lost footer."""
        off, sample = self._data_start, 0
        while off + fmt.RECORD.size <= size:
            magic, idx, plen, _, hcrc = fmt.RECORD.unpack(self._pread(fmt.RECORD.size, off))
            if magic != fmt.RECORD_MAGIC or idx != sample or fmt.crc32(self._pread(fmt.RECORD_CHECKED, off)) != hcrc:
                break  # index or footer bytes, or garbage: the records end here
            if off + fmt.RECORD.size + plen > size:
                return self._corrupt(sample, f"file truncated at byte {size}: "
                                             f"the record ends at byte {off + fmt.RECORD.size + plen}")
            off += fmt.RECORD.size + plen
            sample += 1
        tail = self._pread(min(size - off, len(fmt.RECORD_MAGIC)), off) if 0 < size - off < fmt.RECORD.size else b""
        if tail and fmt.RECORD_MAGIC.startswith(tail):  # the start of a record's header, not of the index
            return self._corrupt(sample, f"file truncated at byte {size}: inside the record's header")
        whole = f"records 0..{sample - 1} are complete" if sample else "no record is complete"
        return self._corrupt(
            None,
            f"file truncated at byte {size} or its end damaged: no valid footer; {whole}, what followed byte "
            f"{off} (any further samples, the index, the footer) is missing",
        )

    # -- samples --------------------------------------------------------------------------
    # The index is kept in arrays (compact.py); what leaves the reader is Python ints, strs and fresh lists, so a
    # caller may keep, change or json.dumps them. The lists are built at each call: a loop asks for one sample's
    # value (sample_id, seq_len, ...) or a total (num_tokens, num_trained, stored_tokens), not a whole list per
    # sample.
    def __len__(self) -> int:
        return len(self._index)

    @property
    def sample_ids(self) -> list[str]:
        return self._index.sample_id_list()

    @property
    def seq_lens(self) -> list[int]:
        return self._index.seq_lens.tolist()

    @property
    def parents(self) -> list[int]:
        """Per sample the earlier sample it takes its first rows from, or -1 (always -1 in a version-1 shard)."""
        return self._index.parent_list()

    @property
    def prefix_lens(self) -> list[int]:
        """Per sample the rows it takes from its parent (0 without one)."""
        return self._index.prefix_len_list()

    def column(self, name: str) -> list[Any]:
        """One index column (fmt.index_columns; parents and prefix_lens of a version-1 shard too), as `index`."""
        if name not in fmt.index_columns(fmt.FORMAT_VERSION):
            raise KeyError(f"{name!r}: the index columns are {list(fmt.index_columns(fmt.FORMAT_VERSION))}")
        return self._index.column(name)

    def _at(self, i: int) -> int:
        i = int(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.path}: sample {i} out of range (shard holds {n})")
        return i % n

    def sample_id(self, i: int) -> str:
        """Sample i's id."""
        return self._index.sample_id(self._at(i))

    def seq_len(self, i: int) -> int:
        """Sample i's tokens."""
        return self._index.seq_len(self._at(i))

    def parent(self, i: int) -> int:
        """Sample i's parent, or -1."""
        return self._index.parent(self._at(i))

    def prefix_len(self, i: int) -> int:
        """The rows sample i takes from its parent (0 without one)."""
        return self._index.prefix_len(self._at(i))

    @property
    def num_tokens(self) -> int:
        """The samples' tokens (each sample whole)."""
        return self._index.total("seq_lens")

    @property
    def num_trained(self) -> int:
        """The samples' trained tokens."""
        return self._index.total("num_trained")

    @property
    def raw_bytes(self) -> int:
        """The samples' speculators v1 tensor bytes (the index's raw_bytes, summed)."""
        return self._index.total("raw_bytes")

    @property
    def shared_samples(self) -> int:
        """Samples that take their first rows from an earlier one."""
        return self._index.shared_samples()

    @property
    def stored_tokens(self) -> int:
        """Rows the shard stores (distinct tokens): the samples' tokens less the prefixes they take from parents."""
        return self._index.total("seq_lens") - self._index.total("prefix_lens")

    @property
    def index(self) -> dict[str, list[Any]]:
        """The index columns as the file's JSON holds them, lists of Python ints and strs: a fresh copy at each call
        (a few hundred bytes a sample while it is kept; the accessors above cost nothing per sample)."""
        return self._index.columns()

    def prefetch(self, i: int) -> None:
        """Ask the kernel to start reading record i into the page cache (posix_fadvise WILLNEED, in pieces the
        kernel takes whole: hint_piece), so that its read finds it there. Submitting blocks only while the
        disk's queue is full; a platform or file system that does not take the hint reads as before."""
        if not hasattr(os, "posix_fadvise"):
            return
        off, rlen = self._index.span(i)
        step = hint_piece(self._dev)
        with self._file() as fd:
            try:
                for a in range(off, off + rlen, step):
                    os.posix_fadvise(fd, a, min(step, off + rlen - a), os.POSIX_FADV_WILLNEED)
            except OSError:
                pass

    def _record(self, i: int, pool: ThreadPoolExecutor | None = None) -> memoryview:
        """Record i read, its header checked (not yet its payload: _check_payload), in this thread's record
        buffer: valid until its next _record call. With a pool, slices of a large record are read in parallel."""
        off, rlen = self._index.span(i)
        rec = self._record_buffer(rlen)
        if pool is None or rlen < PARALLEL_READ_MIN:
            got = self._read_into(rec, off)
        else:
            step = -(-rlen // self.decode_threads)
            got = sum(pool.map(lambda a: self._read_into(rec[a:a + step], off + a), range(0, rlen, step)))
        if got != rlen:
            raise self._corrupt(i, f"record cut short: {got} of {rlen} bytes")
        self._check_record_header(i, rec)
        return rec

    def _check_payload(self, i: int, rec: memoryview) -> None:
        seed = fmt.reference_seed(self._index.parent(i), self._index.prefix_len(i))
        if fmt.payload_hash(rec[fmt.RECORD.size:], seed) != self._index.digest(i):
            raise self._corrupt(i, "checksum mismatch")

    def _check_record_header(self, i: int, rec: bytes | memoryview) -> None:
        magic, idx, plen, phash, hcrc = fmt.RECORD.unpack_from(rec)
        if magic != fmt.RECORD_MAGIC or fmt.crc32(rec[: fmt.RECORD_CHECKED]) != hcrc:
            raise self._corrupt(i, "record header damaged")
        if idx != i:
            raise self._corrupt(i, f"record belongs to sample {idx}, not {i} (index and records disagree)")
        if plen + fmt.RECORD.size != self._index.record_len(i):
            raise self._corrupt(i, f"record of {plen + fmt.RECORD.size} bytes, the index says "
                                   f"{self._index.record_len(i)} (index and records disagree)")
        if phash != self._index.digest(i):
            raise self._corrupt(i, "checksum mismatch")

    def _own(self, i: int) -> int:
        """Hidden rows record i holds."""
        return self._index.seq_len(i) - self._index.prefix_len(i)

    def _frames(self, i: int, payload: memoryview) -> list[memoryview]:
        try:
            return parse.frames(payload, parse.frame_sizes(self._pieces, self._index.seq_len(i), self._own(i)), i)
        except parse.Malformed as e:
            raise self._corrupt(i, e.what) from None

    def check_records(self) -> None:
        """Check every record's header, frame table and frame headers against the index without decoding
        (structure only; `verify` also checks payload checksums and decodes every frame)."""
        nframes = parse.frame_count(self.metadata)
        table = fmt.RECORD.size + fmt.FRAME_COUNT.size + 8 * nframes
        for i in range(len(self)):
            off, rlen = self._index.span(i)
            head = self._pread(table, off)
            if len(head) != table:
                raise self._corrupt(i, f"record cut short: {len(head)} of {table} header bytes")
            self._check_record_header(i, head)
            (count,) = fmt.FRAME_COUNT.unpack_from(head, fmt.RECORD.size)
            if count != nframes:
                raise self._corrupt(i, f"{count} frames, layout expects {nframes}")
            lens = struct.unpack_from(f"<{nframes}Q", head, fmt.RECORD.size + fmt.FRAME_COUNT.size)
            if sum(lens) != rlen - table:
                raise self._corrupt(i, f"frame lengths add up to {sum(lens)} bytes, the payload holds {rlen - table}")
            pos = off + table
            sizes = parse.frame_sizes(self._pieces, self._index.seq_len(i), self._own(i))
            for k, (ln, size) in enumerate(zip(lens, sizes, strict=True)):
                try:
                    parse.check_frame(self._pread(min(ln, parse.FRAME_HEADER_MAX), pos), k, ln, size, i)
                except parse.Malformed as e:
                    raise self._corrupt(i, e.what) from None
                pos += ln

    def _decompressor(self) -> zstd.ZstdDecompressor:
        # one per thread: a zstd context must not be used by two threads at once
        dctx = getattr(_THREAD, "d", None)
        if dctx is None:
            dctx = _THREAD.d = zstd.ZstdDecompressor()
        return dctx

    def _decode_piece(self, i: int, piece: dict[str, Any], frames: list[memoryview], seq: int,
                      shared: bool = False, rows: int | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """One stored tensor of record i (`seq` rows); with `rows`, its first `rows` rows only: a byte plane is
        row-major, so they are the first rows x width bytes of each plane's frame, and zstd stops there. `into`: a
        contiguous tensor of those rows to decode into (an assembled sample's segment: no copy, no fresh pages)."""
        dctx = self._decompressor()
        out_rows = seq if rows is None else rows
        nbytes = out_rows * piece["width"] * DTYPES[piece["dtype"]].itemsize
        plane = nbytes // piece["planes"]
        try:
            if rows is None:
                # parse.frames refused a declared size other than this one; an undeclared size decodes
                # into at most this many bytes
                planes = [dctx.decompress(f, max_output_size=plane) for f in frames]
            else:
                planes = [self._decode_head(dctx, f, plane) for f in frames]
        except zstd.ZstdError as e:
            raise self._corrupt(i, f"frame does not decode ({e})") from e
        if any(len(p) * piece["planes"] != nbytes for p in planes):
            raise self._corrupt(i, f"{piece['name']} decodes to the wrong size")
        if into is not None:
            join_planes(planes, piece["planes"], nbytes, into.view(torch.uint8).numpy().reshape(-1))
            return into
        if shared:  # the tensor that owns the shared block is returned (a tensor made from numpy would not be shared)
            t = _shared_bytes(nbytes)
            join_planes(planes, piece["planes"], nbytes, t.numpy())
        else:
            t = torch.from_numpy(join_planes(planes, piece["planes"], nbytes))
        t = t.view(DTYPES[piece["dtype"]])
        return t if piece["width"] == 1 else t.view(out_rows, piece["width"])

    @staticmethod
    def _decode_head(dctx: zstd.ZstdDecompressor, frame: memoryview, n: int) -> bytes:
        """The first n decoded bytes of a frame (fewer if it decodes to fewer), decoding no further."""
        parts, got = [], 0
        with dctx.stream_reader(frame, read_across_frames=False) as r:
            while got < n:
                part = r.read(n - got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
        return b"".join(parts)

    def _decode(self, i: int, rec: memoryview, pool: ThreadPoolExecutor | None = None,
                shared: bool = False) -> Sample:
        """The sample of record i, its header already checked. Serially: payload checksum, then decode. With a
        pool: the hidden tensors decode on it while this thread checks the payload checksum and decodes ids
        and mask; nothing is returned unless the checksum matches (decoding unchecked bytes is safe: frame
        sizes were parsed and bounded first)."""
        if pool is None:
            self._check_payload(i, rec)
        try:
            frames = self._frames(i, rec[fmt.RECORD.size:])
        except CorruptShardError:
            self._check_payload(i, rec)  # a damaged payload says so first, as on the serial path
            raise
        seq, own = self._index.seq_len(i), self._own(i)
        jobs = [[(piece, frames[a:b]) for piece, a, b in unit] for unit in self._units]
        if pool is not None:
            # every future is waited for before returning: the frames point into this thread's record buffer
            futures = [pool.submit(self._decode_unit, i, unit, own, shared) for unit in jobs[2:]]
            try:
                self._check_payload(i, rec)  # a damaged record is reported as such, whatever its frames do
                head = [self._decode_unit(i, unit, seq, shared) for unit in jobs[:2]]
            finally:
                wait(futures)
            tensors = head + [f.result() for f in futures]
        else:
            tensors = [self._decode_unit(i, unit, seq if u < 2 else own, shared) for u, unit in enumerate(jobs)]
        return {"input_ids": tensors[0], "hidden_states": tensors[2:], "loss_mask": tensors[1]}

    def _decode_unit(self, i: int, unit: list[tuple[dict[str, Any], list[memoryview]]], seq: int,
                     shared: bool) -> torch.Tensor:
        if len(unit) == 1:
            return self._decode_piece(i, *unit[0], seq, shared)
        q, scale = (self._decode_piece(i, piece, frames, seq) for piece, frames in unit)
        out = _shared_bytes(q.numel() * self._out_dtype.itemsize).view(self._out_dtype).view(q.shape) \
            if shared else None
        return dequantize_fp8(q, scale, self._out_dtype, out)

    def __getitem__(self, i: int) -> Sample:
        return self.sample(i)

    def sample(self, i: int, *, shared_memory: bool = False,
               records: Callable[[int], bytes | memoryview] | None = None) -> Sample:
        """Sample i (as `reader[i]`). `shared_memory`: its tensors are decoded straight into shared memory, so
        that a DataLoader worker hands them to the loader's process without a copy (see
        HiddenStateDataset.stream); elsewhere it only costs the shared blocks' set-up. `records`: where the records
        of sample i's ancestors come from (`record(j)` by default; a stream's cache of its families' records)."""
        i = self._at(i)
        if self._index.parent(i) == fmt.NO_PARENT:
            return self.own_rows(i, shared_memory)
        return self._assemble(i, shared_memory, records)

    def own_rows(self, i: int, shared: bool = False) -> Sample:
        """Record i decoded alone: the sample's ids and loss mask, and the hidden rows it stores itself (all of them
        without a parent; from token prefix_lens[i] on with one), no ancestor read."""
        if self.decode_threads == 1:
            return self._decode(i, self._record(i), shared=shared)
        rec = self._record(i, _pool("read", self.decode_threads))
        return self._decode(i, rec, _pool("decode", self.decode_threads), shared)

    def record(self, i: int) -> bytes:
        """Record i's bytes, its header checked (its payload is checked where it is decoded): what a stream keeps
        of a family's records so that each is read once (HiddenStateDataset.stream, group="family")."""
        return bytes(self._record(i))

    def supplies(self, i: int) -> list[tuple[int, int, int]]:
        """The ancestors whose rows sample i takes, from the index alone: (ancestor, lo, hi) per segment, rows
        [lo, hi) from that ancestor's own rows [0, hi - lo), nearest ancestor first (docs/SHARED_PREFIX.md)."""
        return self._index.supplies(i)

    def _check_prefix_ids(self, i: int, ids: torch.Tensor, j: int, theirs: torch.Tensor, n: int) -> None:
        """Sample i takes rows below token n from sample j: their ids must agree there."""
        differ = (ids[:n] != theirs[:n]).nonzero()
        if differ.numel():
            raise self._corrupt(i, f"input_ids differ from sample {j}'s at token {int(differ[0])}, within the {n} "
                                   "prefix tokens whose rows it takes from that sample")

    def _assemble(self, i: int, shared: bool,
                  records: Callable[[int], bytes | memoryview] | None = None) -> Sample:
        """Sample i of a version-2 shard: its own rows, then each earlier segment from the ancestor that stores it
        (docs/SHARED_PREFIX.md, "Reading"). Ancestors are earlier samples, so the walk ends; each one that supplies
        rows has its ids checked against this sample's over every position below the segment's end, and only the
        rows it supplies are decoded (a sample decodes its seq rows, as in a flat shard)."""
        mine = self.own_rows(i, shared)
        ids, seq, k = mine["input_ids"], self._index.seq_len(i), self._index.prefix_len(i)
        out = []
        for h in mine["hidden_states"]:
            t = (_shared_bytes(seq * h.shape[1] * h.element_size()).view(h.dtype).view(seq, h.shape[1]) if shared
                 else torch.empty((seq, h.shape[1]), dtype=h.dtype))
            t[k:] = h
            out.append(t)
        for node, lo, hi in self.supplies(i):  # rows [lo, hi) are the node's own rows [0, hi - lo)
            try:
                rec = memoryview(records(node)) if records is not None else self._record(node)
                theirs = self._supply(node, rec, hi, [t[lo:hi] for t in out])
            except CorruptShardError as e:  # the sample asked for is the one a caller skips: name it
                raise self._corrupt(i, f"its rows {lo} to {hi} come from sample {node}, whose record is damaged "
                                       f"({e.what})") from e
            self._check_prefix_ids(i, ids, node, theirs, hi)
        return {"input_ids": ids, "hidden_states": out, "loss_mask": mine["loss_mask"]}

    def _supply(self, i: int, rec: memoryview, hi: int, outs: list[torch.Tensor]) -> torch.Tensor:
        """Record i (an ancestor) supplying rows: its payload checked, its first len(outs[0]) own rows of each hidden
        tensor decoded straight into `outs`, and its ids below token `hi` returned (for the caller's check)."""
        self._check_payload(i, rec)
        frames = self._frames(i, rec[fmt.RECORD.size:])
        units = [[(piece, frames[a:b]) for piece, a, b in unit] for unit in self._units]
        seq, own, rows = self._index.seq_len(i), self._own(i), outs[0].shape[0]
        ids = self._decode_piece(i, *units[0][0], seq, rows=hi)
        for unit, t in zip(units[2:], outs, strict=True):
            if len(unit) == 1:
                self._decode_piece(i, *unit[0], own, rows=rows, into=t)
            else:
                q, scale = (self._decode_piece(i, piece, fr, own, rows=rows) for piece, fr in unit)
                dequantize_fp8(q, scale, self._out_dtype, t)
        return ids

    def iter_samples(self, threads: int = 2, lookahead: int = 4) -> Iterator[Sample]:
        """All samples in order, read and decoded ahead by a small thread pool: up to `lookahead` samples, and
        beyond the next one no more than AHEAD_BYTES of them."""
        if threads <= 1:
            for i in range(len(self)):
                yield self[i]
            return
        lookahead = max(1, lookahead)
        m = self.metadata
        row = 16 + int(m["num_hidden_tensors"]) * int(m["hidden_size"]) * self._out_dtype.itemsize  # + ids, mask
        pending: list[tuple[Any, int]] = []  # (future, decoded size), in order

        def ahead(pool: ThreadPoolExecutor, nxt: int) -> int:
            while nxt < len(self) and len(pending) < lookahead:
                size = self._index.seq_len(nxt) * row
                if pending and sum(s for _, s in pending) + size > AHEAD_BYTES:
                    break
                pending.append((pool.submit(self.__getitem__, nxt), size))
                nxt += 1
            return nxt

        with ThreadPoolExecutor(threads, thread_name_prefix="hsx-read") as pool:
            nxt = ahead(pool, 0)
            while pending:
                fut, _ = pending.pop(0)
                nxt = ahead(pool, nxt)  # while the consumer holds this one
                yield fut.result()

    def __iter__(self) -> Iterator[Sample]:
        return self.iter_samples()

    def verify(self) -> None:
        """Read and check every sample (raises CorruptShardError at the first bad one): every record once, and every
        reference's ids against its parent's over the prefix (each assembled row then comes from the same ids)."""
        ids: dict[int, torch.Tensor] = {}
        parents = self._index.parents
        needed = set() if parents is None else set(np.unique(parents[parents >= 0]).tolist())
        for i in range(len(self)):
            got = self._decode(i, self._record(i))["input_ids"]
            p = self._index.parent(i)
            if p != fmt.NO_PARENT:
                self._check_prefix_ids(i, got, p, ids[p], self._index.prefix_len(i))
            if i in needed:
                ids[i] = got
