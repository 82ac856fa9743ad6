"""Stage pieces to host memory without blocking the GPU stream, and write them from several threads.

`DumpWriter.submit` runs in the scheduler (inside the forward hook): it splits each piece into row
blocks that fit the staging ring, issues non-blocking device-to-host copies, records an event and queues
the job.

On CUDA the device-to-host copies run on a side stream of their own (`copy_stream`, on by default): the
batch's captured rows are first cloned on the forward's stream (a device copy; the next forward may
overwrite the originals, CUDA graph outputs), and the PCIe copy of the clone then runs beside the next
forward instead of before it (bench/README.md, "plugin copy stream", has the check and the time saved).
When the clone does not fit in device memory the batch falls back to copies on the forward's stream.

A writer thread waits for the event, writes the piece file, frees the staging region, and when a
request's last piece is in, writes its `.done` marker listing the pieces (or `.err` when they do not
cover the prompt). With `shared_prefix` (the server's radix cache on, docs/SHARED_PREFIX.md) the pieces cover
[start, n_tokens) instead, start being the request's prefix-cache hit (SGLang's extend prefix length: the
first piece's start), which the marker records; without it a chain that does not start at 0 is an error.

Threads: `threads` writers, each with its own FIFO queue. Every job of one rid goes to the same thread
(crc32 of the rid mod `threads`), so a request's pieces are written in the order they were computed,
its marker comes after its pieces, and its chain/supersede bookkeeping is touched by one thread only
(per-thread state, no lock). Regions are freed in whatever order the threads finish; the ring reclaims
space behind the oldest live region. Counters are shared and updated under one lock.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hsextract.atomic import write_json_atomic
from hsextract.sglang_plugin import dumpfiles
from hsextract.sglang_plugin.slicing import PieceSlice
from hsextract.sglang_plugin.staging import ALIGN, Region, StagingRing

log = logging.getLogger("hsextract.sglang_plugin")


@dataclass
class _Job:
    rid: str
    n_tokens: int
    start: int
    end: int
    ids: Any
    region: Region | None
    blocks: list[dumpfiles.RawBlock]  # views of the staging ring: the writer thread touches no tensor
    event: Any
    error: str | None = None
    staged_at: float = 0.0  # wall clock at submit; with the marker's written_at it shows the writer's lag


@dataclass
class WriterStats:
    pieces: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    bytes_written: int = 0
    rids_reused: int = 0  # a completed rid came again as a new request (dumped again)
    write_errors: int = 0
    last_error: str | None = None


_FLUSH = "__flush__"  # error text of a flush job: a barrier, not a marker


class _Lane:
    """One writer thread: its FIFO queue and the state of the rids hashed to it (touched by it alone)."""

    def __init__(self, index: int, remember: int) -> None:
        self.index = index
        self.q: queue.Queue[_Job | None] = queue.Queue()
        self.chains: dict[str, list[tuple[int, int]]] = {}
        self.completed: OrderedDict[str, None] = OrderedDict()
        # rids given an `.err` before their last piece: the pieces of theirs still to come are dropped
        self.failed: OrderedDict[str, None] = OrderedDict()
        self.remember = remember
        self.thread: threading.Thread | None = None


class DumpWriter:
    def __init__(
        self,
        dump_dir: Path,
        staging: StagingRing,
        *,
        threads: int = 4,
        max_piece_bytes: int | None = None,
        remember_completed: int = 100_000,
        write_delay_s: float = 0.0,  # tests: a slow disk
        extra_stats: Callable[[], dict] | None = None,  # counters kept elsewhere (scheduler side)
        copy_stream: bool = True,  # CUDA: device-to-host copies beside the next forward (module docstring)
        shared_prefix: bool = False,  # a chain may start at its prefix-cache hit (module docstring)
    ) -> None:
        if threads < 1:
            raise ValueError(f"writer threads must be >= 1, got {threads}")
        self.dump_dir = Path(dump_dir)
        self.ring = staging
        self.max_piece_bytes = max_piece_bytes or max(ALIGN, staging.capacity // 4)
        if self.max_piece_bytes > staging.capacity:
            raise ValueError("max_piece_bytes exceeds the staging capacity")
        self.threads = threads
        self._mem = memoryview(staging.buf.numpy())  # the ring's bytes, sliced in the scheduler thread
        self.stats = WriterStats()  # summed over threads; update under _lock
        self._lock = threading.Lock()
        self._stats_file_lock = threading.Lock()  # one writer of stats-<pid>.json (shared temp name)
        self._delay = write_delay_s
        self._extra_stats = extra_stats
        self.stats_every_s = 2.0
        self._last_stats = time.monotonic()
        self._dirty = True
        self._use_copy_stream = copy_stream
        self.shared_prefix = shared_prefix
        self._copy_stream: Any = None  # created on the first CUDA batch, on that batch's device
        self.copy_fallbacks = 0  # batches copied on the forward's stream: their clone did not fit
        per_lane = max(1, -(-remember_completed // threads))
        self._lanes = [_Lane(i, per_lane) for i in range(threads)]
        for lane in self._lanes:
            lane.thread = threading.Thread(
                target=self._run, args=(lane,), name=f"hsextract-dump-writer-{lane.index}", daemon=True
            )
            lane.thread.start()

    def _lane(self, rid: str) -> _Lane:
        """The rid's thread: stable (crc32, not Python's per-process salted hash) and the same for every job."""
        return self._lanes[zlib.crc32(rid.encode()) % self.threads]

    # ---- scheduler side -------------------------------------------------------------------------
    def submit(self, pieces: Sequence[PieceSlice], sources: Sequence[torch.Tensor]) -> None:
        """Stage `pieces` of the row-aligned `sources` ([T, w_j] each, same rows) and queue them."""
        if not pieces:
            return
        row_bytes = sum(s.shape[1] * s.element_size() for s in sources)
        max_rows = max(1, (self.max_piece_bytes - ALIGN * len(sources)) // row_bytes)
        cuda = any(s.is_cuda for s in sources)
        side = self._side_sources(sources) if cuda and self._use_copy_stream else None
        if side is not None:
            sources, stream = side
            with torch.cuda.stream(stream):  # the copies and their events go to the side stream
                self._stage(pieces, sources, max_rows, cuda)
            for src in sources:  # the allocator must not hand the clones out before the copies read them
                src.record_stream(stream)
        else:
            self._stage(pieces, sources, max_rows, cuda)

    def _side_sources(self, sources: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Any] | None:
        """Contiguous clones of `sources` on the forward's stream, and the side stream made to wait for
        them; None (copy on the forward's stream) when the clones do not fit in device memory."""
        current = torch.cuda.current_stream(sources[0].device)
        try:
            clones = [s.clone(memory_format=torch.contiguous_format) for s in sources]
        except torch.cuda.OutOfMemoryError:
            with self._lock:
                self.copy_fallbacks += 1
                first = self.copy_fallbacks == 1
            if first:
                log.warning("hsextract: no device memory for the copy stream's clone of a batch; copying "
                            "on the forward's stream (counted as copy_fallbacks in the stats file)")
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=sources[0].device)
        self._copy_stream.wait_stream(current)
        return clones, self._copy_stream

    def _stage(self, pieces: Sequence[PieceSlice], sources: Sequence[torch.Tensor], max_rows: int,
               cuda: bool) -> None:
        """Row blocks of `pieces` into staging regions, one job each, copies on the current stream."""
        dtypes = [dumpfiles.dtype_name(s.dtype) for s in sources]
        for p in pieces:
            lane = self._lane(p.rid)
            for a in range(p.start, p.end, max_rows):
                b = min(a + max_rows, p.end)
                rows = b - a
                r0 = p.row + (a - p.start)
                sizes = [_aligned(rows * s.shape[1] * s.element_size()) for s in sources]
                region = self.ring.alloc(sum(sizes))
                blocks, off = [], 0
                for s, size, dt in zip(sources, sizes, dtypes, strict=True):
                    nbytes = rows * s.shape[1] * s.element_size()
                    dst = self.ring.view(region, off, nbytes).view(s.dtype).view(rows, s.shape[1])
                    dst.copy_(s[r0 : r0 + rows], non_blocking=cuda)
                    lo = region.start + off
                    blocks.append(dumpfiles.RawBlock(dt, (rows, s.shape[1]), self._mem[lo : lo + nbytes]))
                    off += size
                event = None
                if cuda:
                    event = torch.cuda.Event()
                    event.record()
                lane.q.put(_Job(p.rid, p.n_tokens, a, b, p.ids, region, blocks, event, staged_at=time.time()))

    def fail(self, rids: Sequence[tuple[str, int]], message: str) -> None:
        """Queue an `.err` marker for requests whose rows could not be staged (after their queued pieces)."""
        for rid, n in rids:
            self._lane(rid).q.put(_Job(rid, n, 0, 0, None, None, [], None, error=message))

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every job queued so far, on every thread, is written (tests, shutdown)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        barriers = []
        for lane in self._lanes:
            done = threading.Event()
            lane.q.put(_Job("", 0, 0, 0, None, None, [], done, error=_FLUSH))
            barriers.append(done)
        for done in barriers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not done.wait(left):
                raise TimeoutError("dump writer did not drain")
        self.write_stats()

    def close(self) -> None:
        self.flush()
        for lane in self._lanes:
            lane.q.put(None)
        for lane in self._lanes:
            assert lane.thread is not None
            lane.thread.join()

    # ---- writer threads -------------------------------------------------------------------------
    def _run(self, lane: _Lane) -> None:
        while True:
            try:
                job = lane.q.get(timeout=self.stats_every_s)
            except queue.Empty:  # idle: bring the stats file up to date once
                if self._dirty:
                    self._maybe_write_stats(force=True)
                continue
            if job is None:
                return
            if job.error == _FLUSH:
                job.event.set()
                continue
            self._dirty = True
            try:
                self._handle(lane, job)
            except Exception as e:  # never let one bad write kill the thread
                with self._lock:
                    self.stats.write_errors += 1
                    self.stats.last_error = f"{job.rid} [{job.start},{job.end}): {type(e).__name__}: {e}"[:500]
                log.exception("hsextract: writing %s [%d,%d) failed", job.rid, job.start, job.end)
                try:
                    self._give_up(lane, job)
                    dumpfiles.write_err(self.dump_dir, job.rid, f"writing piece [{job.start},{job.end}) failed: {e}")
                except Exception:  # noqa: BLE001 - the failure is logged above; the client times out
                    pass
            finally:
                if job.region is not None:
                    self.ring.free(job.region)
            self._maybe_write_stats()

    def _maybe_write_stats(self, force: bool = False) -> None:
        """Periodic stats from whichever thread gets there first; the others do not wait for it."""
        if not force and time.monotonic() - self._last_stats <= self.stats_every_s:
            return
        if not self._stats_file_lock.acquire(blocking=False):
            return
        try:
            if force or time.monotonic() - self._last_stats > self.stats_every_s:
                self._write_stats_locked()
        finally:
            self._stats_file_lock.release()

    def write_stats(self) -> None:
        """`stats-<pid>.json` in the dump dir: counters to judge whether the writer keeps up."""
        with self._stats_file_lock:
            self._write_stats_locked()

    def _write_stats_locked(self) -> None:
        self._last_stats = time.monotonic()
        self._dirty = False
        extra = self._extra_stats() if self._extra_stats is not None else {}
        with self._lock:
            counters = asdict(self.stats)
        info = counters | extra | {
            "staging_capacity": self.ring.capacity, "staging_peak": self.ring.peak,
            "staging_waits": self.ring.waits, "staging_allocs": self.ring.allocs,
            "queued": sum(lane.q.qsize() for lane in self._lanes), "writer_threads": self.threads,
            "copy_stream": self._copy_stream is not None, "copy_fallbacks": self.copy_fallbacks,
            "time": time.time(),
        }
        path = self.dump_dir / f"stats-{os.getpid()}.json"
        try:
            write_json_atomic(path, info, indent=None, durable=False)
        except OSError:
            log.warning("hsextract: cannot write %s", path)

    def _handle(self, lane: _Lane, job: _Job) -> None:
        if job.rid in lane.failed and job.error is None and job.start > 0:
            # a later chunked-prefill pass of a request already failed (its `.err` written, the client told):
            # nothing to write, nor a rid come again
            if job.end == job.n_tokens:
                del lane.failed[job.rid]
            return
        lane.failed.pop(job.rid, None)
        if job.rid in lane.completed:
            # A new request with the rid of a completed one (retraction re-runs of the same request are
            # dropped in the scheduler, by request object). It is dumped again: ignoring it would leave
            # the client waiting for a `.done` that never comes.
            del lane.completed[job.rid]
            with self._lock:
                self.stats.rids_reused += 1
                first = self.stats.rids_reused == 1
            if first:  # once; the stats file counts them
                log.warning("hsextract: rid %s came again after it was completed; dumping it again", job.rid)
        if job.error is not None:
            self._give_up(lane, job)
            with self._lock:
                self.stats.requests_failed += 1
            dumpfiles.write_err(self.dump_dir, job.rid, job.error)
            return
        if job.event is not None:
            job.event.synchronize()
        if self._delay:
            time.sleep(self._delay)
        chain = lane.chains.setdefault(job.rid, [])
        # A piece starting at or before an earlier piece's end supersedes it (retraction re-runs).
        keep = [(s, e) for s, e in chain if e <= job.start]
        for s, e in chain:
            if (s, e) not in keep and (s, e) != (job.start, job.end):
                (self.dump_dir / dumpfiles.piece_name(job.rid, s, e)).unlink(missing_ok=True)
        dumpfiles.write_piece(self.dump_dir, job.rid, job.start, job.end, job.n_tokens, job.blocks)
        nbytes = sum(len(b.data) for b in job.blocks)
        with self._lock:
            self.stats.pieces += 1
            self.stats.bytes_written += nbytes
        keep.append((job.start, job.end))
        lane.chains[job.rid] = keep
        if job.end == job.n_tokens:
            self._complete(lane, job, keep)

    def _complete(self, lane: _Lane, job: _Job, chain: list[tuple[int, int]]) -> None:
        # the rows before a radix-cache hit were never computed for this request: its first piece starts there
        start = chain[0][0] if self.shared_prefix and chain else 0
        pos = start
        for s, e in chain:
            if s != pos:
                break
            pos = e
        self._finish(lane, job.rid)
        if pos != job.n_tokens:
            with self._lock:
                self.stats.requests_failed += 1
            hint = "" if self.shared_prefix else " (prefix cache hit? launch the server with --disable-radix-cache)"
            dumpfiles.write_err(
                self.dump_dir,
                job.rid,
                f"rows for tokens [{pos},{chain[-1][0] if chain else 0}) were never computed{hint}; pieces {chain}",
            )
            for s, e in chain:
                (self.dump_dir / dumpfiles.piece_name(job.rid, s, e)).unlink(missing_ok=True)
            return
        blk = job.blocks
        dumpfiles.write_done(
            self.dump_dir,
            job.rid,
            {
                "n_tokens": job.n_tokens,
                "start": start,  # the first row's position: > 0 only after a radix-cache hit (shared_prefix)
                "pieces": [list(c) for c in chain],
                "ids_sha256": dumpfiles.ids_digest(job.ids),
                "dtype": blk[0].dtype if blk else None,
                "width": sum(b.shape[1] for b in blk),
                # diagnostics (clients may ignore them): when the last piece was staged and the marker written
                "staged_at": job.staged_at,
                "written_at": time.time(),
                "lane": lane.index,
            },
        )
        with self._lock:
            self.stats.requests_done += 1

    def _give_up(self, lane: _Lane, job: _Job) -> None:
        """The request of `job` is failed (its `.err` follows): forgotten, and its passes still to come dropped
        (fail() names no end, a failed write its own)."""
        self._finish(lane, job.rid)
        if job.end < job.n_tokens:
            lane.failed[job.rid] = None
            while len(lane.failed) > lane.remember:
                lane.failed.popitem(last=False)

    def _finish(self, lane: _Lane, rid: str) -> None:
        lane.chains.pop(rid, None)
        lane.completed[rid] = None
        while len(lane.completed) > lane.remember:
            lane.completed.popitem(last=False)

def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
