"""Streaming, atomic shard writer: one record per sample, index and footer at close.

Length: one class, ShardWriter, because encoding (on a thread pool), ordered writing (a writer thread),
background syncs, prefix references and the atomic close or abort all share the temp file, the pending
records and the first error, which any of them may raise in the caller. The byte layout is in format.py,
the tensor codecs in codec.py.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
import zstandard as zstd

from hsextract import __version__, layers
from hsextract.atomic import commit, create_temp, discard, remove_temps
from hsextract.errors import ShardError
from hsextract.shard import format as fmt
from hsextract.shard.codec import (
    DTYPES,
    FLOAT_DTYPES,
    Codec,
    dtype_name,
    quantize_fp8,
    split_planes,
    to_bytes,
)

REQUIRED_METADATA = (
    "model", "engine", "engine_version", "aux_layers", "final_state", "hidden_size", "dtype",
    "config_hash", "tokenizer_hash", "chat_template_hash",
)
PRECISIONS = ("bf16", "fp8_e4m3")
# Samples encoding ahead of the file hold their tensors: at most this many bytes of them together, the newest always
# (a long sample of a large model is GBs: Kimi-K2.5's 128k tokens, 7.5 GB; threads + 1 of those would be over 100 GB).
# It bounds the tensors waiting, not the process: their compressed frames, each thread's byte planes and the record
# on its way to the disk come on top (bench/README.md, "memory at Kimi width").
ENCODE_AHEAD_BYTES = 8 << 30


@dataclass(frozen=True)
class ShardSummary:
    path: str
    num_samples: int
    num_tokens: int
    raw_bytes: int
    stored_bytes: int
    # where add() and close() waited: for encoder threads (encoding is behind), or for the writer thread
    # (the disk is behind by more than the write-ahead: the page cache throttles a writer that outruns it)
    encode_wait_s: float = 0.0
    write_s: float = 0.0
    # the writer thread's own time in the file's write() calls: the disk's time, waited for or not
    disk_s: float = 0.0


def _check_metadata(metadata: dict[str, Any], precision: str) -> dict[str, Any]:
    missing = [k for k in REQUIRED_METADATA if k not in metadata]
    if missing:
        raise ShardError(f"shard metadata lacks {missing}: the writer's caller must supply {list(REQUIRED_METADATA)}")
    if metadata["dtype"] not in FLOAT_DTYPES - {"float8_e4m3fn"}:
        raise ShardError(f"shard metadata dtype {metadata['dtype']!r}: use bfloat16, float16 or float32")
    if metadata["final_state"] not in ("post_norm", "pre_norm"):
        raise ShardError(f"shard metadata final_state {metadata['final_state']!r}: use post_norm or pre_norm")
    if not (isinstance(metadata["hidden_size"], int) and metadata["hidden_size"] > 0):
        raise ShardError(f"shard metadata hidden_size {metadata['hidden_size']!r}: must be a positive integer")
    if precision not in PRECISIONS:
        raise ShardError(f"precision {precision!r}: use one of {PRECISIONS}")
    convention = metadata.get("layer_convention", layers.STORED)
    if convention not in layers.CONVENTIONS:
        raise ShardError(f"shard metadata layer_convention {convention!r}: use one of {layers.CONVENTIONS}")
    meta = dict(metadata)
    meta["aux_layers"] = [int(x) for x in metadata["aux_layers"]]
    meta["layer_convention"] = convention
    meta.update(
        format_version=fmt.FLAT_VERSION,  # 2 once a sample has a reference (close() rewrites the header)
        precision=precision,
        stored_dtype="float8_e4m3fn" if precision == "fp8_e4m3" else metadata["dtype"],
        num_hidden_tensors=len(meta["aux_layers"]) + 1,
        writer=f"hsextract {__version__}",
        zstd_version=".".join(map(str, zstd.ZSTD_VERSION)),
    )
    json.dumps(meta)  # fail here, not at close, on a value JSON cannot hold
    return meta


class _RecordFrames:
    """The frames of one record's tensors as their encoding tasks hand them in, in any order."""

    def __init__(self, units: int) -> None:
        self.done: Future[tuple[list[bytes], int]] = Future()
        self._by_unit: list[list[bytes]] = [[] for _ in range(units)]
        self._left = units
        self._lock = threading.Lock()

    def put(self, unit: int, frames: list[bytes]) -> bool:
        """Store a tensor's frames; True for the call that completes the record."""
        with self._lock:
            self._by_unit[unit] = frames
            self._left -= 1
            return self._left == 0

    def frames(self) -> list[bytes]:
        return [f for fs in self._by_unit for f in fs]

    def fail(self, e: BaseException) -> None:
        with self._lock:
            if not self.done.done():
                self.done.set_exception(e)


def _given(x: object) -> str:
    """What add() was given, for its refusal: a tensor's dtype and shape, else the type."""
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"


class ShardWriter:
    """Write samples to `path` through a temporary file; the shard appears only when complete.

    Use as a context manager: an exception inside the block removes the temporary file and no
    shard is left. With threads=1 add() encodes and writes each record; with threads=N up to N+1
    samples are encoded in parallel ahead of the file (their tensors within ENCODE_AHEAD_BYTES together).

    The file is written by a writer thread, up to `write_ahead_mb` MB behind add(): a disk that stalls
    now and then (a journal commit) then does not stop the caller, which on the SGLang path would stop
    the requests. Every `sync_every_mb` MB that thread also starts an fdatasync on another thread: the
    kernel otherwise keeps gigabytes dirty and close()'s fsync writes them all while the run waits.
    0 turns it off. Figures: bench/README.md, "shard background sync" and "SGLang throughput".

    `share_prefixes`: add() may give a sample a reference (`parent`, `prefix_len`): it then stores only its own
    rows, and the shard becomes format version 2 (docs/SHARED_PREFIX.md). The writer keeps every sample's ids
    to check each reference. Without a reference in the shard, the bytes are version 1's, as without the flag.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        metadata: dict[str, Any],
        *,
        level: int = 3,
        threads: int = 1,
        precision: str = "bf16",
        sync_every_mb: int = 256,
        write_ahead_mb: int = 256,
        share_prefixes: bool = False,
    ) -> None:
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise ShardError(f"{self.path}: folder {self.path.parent} does not exist; create it first")
        if not -7 <= level <= 22:
            raise ShardError(f"compression level {level}: zstd levels run from -7 to 22")
        if threads < 1:
            raise ShardError(f"threads {threads}: must be at least 1")
        if sync_every_mb < 0:
            raise ShardError(f"sync_every_mb {sync_every_mb}: must be >= 0 (0: no background sync)")
        self.metadata = _check_metadata(metadata, precision)
        self.metadata["codec"] = {"name": "zstd-byteplane", "level": level}
        self._codec = Codec(level=level, threads=threads)
        # the pieces each input tensor becomes (under fp8 quantized by the encoding task, off the caller's thread)
        self._units = fmt.unit_layout(self.metadata)
        self._out_dtype = DTYPES[self.metadata["dtype"]]
        self._hidden = self.metadata["hidden_size"]
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hsx-enc") if threads > 1 else None
        self._pending: deque[tuple[int, Future[tuple[list[bytes], int]], int]] = deque()  # sample, encoding, bytes
        self._depth = threads + 1  # samples encoding ahead of the file, or fewer: ENCODE_AHEAD_BYTES
        self._sync_every = sync_every_mb << 20
        self._unsynced = 0
        self._ahead = max(1, write_ahead_mb) << 20
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="hsx-sync")
        self._sync: Future[None] | None = None
        remove_temps(self.path)  # a killed writer's
        fd, self._tmp = create_temp(self.path)
        # a writer neither closed nor aborted: its temp goes when it is collected or, as its writer thread holds it
        # (so it is not collected before), when the process exits; only SIGKILL leaves one (the next writer's)
        self._drop_temp = weakref.finalize(self, discard, self._tmp)
        self._file = os.fdopen(fd, "wb")  # closed in close() or abort()
        self._index: dict[str, list[Any]] = {c: [] for c in fmt.index_columns(fmt.FORMAT_VERSION)}
        self._ids: list[torch.Tensor] | None = [] if share_prefixes else None  # to check references
        self._ref_depth: list[int] = []  # each sample's reference depth (format.MAX_REFERENCE_DEPTH)
        self._closed = False
        self.encode_wait_s = self.write_s = self.disk_s = 0.0
        # the writer thread: chunks in file order; _queued bytes handed over and not yet written
        self._wq: queue.SimpleQueue[list[bytes] | None] = queue.SimpleQueue()
        self._wcond = threading.Condition()
        self._queued = 0
        self._werr: BaseException | None = None
        self._pos = 0  # bytes handed to the writer: the next record's offset
        self._wthread = threading.Thread(target=self._writer_loop, name="hsx-shard-write", daemon=True)
        self._wthread.start()
        self._write(fmt.pack_header(self.metadata))

    # -- encoding (worker threads when threads > 1) ---------------------------------------
    def _compressors(self) -> tuple[zstd.ZstdCompressor, zstd.ZstdCompressor, zstd.ZstdCompressor]:
        # zstd compressor objects must not be shared between threads
        if not hasattr(self._local, "c"):
            self._local.c = (self._codec.whole_compressor(), self._codec.plane_compressor(),
                             self._codec.low_plane_compressor())
        return self._local.c

    def _encode_unit(self, pieces: list[dict[str, Any]], t: torch.Tensor) -> list[bytes]:
        """The frames of one input tensor of a record (under fp8: of its values and scales). Runs on any thread."""
        whole, top_plane, low_plane = self._compressors()
        frames: list[bytes] = []
        for piece, x in zip(pieces, quantize_fp8(t) if len(pieces) == 2 else (t,), strict=True):
            raw = to_bytes(x)
            if piece["planes"] == 1:
                frames.append(whole.compress(raw))
                continue
            top = piece["planes"] - 1  # little endian: the last plane holds sign and exponent
            frames.extend((top_plane if k == top else low_plane).compress(p)
                          for k, p in enumerate(split_planes(raw, piece["planes"])))
        return frames

    @staticmethod
    def _payload(frames: list[bytes], seed: int = 0) -> tuple[list[bytes], int]:
        """One record's payload, [frame table, frames...], and its xxh3 digest (seeded with its reference)."""
        table = fmt.pack_frame_table([len(f) for f in frames])
        hasher = xxhash.xxh3_64(table, seed)
        for f in frames:
            hasher.update(f)
        return [table, *frames], hasher.intdigest()

    def _encode(self, tensors: list[torch.Tensor], seed: int) -> tuple[list[bytes], int]:
        return self._payload([f for unit, t in zip(self._units, tensors, strict=True)
                              for f in self._encode_unit(unit, t)], seed)

    def _submit(self, tensors: list[torch.Tensor], seed: int) -> Future[tuple[list[bytes], int]]:
        """Encode a record's tensors as separate tasks: the last samples of a shard then take one tensor's
        time, not a whole sample's on one thread, before close() can finish. The task that finishes last builds
        the payload; no task waits for another."""
        record = _RecordFrames(len(tensors))

        def unit_task(k: int, unit: list[dict[str, Any]], t: torch.Tensor) -> None:
            try:
                if record.put(k, self._encode_unit(unit, t)):
                    record.done.set_result(self._payload(record.frames(), seed))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer through the future
                record.fail(e)

        assert self._pool is not None
        for k, (unit, t) in enumerate(zip(self._units, tensors, strict=True)):
            self._pool.submit(unit_task, k, unit, t)
        return record.done

    def _reference(self, sample: int, ids: torch.Tensor, parent: int | None, prefix_len: int) -> int:
        """Check a sample's reference; returns its parent index (-1 for none)."""
        where = f"{self.path}: sample {sample}"
        if parent is None:
            if prefix_len != 0:
                raise ShardError(f"{where}: prefix_len {prefix_len} without a parent; give parent= or prefix_len=0")
            return fmt.NO_PARENT
        if self._ids is None:
            raise ShardError(f"{where}: a reference (parent {parent}) needs ShardWriter(..., share_prefixes=True)")
        if isinstance(parent, bool) or not isinstance(parent, int) or not 0 <= parent < sample:
            raise ShardError(f"{where}: parent {parent!r} must be an earlier sample of this shard (0..{sample - 1})")
        top = min(len(self._ids[parent]), ids.numel() - 1)
        if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or not 1 <= prefix_len <= top:
            raise ShardError(f"{where}: prefix_len {prefix_len!r} outside [1, {top}] (parent {parent} holds "
                             f"{len(self._ids[parent])} tokens, the sample {ids.numel()}, of which it must store one)")
        differ = (ids[:prefix_len] != self._ids[parent][:prefix_len]).nonzero()
        if differ.numel():
            raise ShardError(f"{where}: input_ids differ from parent {parent}'s at token {int(differ[0])}, within "
                             f"the prefix of {prefix_len} tokens it would take from it")
        if self._ref_depth[parent] >= fmt.MAX_REFERENCE_DEPTH:
            raise ShardError(f"{where}: parent {parent} is {self._ref_depth[parent]} references deep already; at "
                             f"most {fmt.MAX_REFERENCE_DEPTH} (a reader walks them): give a shallower parent or none")
        return parent

    def _tensors(self, sample: int, input_ids: torch.Tensor, hidden_states: list[torch.Tensor],
                 loss_mask: torch.Tensor, parent: int | None = None,
                 prefix_len: int = 0) -> tuple[list[torch.Tensor], int]:
        """The record's tensors, checked, and the sample's parent (-1 for none)."""
        where = f"{self.path}: sample {sample}"
        if (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or input_ids.dtype.is_floating_point
                or input_ids.numel() == 0):
            raise ShardError(f"{where}: input_ids must be a non-empty 1-D integer tensor, got {_given(input_ids)}")
        seq = input_ids.numel()
        if not isinstance(loss_mask, torch.Tensor) or loss_mask.shape != (seq,) or loss_mask.dtype.is_floating_point:
            raise ShardError(f"{where}: loss_mask must be an integer tensor of shape ({seq},), got {_given(loss_mask)}")
        n = self.metadata["num_hidden_tensors"]
        if not isinstance(hidden_states, (list, tuple)) or not all(isinstance(h, torch.Tensor) for h in hidden_states):
            raise ShardError(f"{where}: hidden_states must be a list of {n} tensors, got {_given(hidden_states)}"
                             + (f" of {sorted({type(h).__name__ for h in hidden_states})}"
                                if isinstance(hidden_states, (list, tuple)) else ""))
        if len(hidden_states) != n:
            raise ShardError(f"{where}: {len(hidden_states)} hidden-state tensors, expected {n} "
                             f"(aux_layers {self.metadata['aux_layers']} + final)")
        out = [input_ids.to(torch.int64), loss_mask.to(torch.int64)]
        ref = self._reference(sample, out[0], parent, prefix_len)
        rows = seq - prefix_len  # the sample's own rows: those its parent does not hold
        for k, h in enumerate(hidden_states):
            if h.shape != (rows, self._hidden) or h.dtype != self._out_dtype:
                own = f" (its own rows: {seq} tokens less the {prefix_len} taken from its parent)" if prefix_len else ""
                raise ShardError(
                    f"{where}: hidden_states[{k}] is {dtype_name(h.dtype) if h.dtype in DTYPES.values() else h.dtype} "
                    f"{tuple(h.shape)}, expected {self.metadata['dtype']} ({rows}, {self._hidden}){own}"
                )
            out.append(h)
        return out, ref

    # -- public API -----------------------------------------------------------------------
    def add(self, input_ids: torch.Tensor, hidden_states: list[torch.Tensor], loss_mask: torch.Tensor,
            sample_id: str = "", *, parent: int | None = None, prefix_len: int = 0) -> None:
        """Append one sample. With threads > 1 it is encoded in the background (records still land in
        call order): do not modify its tensors in place after add() returns.

        `parent`, `prefix_len` (a writer with share_prefixes=True): the sample's first `prefix_len` rows are
        those of earlier sample `parent`, whose ids must agree there; `hidden_states` then holds the rows from
        position `prefix_len` on only."""
        if self._closed:
            raise ShardError(f"{self.path}: add() after close()")
        sample = len(self._index["sample_ids"])
        tensors, ref = self._tensors(sample, input_ids, hidden_states, loss_mask, parent, prefix_len)
        seed = fmt.reference_seed(ref, prefix_len)
        seq = input_ids.numel()
        ix = self._index
        ix["parents"].append(ref)
        ix["prefix_lens"].append(prefix_len if ref != fmt.NO_PARENT else 0)
        if self._ids is not None:
            self._ids.append(tensors[0])
            self._ref_depth.append(fmt.reference_depth(self._ref_depth, ref))
        ix["sample_ids"].append(str(sample_id))
        ix["seq_lens"].append(seq)
        ix["num_trained"].append(int((tensors[1] != 0).sum()))
        ix["raw_bytes"].append(16 * seq
                               + self.metadata["num_hidden_tensors"] * seq * self._hidden * self._out_dtype.itemsize)
        if self._pool is None:
            self._write_record(sample, *self._encode(tensors, seed))
            return
        # Pipelined across samples (up to threads + 1 ahead): a stream of mid-sized samples (the SGLang path,
        # 512-token prompts, 16 MB each) keeps every thread busy, which splitting one sample alone did not.
        self._pending.append((sample, self._submit(tensors, seed), sum(t.nbytes for t in tensors)))
        while len(self._pending) > self._depth or len(self._pending) > 1 and \
                sum(n for *_, n in self._pending) > ENCODE_AHEAD_BYTES:
            self._write_oldest()

    def _write_oldest(self) -> None:
        sample, fut, _ = self._pending.popleft()
        t = time.perf_counter()
        try:
            parts, digest = fut.result()
            self.encode_wait_s += time.perf_counter() - t
        except BaseException:
            self.abort()
            raise
        self._write_record(sample, parts, digest)

    def _write_record(self, sample: int, parts: list[bytes], digest: int) -> None:
        payload_len = sum(len(x) for x in parts)
        ix = self._index
        ix["offsets"].append(self._pos)
        ix["record_lens"].append(fmt.RECORD.size + payload_len)
        ix["payload_xxh3"].append(digest)
        self._write(fmt.pack_record_header(sample, payload_len, digest), *parts)

    def __len__(self) -> int:
        return len(self._index["sample_ids"])

    def _write(self, *chunks: bytes) -> None:
        """Hand `chunks` to the writer thread; wait while it is `write_ahead_mb` behind (timed as write_s)."""
        n = sum(len(c) for c in chunks)
        t = time.perf_counter()
        with self._wcond:
            while self._queued and self._queued + n > self._ahead and self._werr is None:
                self._wcond.wait()
            if self._werr is None:
                self._queued += n
        self.write_s += time.perf_counter() - t
        self._raise_write_error()  # an earlier write failed: nothing more is handed over
        self._wq.put(list(chunks))
        self._pos += n

    def _writer_loop(self) -> None:
        while (chunks := self._wq.get()) is not None:
            n = sum(len(c) for c in chunks)
            try:
                if self._werr is None:  # after an error: drain, write nothing
                    t = time.perf_counter()
                    for c in chunks:
                        self._file.write(c)
                    self.disk_s += time.perf_counter() - t
                    self._unsynced += n
                    if self._sync_every and self._unsynced >= self._sync_every:
                        self._background_sync()
            except BaseException as e:  # noqa: BLE001 - reported by the next add() or close()
                self._werr = e
            finally:
                with self._wcond:
                    self._queued -= n
                    self._wcond.notify_all()

    def _background_sync(self) -> None:
        """Start an fdatasync of what the file holds unless one still runs (then try next time). On its own
        thread, so the writer goes on filling the page cache while the disk takes the last `sync_every_mb`
        MB (bench/shard_sync.py measures it)."""
        if self._sync is not None:
            if not self._sync.done():
                return
            self._sync.result()  # an OSError from the disk surfaces here, as a failed write
        self._file.flush()
        self._unsynced = 0
        self._sync = self._syncer.submit(os.fdatasync, self._file.fileno())

    def _wait_sync(self) -> None:
        if self._sync is not None:
            fut, self._sync = self._sync, None
            fut.result()

    def _raise_write_error(self) -> None:
        e = self._werr
        if e is None:
            return
        self.abort()
        raise self._failed(f"writing failed after {len(self._index['offsets'])} samples", e) from e

    def _failed(self, what: str, e: BaseException) -> ShardError:
        """The error of a shard that failed (aborted: nothing left behind), with what to do."""
        strerror = e.strerror if isinstance(e, OSError) else None
        return ShardError(f"{self.path}: {what} ({strerror or e}); no shard was left behind. Free space in "
                          f"{self.path.parent} (or fix the error) and rerun the chunk.")

    def _stop_writer(self) -> None:
        """Let the writer thread finish what it holds (the consumer waits: write_s) and end."""
        if self._wthread.is_alive():
            t = time.perf_counter()
            self._wq.put(None)
            self._wthread.join()
            try:  # the last background sync: its error is a failed write too
                self._wait_sync()
            except OSError as e:
                if self._werr is None:
                    self._werr = e
            self.write_s += time.perf_counter() - t

    def close(self) -> ShardSummary:
        """Write index and footer, fsync, rename into place. Returns what was stored."""
        if self._closed:
            raise ShardError(f"{self.path}: close() called twice")
        while self._pending:
            self._write_oldest()
        # version 2 only where a sample takes rows from another: otherwise the bytes are version 1's
        version = fmt.FORMAT_VERSION if any(p != fmt.NO_PARENT for p in self._index["parents"]) else fmt.FLAT_VERSION
        columns = fmt.index_columns(version)
        index = zstd.ZstdCompressor(level=3, write_checksum=True).compress(
            json.dumps({c: self._index[c] for c in columns}, separators=(",", ":")).encode()
        )
        offset = self._pos
        self._write(index)
        self._write(fmt.pack_footer(offset, index, len(self), version))
        self._stop_writer()
        self._raise_write_error()
        try:
            if version != self.metadata["format_version"]:
                # the header went out first, as version 1; the version's digit is all that changes in it
                old = fmt.pack_header(self.metadata)
                self.metadata["format_version"] = version
                head = fmt.pack_header(self.metadata)
                assert len(head) == len(old)
                self._file.flush()
                os.pwrite(self._file.fileno(), head, 0)
            self._file.flush()
            commit(os.dup(self._file.fileno()), self._tmp, self.path)
            self._drop_temp.detach()
            self._file.close()
        except OSError as e:
            self.abort()
            raise self._failed("finishing the shard failed", e) from e
        self._closed = True
        if self._pool:
            self._pool.shutdown()
        self._syncer.shutdown()
        return ShardSummary(
            path=str(self.path),
            num_samples=len(self),
            num_tokens=sum(self._index["seq_lens"]),
            raw_bytes=sum(self._index["raw_bytes"]),
            stored_bytes=self.path.stat().st_size,
            encode_wait_s=round(self.encode_wait_s, 3),
            write_s=round(self.write_s, 3),
            disk_s=round(self.disk_s, 3),
        )

    def abort(self) -> None:
        """Drop everything written so far; the target path is left untouched."""
        if self._closed:
            return
        self._closed = True
        # the writer thread must be done with the file before it is closed: it drops what it still holds
        if self._werr is None:
            self._werr = ShardError("aborted")
        self._stop_writer()
        self._syncer.shutdown()
        try:
            self._file.close()
        except OSError:
            pass  # close() flushes the buffered tail, which fails again on a full disk; the temp goes anyway
        finally:
            self._drop_temp()
            self._pending.clear()
            if self._pool:
                self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            if not self._closed:  # the block may have closed it itself (to time it, or for its summary)
                self.close()
        else:
            self.abort()
