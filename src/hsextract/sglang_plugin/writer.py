"""Stage pieces to host memory without blocking the GPU stream, and write them from one thread.

`DumpWriter.submit` runs in the scheduler (inside the forward hook): it splits each piece into row
blocks that fit the staging ring, issues non-blocking device-to-host copies on the current stream,
records an event and queues the job. The writer thread waits for the event, writes the piece file,
frees the staging region, and when a request's last piece is in, writes its `.done` marker listing
the pieces (or `.err` when they do not cover the prompt). One thread, FIFO: regions are freed in
allocation order, and a request's pieces are written in the order they were computed.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hsextract import dumpfiles
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
    blocks: list[torch.Tensor]
    event: Any
    error: str | None = None


@dataclass
class WriterStats:
    pieces: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    bytes_written: int = 0
    rids_reused: int = 0  # a completed rid came again as a new request (dumped again)
    write_errors: int = 0
    last_error: str | None = None


class DumpWriter:
    def __init__(
        self,
        dump_dir: Path,
        staging: StagingRing,
        *,
        max_piece_bytes: int | None = None,
        remember_completed: int = 100_000,
        write_delay_s: float = 0.0,  # tests: a slow disk
        extra_stats: Callable[[], dict] | None = None,  # counters kept elsewhere (scheduler side)
    ) -> None:
        self.dump_dir = Path(dump_dir)
        self.ring = staging
        self.max_piece_bytes = max_piece_bytes or max(ALIGN, staging.capacity // 4)
        if self.max_piece_bytes > staging.capacity:
            raise ValueError("max_piece_bytes exceeds the staging capacity")
        self.stats = WriterStats()
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._chains: dict[str, list[tuple[int, int]]] = {}
        self._completed: OrderedDict[str, None] = OrderedDict()
        self._remember = remember_completed
        self._delay = write_delay_s
        self._extra_stats = extra_stats
        self.stats_every_s = 2.0
        self._last_stats = time.monotonic()
        self._dirty = True
        self._thread = threading.Thread(target=self._run, name="hsextract-dump-writer", daemon=True)
        self._thread.start()

    # ---- scheduler side -------------------------------------------------------------------------
    def submit(self, pieces: Sequence[PieceSlice], sources: Sequence[torch.Tensor]) -> None:
        """Stage `pieces` of the row-aligned `sources` ([T, w_j] each, same rows) and queue them."""
        if not pieces:
            return
        row_bytes = sum(s.shape[1] * s.element_size() for s in sources)
        max_rows = max(1, (self.max_piece_bytes - ALIGN * len(sources)) // row_bytes)
        cuda = any(s.is_cuda for s in sources)
        for p in pieces:
            for a in range(p.start, p.end, max_rows):
                b = min(a + max_rows, p.end)
                rows = b - a
                r0 = p.row + (a - p.start)
                sizes = [_aligned(rows * s.shape[1] * s.element_size()) for s in sources]
                region = self.ring.alloc(sum(sizes))
                blocks, off = [], 0
                for s, size in zip(sources, sizes):
                    nbytes = rows * s.shape[1] * s.element_size()
                    dst = self.ring.view(region, off, nbytes).view(s.dtype).view(rows, s.shape[1])
                    dst.copy_(s[r0 : r0 + rows], non_blocking=cuda)
                    blocks.append(dst)
                    off += size
                event = None
                if cuda:
                    event = torch.cuda.Event()
                    event.record()
                self._q.put(_Job(p.rid, p.n_tokens, a, b, p.ids, region, blocks, event))

    def fail(self, rids: Sequence[tuple[str, int]], message: str) -> None:
        """Queue an `.err` marker for requests whose rows could not be staged (keeps FIFO order)."""
        for rid, n in rids:
            self._q.put(_Job(rid, n, 0, 0, None, None, [], None, error=message))

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued job is written (tests, shutdown)."""
        done = threading.Event()
        self._q.put(_Job("", 0, 0, 0, None, None, [], done, error="__flush__"))
        if not done.wait(timeout_s):
            raise TimeoutError("dump writer did not drain")

    def close(self) -> None:
        self.flush()
        self._q.put(None)
        self._thread.join()

    # ---- writer thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                job = self._q.get(timeout=self.stats_every_s)
            except queue.Empty:  # idle: bring the stats file up to date once
                if self._dirty:
                    self.write_stats()
                continue
            self._dirty = True
            if job is None:
                return
            if job.error == "__flush__":
                self.write_stats()
                job.event.set()
                continue
            try:
                self._handle(job)
            except Exception as e:  # never let one bad write kill the thread
                self.stats.write_errors += 1
                self.stats.last_error = f"{job.rid} [{job.start},{job.end}): {type(e).__name__}: {e}"[:500]
                log.exception("hsextract: writing %s [%d,%d) failed", job.rid, job.start, job.end)
                try:
                    dumpfiles.write_err(self.dump_dir, job.rid, f"writing piece [{job.start},{job.end}) failed: {e}")
                except Exception:
                    pass
            finally:
                if job.region is not None:
                    self.ring.free(job.region)
            if time.monotonic() - self._last_stats > self.stats_every_s:
                self.write_stats()

    def write_stats(self) -> None:
        """`stats-<pid>.json` in the dump dir: counters to judge whether the writer keeps up."""
        self._last_stats = time.monotonic()
        self._dirty = False
        extra = self._extra_stats() if self._extra_stats is not None else {}
        info = asdict(self.stats) | extra | {
            "staging_capacity": self.ring.capacity, "staging_peak": self.ring.peak,
            "staging_waits": self.ring.waits, "staging_allocs": self.ring.allocs, "queued": self._q.qsize(),
            "time": time.time(),
        }
        path = self.dump_dir / f"stats-{os.getpid()}.json"
        tmp = path.with_name("." + path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(info))
            os.replace(tmp, path)
        except OSError:
            log.warning("hsextract: cannot write %s", path)

    def _handle(self, job: _Job) -> None:
        if job.rid in self._completed:
            # A new request with the rid of a completed one (retraction re-runs of the same request are
            # dropped in the scheduler, by request object). It is dumped again: ignoring it would leave
            # the client waiting for a `.done` that never comes (the H200 throughput run, rids reused).
            del self._completed[job.rid]
            self.stats.rids_reused += 1
            if self.stats.rids_reused == 1:  # once; the stats file counts them
                log.warning("hsextract: rid %s came again after it was completed; dumping it again", job.rid)
        if job.error is not None:
            self._finish(job.rid)
            self.stats.requests_failed += 1
            dumpfiles.write_err(self.dump_dir, job.rid, job.error)
            return
        if job.event is not None:
            job.event.synchronize()
        if self._delay:
            time.sleep(self._delay)
        chain = self._chains.setdefault(job.rid, [])
        # A piece starting at or before an earlier piece's end supersedes it (retraction re-runs).
        keep = [(s, e) for s, e in chain if e <= job.start]
        for s, e in chain:
            if (s, e) not in keep and (s, e) != (job.start, job.end):
                (self.dump_dir / dumpfiles.piece_name(job.rid, s, e)).unlink(missing_ok=True)
        dumpfiles.write_piece(self.dump_dir, job.rid, job.start, job.end, job.n_tokens, job.blocks)
        self.stats.pieces += 1
        self.stats.bytes_written += sum(b.numel() * b.element_size() for b in job.blocks)
        keep.append((job.start, job.end))
        self._chains[job.rid] = keep
        if job.end == job.n_tokens:
            self._complete(job, keep)

    def _complete(self, job: _Job, chain: list[tuple[int, int]]) -> None:
        pos = 0
        for s, e in chain:
            if s != pos:
                break
            pos = e
        self._finish(job.rid)
        if pos != job.n_tokens:
            self.stats.requests_failed += 1
            dumpfiles.write_err(
                self.dump_dir,
                job.rid,
                f"rows for tokens [{pos},{chain[-1][0] if chain else 0}) were never computed "
                f"(prefix cache hit? launch the server with --disable-radix-cache); pieces {chain}",
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
                "pieces": [list(c) for c in chain],
                "ids_sha256": dumpfiles.ids_digest(job.ids),
                "dtype": dumpfiles.dtype_name(blk[0].dtype) if blk else None,
                "width": sum(b.shape[1] for b in blk),
            },
        )
        self.stats.requests_done += 1

    def _finish(self, rid: str) -> None:
        self._chains.pop(rid, None)
        self._completed[rid] = None
        while len(self._completed) > self._remember:
            self._completed.popitem(last=False)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
