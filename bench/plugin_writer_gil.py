"""The plugin's dump writer beside a busy scheduler thread: how long from the hook to the `.done` marker?

On the H200 (bench/results/h200-2026-12-03, timeline of run 4) the last `.done` marker of a 512-token run
came 0.95-3.5 s after the server's last HTTP answer: the writer threads fell behind. They live in SGLang's
scheduler process, whose event loop spins in Python and holds the GIL; a writer thread coming back from
a write (which releases the GIL) waits up to the switch interval for it. This script reproduces that on
the CPU: the main thread plays the scheduler, submitting one `--mb` MB piece (4 bf16 blocks) at a time at
`--offered-gbps` and spinning in Python in between and afterwards, while `DumpWriter` writes them to
`--dir` from `--threads` threads. Per switch interval (5 ms, CPython's default, and 0.5 ms, what the
plugin sets), in one run: hook -> marker lag (median, max) from the markers' staged_at / written_at, and
the tail after the last submit.

    PYTHONPATH=src python bench/plugin_writer_gil.py [--dir /dev/shm] [--n 96] [--mb 16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from hsextract.sglang_plugin import dumpfiles
from hsextract.sglang_plugin.slicing import PieceSlice
from hsextract.sglang_plugin.staging import StagingRing
from hsextract.sglang_plugin.writer import DumpWriter


def one(dump_dir: Path, n: int, mb: int, threads: int, interval: float, offered_gbps: float) -> dict:
    hidden = 4096
    rows = mb * 2**20 // (4 * hidden * 2)  # 4 bf16 tensors per row
    src = [torch.randn(rows, hidden).to(torch.bfloat16) for _ in range(4)]
    piece = 4 * rows * hidden * 2
    period = piece / (offered_gbps * 1e9)
    w = DumpWriter(dump_dir, StagingRing(16 * (piece + 4096), pin=False), threads=threads,
                   max_piece_bytes=piece + 4096)
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            w.submit([PieceSlice(f"r{i}", rows, 0, rows, 0, list(range(rows)))], src)
            due = t0 + (i + 1) * period
            while time.perf_counter() < due:  # the scheduler's own Python work, GIL held
                pass
        while w.stats.requests_done < n:  # idle: SGLang's scheduler polls its sockets without blocking
            pass
        wall = time.perf_counter() - t0
        w.flush(timeout_s=600)
    finally:
        sys.setswitchinterval(old)
        w.close()
    lags = sorted(m["written_at"] - m["staged_at"] for m in
                  (json.loads((dump_dir / dumpfiles.done_name(f"r{i}")).read_text()) for i in range(n)))
    return {"switch_interval_ms": interval * 1e3, "writer_threads": threads, "pieces": n, "piece_mb": mb,
            "offered_gb_per_s": offered_gbps, "written_gb_per_s": round(n * piece / wall / 1e9, 3),
            "lag_median_s": round(lags[n // 2], 4), "lag_max_s": round(lags[-1], 4),
            "tail_s": round(wall - n * period, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--offered-gbps", type=float, default=0.5, help="rate at which the scheduler submits")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    rows = []
    for interval in (0.005, 0.0005):
        d = Path(tempfile.mkdtemp(prefix="hsx-gil-", dir=a.dir))
        try:
            r = one(d, a.n, a.mb, a.threads, interval, a.offered_gbps)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        rows.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
