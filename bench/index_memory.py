"""What a reader keeps in memory per sample for a shard's index: one shard of N tiny samples (8 tokens, hidden 16,
4 tensors; ids like a conversation's turns, "agentic-source:123:t45") as version 1 (no references) and version 2
(chains of 50 turns, each taking 7 rows from the one before), and a dataset of K such shards (hard links of the
one file) through open_dataset. Per sample: the bytes a ShardReader keeps allocated (tracemalloc, after a gc), the
peak while it opens (the JSON index decoded), and the RSS growth of open_dataset over the K shards.

Uses only ShardReader and open_dataset, so the same script measures any commit.

    PYTHONPATH=src python bench/index_memory.py --n 100000 --shards 20
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shard_meta import placeholder_metadata

from hsextract.dataset import open_dataset
from hsextract.shard import ShardReader, ShardWriter

TURNS = 50


def write(path: Path, n: int, shared: bool) -> None:
    mask, gen = torch.ones(8, dtype=torch.long), torch.Generator().manual_seed(0)
    hs = [torch.randn(8, 16, generator=gen).to(torch.bfloat16) for _ in range(4)]
    with ShardWriter(path, placeholder_metadata(16, [1, 2, 3]), share_prefixes=shared, sync_every_mb=0) as w:
        for i in range(n):
            tok = torch.arange(8)
            tok[7] += i % 1000
            sid = f"agentic-source:{i // TURNS}:t{2 * (i % TURNS) + 1}"
            if shared and i % TURNS:
                w.add(tok, [h[7:] for h in hs], mask, sample_id=sid, parent=i - 1, prefix_len=7)
            else:
                w.add(tok, hs, mask, sample_id=sid)


def rss() -> int:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(path: Path, n: int, k: int, folder: Path) -> dict[str, float]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    r = ShardReader(path)
    gc.collect()
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(r) == n
    del r
    for j in range(k):
        os.link(path, folder / f"s{j:03d}.hss")
    gc.collect()
    r0 = rss()
    ds = open_dataset(folder)
    gc.collect()
    grown = rss() - r0
    assert len(ds) == n * k
    return {"kept": (kept - before) / n, "peak": (peak - before) / n, "rss": grown / (n * k), "rss_mib": grown / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="samples per shard")
    ap.add_argument("--shards", type=int, default=20, help="shards of the dataset")
    ap.add_argument("--dir", type=Path, default=None, help="where the shards go (default: the temp folder)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for version in (1, 2):
            path = Path(tmp) / f"v{version}.hss"
            t = time.time()
            write(path, args.n, version == 2)
            print(f"wrote {path.name}: {args.n} samples, {path.stat().st_size / 2**20:.1f} MiB, "
                  f"{time.time() - t:.0f} s", flush=True)
            folder = Path(tmp) / f"ds{version}"
            folder.mkdir()
            rows.append((version, measure(path, args.n, args.shards, folder)))
            path.unlink()
    print(f"\n| shard version | reader keeps, B/sample | peak while opening, B/sample | dataset of {args.shards} "
          f"x {args.n:,}: RSS growth | B/sample |")
    print("|---|---|---|---|---|")
    for version, m in rows:
        print(f"| {version} | {m['kept']:.1f} | {m['peak']:.0f} | {m['rss_mib']:.0f} MiB | {m['rss']:.1f} |")


if __name__ == "__main__":
    main()
