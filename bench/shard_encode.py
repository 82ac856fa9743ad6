"""How fast the shard writer encodes on this machine's CPU alone, by encoder threads, in one run.

The SGLang path's (b) needs the writer to take ~1.3 GB/s of raw hidden states (Llama-3-8B shape on an
H200, 512-token prompts); this separates the encoder's own capacity on the host from what it reaches
beside the server and the client's threads. Samples: random bf16 activations (hidden 4096, 4 tensors,
512 tokens: 16 MB each, as the throughput bench's), level 3, written to `--dir` (tmpfs by default, no
background sync, so the disk is out of the figure); each setting runs `--repeats` times, alternating.

    PYTHONPATH=src python bench/shard_encode.py [--threads 1 4 8] [--samples 64] [--out encode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from shard_meta import placeholder_metadata  # bench/ is the script's folder
from shard_sync import activation_samples  # the same random activations (bench/ is the script's folder)

from hsextract.shard import ShardWriter

META = placeholder_metadata(4096, [1, 2, 3])


def one(path: Path, samples: list[list[torch.Tensor]], threads: int, level: int) -> dict:
    ids = torch.arange(samples[0][0].shape[0])
    c0, t0 = os.times(), time.monotonic()
    with ShardWriter(path, META, level=level, threads=threads, sync_every_mb=0) as w:
        for hs in samples:
            w.add(ids, hs, torch.ones_like(ids))
        s = w.close()
    wall, c1 = time.monotonic() - t0, os.times()
    path.unlink()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    return {"threads": threads, "wall_s": round(wall, 3), "raw_gb_s": round(s.raw_bytes / wall / 1e9, 3),
            "cpu_cores": round(cpu / wall, 2), "raw_gb_per_cpu_s": round(s.raw_bytes / cpu / 1e9, 3),
            "stored_over_raw": round(s.stored_bytes / s.raw_bytes, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--distinct", type=int, default=8, help="distinct samples, reused round robin")
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    a = ap.parse_args()
    samples = activation_samples(a.samples, a.distinct)
    d = Path(tempfile.mkdtemp(prefix="hsx-enc-", dir=a.dir))
    rows = []
    try:
        for _ in range(a.repeats):
            for t in a.threads:
                rows.append(one(d / "s.hss", samples, t, a.level))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()
    res = {"cpus": os.cpu_count(), "samples": a.samples, "sample_mb": 16, "level": a.level, "dir": a.dir,
           "runs": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
