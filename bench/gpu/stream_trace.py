"""Where a DataLoader worker of `HiddenStateDataset.stream` spends a cold epoch (issue 21 item 4, diagnosis).

Times every record read (ShardReader._record), every decode (ShardReader._decode) and every hand-over to the
loader (the generator's yield until the worker asks for the next sample: collate and send), per worker, and
when each sample reaches the loader; then prints per worker count: the epoch's GB/s, how long each stage took
per sample, and the share of the epoch during which the disk had no read of ours in flight.

    PYTHONPATH=src python bench/gpu/stream_trace.py --gb 4 --workers 1 4 --readahead 2 4 --out trace.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from pagecache import drop_method, evict
from read import sample_lengths, write_shards
from torch.utils.data import DataLoader

from hsextract.dataset import SampleStream, open_dataset
from hsextract.shard.reader import ShardReader

EVENTS: list[tuple[str, int, float, float]] = []  # (what, worker pid, start, end), this process


def timed(name: str, fn: Any) -> Any:
    def wrap(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            EVENTS.append((name, os.getpid(), t0, time.perf_counter()))
    return wrap


ShardReader._record = timed("read", ShardReader._record)  # type: ignore[method-assign]
ShardReader._decode = timed("decode", ShardReader._decode)  # type: ignore[method-assign]


class TracedStream(SampleStream):
    """The stream, timing each hand-over; each worker writes its events to `dump` when its pass ends."""

    dump: Path

    def __iter__(self):  # type: ignore[no-untyped-def]
        EVENTS.clear()
        for s in super().__iter__():
            t0 = time.perf_counter()
            yield s
            EVENTS.append(("handover", os.getpid(), t0, time.perf_counter()))
        tmp = self.dump / f".{os.getpid()}.tmp"
        tmp.write_text(json.dumps(EVENTS), encoding="utf-8")
        tmp.rename(self.dump / f"{os.getpid()}.json")  # whole or absent for the reader below


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def epoch(loader: DataLoader, stream: TracedStream, n: int) -> dict[str, Any]:
    for f in stream.dump.glob("*.json"):
        f.unlink()
    t0 = time.perf_counter()
    arrivals = []
    for _ in loader:
        arrivals.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    deadline = time.monotonic() + 60
    while len(list(stream.dump.glob("*.json"))) < max(loader.num_workers, 1):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{stream.dump}: not every worker wrote its trace within 60 s of the epoch's end")
        time.sleep(0.05)  # the workers write their traces after their last sample (diagnosis script, not a test)
    ev = [e for f in stream.dump.glob("*.json") for e in json.loads(f.read_text(encoding="utf-8"))]
    out: dict[str, Any] = {"wall_s": wall, "first_s": arrivals[0], "samples": len(arrivals)}
    for what in ("read", "decode", "handover"):
        d = [b - a for w, _, a, b in ev if w == what]
        out[f"{what}_ms_mean"] = 1000 * sum(d) / max(len(d), 1)
    reads = [(a - t0, b - t0) for w, _, a, b in ev if w == "read"]
    out["no_read_in_flight_share"] = 1 - union(reads) / wall
    per_worker = {}
    for pid in {p for _, p, _, _ in ev}:
        r = [(a - t0, b - t0) for w, p, a, b in ev if w == "read" and p == pid]
        per_worker[pid] = 1 - union(r) / wall
    out["worker_no_read_share"] = sorted(per_worker.values())
    out["events"] = [(w, p, a - t0, b - t0) for w, p, a, b in ev]
    return out


def describe(r: dict[str, Any]) -> str:
    per_worker = ", ".join(f"{x:.0%}" for x in r["worker_no_read_share"])
    return (f"w{r['workers']} ra{r['readahead']} {r['cache']}: {r['gb_s']:.2f} GB/s, first sample "
            f"{r['first_s'] * 1000:.0f} ms, read {r['read_ms_mean']:.0f} / decode {r['decode_ms_mean']:.0f} / "
            f"hand-over {r['handover_ms_mean']:.0f} ms per sample, no read in flight "
            f"{r['no_read_in_flight_share']:.0%} (per worker {per_worker})")


def cells(folder: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    """A warm and a cold epoch per (workers, readahead), over shards of --gb GB written into `folder`."""
    lens = sample_lengths(a.gb, 7168, 512, 2048, 256)
    write_shards(folder / "shards", lens, 7168, 64)
    shards = sorted((folder / "shards").glob("*.hss"))
    ds = open_dataset(shards, decode_threads=a.decode_threads)
    hidden = sum(lens) * 4 * 7168 * 2
    method = drop_method()
    res = []
    for w in a.workers:
        for ra in a.readahead:
            stream = TracedStream(ds, shuffle=True, seed=0, readahead=ra, prefetch=a.prefetch, batch_size=1, rank=0,
                                  world_size=1)
            stream.dump = folder / f"trace-{w}-{ra}"
            stream.dump.mkdir()
            loader = DataLoader(stream, batch_size=1, num_workers=w, persistent_workers=True)
            epoch(loader, stream, len(lens))  # workers started
            for cache in ("warm", "cold"):
                if cache == "cold":
                    evict(shards, method)
                r = epoch(loader, stream, len(lens))
                r.update(workers=w, readahead=ra, prefetch=a.prefetch, cache=cache, gb_s=hidden / r["wall_s"] / 1e9)
                res.append(r)
                print(describe(r), flush=True)
            del loader
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, default=4)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--readahead", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--prefetch", type=int, default=4, help="the stream's prefetch (records asked of the disk ahead; "
                    "the trace's reads are ours only, not the kernel's reads those start)")
    ap.add_argument("--decode-threads", type=int, default=4)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hsx-trace-", dir=a.dir))
    try:
        res = cells(folder, a)
    finally:
        shutil.rmtree(folder)  # the shards (gigabytes)
    if a.out:
        Path(a.out).write_text(json.dumps(res), encoding="utf-8")


if __name__ == "__main__":
    main()
