"""close() of a large shard: background fdatasync while writing (sync_every_mb) against none, in one run.

Without it the kernel keeps the whole shard dirty and close()'s fsync writes it all while the run
waits (bench/README.md has the figures). Samples of random bf16 activations
(hidden 4096, 4 tensors, 512 tokens: 16 MB each) go through ShardWriter at level 3; the variants
alternate, `--repeats` times each, and the shard goes to `--dir` (a real disk, not tmpfs).

    PYTHONPATH=src python bench/shard_sync.py [--dir /tmp] [--samples 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from shard_meta import placeholder_metadata  # bench/ is the script's folder

from hsextract.shard import ShardWriter

META = placeholder_metadata(4096, [1, 2, 3])


def activation_samples(n: int, distinct: int = 8) -> list[list[torch.Tensor]]:
    """`n` samples of 4 random bf16 [512, 4096] activations (16 MB), `distinct` of them reused round robin."""
    g = torch.Generator().manual_seed(0)
    pool = [[(torch.randn(512, 4096, generator=g) * 3).to(torch.bfloat16) for _ in range(4)] for _ in range(distinct)]
    return [pool[i % distinct] for i in range(n)]


def one(path: Path, samples: list[list[torch.Tensor]], threads: int, sync_mb: int) -> dict:
    ids = torch.arange(samples[0][0].shape[0])
    t0 = time.monotonic()
    w = ShardWriter(path, META, level=3, threads=threads, sync_every_mb=sync_mb)
    for hs in samples:
        w.add(ids, hs, torch.ones_like(ids))
    t1 = time.monotonic()
    summary = w.close()
    t2 = time.monotonic()
    path.unlink()
    return {"sync_every_mb": sync_mb, "adds_s": round(t1 - t0, 2), "close_s": round(t2 - t1, 2),
            "wall_s": round(t2 - t0, 2), "encode_wait_s": summary.encode_wait_s, "write_s": summary.write_s,
            "disk_s": summary.disk_s,
            "stored_mb": summary.stored_bytes >> 20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--distinct", type=int, default=8, help="distinct samples, reused round robin")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    samples = activation_samples(a.samples, a.distinct)
    d = Path(tempfile.mkdtemp(prefix="hsx-sync-", dir=a.dir))
    for _ in range(a.repeats):
        for mb in (0, 256):
            print(json.dumps(one(d / "s.hss", samples, a.threads, mb)), flush=True)
    d.rmdir()


if __name__ == "__main__":
    main()
