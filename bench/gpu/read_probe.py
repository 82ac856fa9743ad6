"""How fast the host's disk delivers records, cold, by read pattern (issue 21 item 4: the cold trainer read).

No decoding: only the reads a DataLoader worker makes. The same records (random sizes, --min-mb..--max-mb) are
stored twice: concatenated in one file (as a shard holds them) and one file per record (as `.pt` files hold
them). P processes (DataLoader workers) each read every P-th record of a shuffled order; before each pass the
page cache is dropped. Patterns:

  files      one file per record, opened and read whole, one record at a time (what torch.load does)
  slices     the one file, a record read in --slices parallel preads, --ahead records in flight (our reader)
  slices+seq the same after posix_fadvise(SEQUENTIAL) on the process's descriptor (a larger readahead window)
  slices+fd  the same with a descriptor per thread (readahead state is kept per open file)
  whole      the one file, each record one pread, --ahead records in flight
  chunks     the one file, records in --chunk-mb preads, --depth of them in flight per process
  direct     the one file opened O_DIRECT (no page cache, no readahead): slices, aligned

Run (root, for drop_caches): python bench/gpu/read_probe.py --dir /tmp --gb 4 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from pagecache import drop_method, evict

ALIGN = 4096
PATTERNS = ("files", "slices", "slices+seq", "slices+fd", "whole", "chunks", "direct")


def block_info(folder: Path) -> dict[str, str]:
    """The queue settings of the block device under `folder` (readahead, request size, scheduler)."""
    info = {"kernel": platform.release()}
    try:
        src = subprocess.run(["findmnt", "-no", "SOURCE,FSTYPE", "-T", str(folder)], capture_output=True,
                             text=True, check=False).stdout.split()
        info["mount"] = " ".join(src)
        dev = Path(src[0]).resolve().name if src else ""
        for cand in (dev, dev.rstrip("0123456789"), dev.rsplit("p", 1)[0]):
            q = Path("/sys/block") / cand / "queue"
            if q.is_dir():
                for k in ("read_ahead_kb", "max_sectors_kb", "nr_requests", "scheduler", "rotational"):
                    if (q / k).exists():
                        info[k] = (q / k).read_text(encoding="utf-8").strip()
                break
    except (OSError, IndexError):
        pass
    return info


class Buffers(threading.local):
    """One page-aligned buffer per thread, grown as needed (page faults are not what is measured)."""

    def get(self, n: int) -> memoryview:
        buf = getattr(self, "buf", None)
        if buf is None or len(buf) < n:
            buf = self.buf = mmap.mmap(-1, -(-n // ALIGN) * ALIGN)
            buf.write(b"\0" * len(buf))  # fault it in once
        return memoryview(buf)[:n]


def read_at(fd: int, buf: memoryview, off: int) -> int:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], off + got)
        if n == 0:
            break
        got += n
    return got


def worker(pattern: str, big: str, files: list[str], recs: list[tuple[int, int, int]], a: argparse.Namespace,
           go: mp.Event, done: mp.Queue) -> None:  # type: ignore[type-arg]
    bufs = Buffers()
    flags = os.O_RDONLY | (os.O_DIRECT if pattern == "direct" else 0)
    fd = os.open(big, flags)
    if pattern == "slices+seq":
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    fds = threading.local()

    def thread_fd() -> int:
        if pattern != "slices+fd":
            return fd
        if not hasattr(fds, "fd"):
            fds.fd = os.open(big, os.O_RDONLY)
        return fds.fd

    def piece(off: int, n: int) -> int:
        if pattern == "direct":
            lo, hi = off // ALIGN * ALIGN, -(-(off + n) // ALIGN) * ALIGN
            return min(read_at(fd, bufs.get(hi - lo), lo) - (off - lo), n)
        return read_at(thread_fd(), bufs.get(n), off)

    def whole_file(i: int) -> int:
        with open(files[i], "rb", buffering=0) as f:
            return f.readinto(bufs.get(os.fstat(f.fileno()).st_size))  # type: ignore[arg-type]

    if pattern == "chunks":
        step, depth = int(a.chunk_mb * (1 << 20)), a.depth
    elif pattern == "files":
        step, depth = 0, 1
    elif pattern == "whole":
        step, depth = 0, a.ahead
    else:
        step, depth = 0, a.ahead * a.slices
    pool = ThreadPoolExecutor(max(depth, 1))

    def finish(want: int, jobs: list) -> int:  # type: ignore[type-arg]
        got = sum(j.result() for j in jobs)
        if got != want:
            raise RuntimeError(f"{pattern}: record of {want} bytes read as {got}")
        return got

    go.wait()
    t0 = time.perf_counter()
    total = 0
    inflight: deque = deque()
    for i, off, n in recs:
        if pattern == "files":
            jobs = [pool.submit(whole_file, i)]
        elif pattern == "whole":
            jobs = [pool.submit(piece, off, n)]
        else:
            s = step or -(-n // a.slices)
            jobs = [pool.submit(piece, off + k, min(s, n - k)) for k in range(0, n, s)]
        inflight.append((n, jobs))
        # records complete in order (a DataLoader worker delivers in order); keep `ahead` records' reads going
        while len(inflight) >= (1 if pattern == "files" else a.ahead):
            total += finish(*inflight.popleft())
    while inflight:
        total += finish(*inflight.popleft())
    done.put((total, time.perf_counter() - t0))


def one_pass(pattern: str, procs: int, big: Path, files: list[Path], recs: list[tuple[int, int, int]],
             a: argparse.Namespace) -> dict[str, float]:
    evict([big, *files], a.evict)  # drop_caches as root, else each of our files
    ctx = mp.get_context("fork")
    go, done = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=worker, args=(pattern, str(big), [str(f) for f in files], recs[k::procs], a, go, done))
          for k in range(procs)]
    for p in ps:
        p.start()
    time.sleep(0.5)  # let every process open its file before the clock starts (bench only, not a test)
    t0 = time.perf_counter()
    go.set()
    got = [done.get(timeout=600) for _ in ps]
    wall = time.perf_counter() - t0
    for p in ps:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{pattern} x{procs}: a process exited {p.exitcode}")
    nbytes = sum(g for g, _ in got)
    return {"gb_s": nbytes / wall / 1e9, "wall_s": wall, "bytes": nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--min-mb", type=float, default=20)
    ap.add_argument("--max-mb", type=float, default=80)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    ap.add_argument("--slices", type=int, default=4)
    ap.add_argument("--ahead", type=int, default=2)
    ap.add_argument("--chunk-mb", type=float, default=1.0)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.evict = drop_method()
    rng = random.Random(0)
    folder = Path(tempfile.mkdtemp(prefix="hsx-probe-", dir=a.dir))
    res: dict = {"block": block_info(folder), "args": vars(a), "cells": {}}
    try:
        sizes, total = [], 0
        while total < a.gb * 1e9:
            sizes.append(int(rng.uniform(a.min_mb, a.max_mb) * (1 << 20)))
            total += sizes[-1]
        big = folder / "records.bin"
        files, recs, off = [], [], 0
        with open(big, "wb") as f:
            for i, n in enumerate(sizes):
                data = os.urandom(n)
                f.write(data)
                files.append(folder / f"rec_{i}.bin")
                files[-1].write_bytes(data)
                recs.append((i, off, n))
                off += n
        rng.shuffle(recs)
        res["records"], res["bytes"] = len(sizes), total
        print(f"{len(sizes)} records, {total / 1e9:.2f} GB, {res['block']}", flush=True)
        for procs in a.procs:
            for r in range(a.repeats):
                for pattern in a.patterns:
                    cell = one_pass(pattern, procs, big, files, recs, a)
                    key = f"{pattern} x{procs}"
                    best = res["cells"].get(key)
                    if best is None or cell["gb_s"] > best["gb_s"]:
                        res["cells"][key] = cell
                    print(f"{key:16s} repeat {r}: {cell['gb_s']:.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(folder)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1), encoding="utf-8")
    print("| pattern | " + " | ".join(f"{p} proc" for p in a.procs) + " |")
    print("|---|" + "---|" * len(a.procs))
    for pattern in a.patterns:
        print(f"| {pattern} | " + " | ".join(f"{res['cells'][f'{pattern} x{p}']['gb_s']:.2f}" for p in a.procs)
              + " |")


if __name__ == "__main__":
    main()
