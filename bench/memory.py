"""Memory at Kimi-K2.5's width: peak RSS of each path over a shard's samples, against one sample's raw size.

A shard of --samples samples of --seq tokens, hidden 7168, 4 bf16 tensors (57,360 B a token raw, ids and mask
included; bench/codec.py's synthetic activations, built a block of rows at a time) is written once; then each path
runs in a process of its own and reports its peak RSS (ru_maxrss) less its RSS before the path began, over the
largest sample's raw bytes: how many samples' worth a path holds at once. The write paths (`write`: one thread,
`write-tN`: N encoder threads) are given a fresh sample each add(), built by the caller, which drops it after
add() returns (the extract's way): their figure includes the one sample the caller is building. A consumer that
keeps up holds fewer:
the iterating paths (iter, and each export) run behind a consumer that takes --consume-s a sample, so that the
read-ahead fills, the worst case. At 128k tokens a sample is 7.5 GB: each figure times that is a process's peak.

    PYTHONPATH=src python bench/memory.py [--seq 8192] [--samples 8] [--paths write,read,iter,...] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shard_meta import placeholder_metadata  # bench/ is the script's folder

H = 7168
TENSORS = 4
PATHS = ("write", "write-t4", "read", "iter", "validate", "stats", "speculators-v1", "specforge",
         "speculators-safetensors")
REFERENCE = Path(__file__).resolve().parents[1] / "resources" / "reference" / "speculators-v1-data_0.pt"


def rss() -> int:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sample(seq: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """bench/codec.py's synthetic activations, built a block of rows at a time: its synthetic_samples holds float32
    temporaries of a whole tensor, which would set the process's peak before the path under measure runs."""
    g = torch.Generator().manual_seed(seed)
    hs = []
    for layer in range(TENSORS):
        scale = torch.exp(torch.randn(H, generator=g) * 0.8) * (0.05 * (layer + 1))
        scale[torch.randperm(H, generator=g)[:6]] *= 100
        out = torch.empty(seq, H, dtype=torch.bfloat16)
        for a in range(0, seq, 1024):
            n = min(1024, seq - a)
            out[a:a + n] = (torch.randn(n, H, generator=g) * scale * torch.exp(torch.randn(n, 1, generator=g) * 0.3))
        hs.append(out)
    return torch.randint(0, 160000, (seq,), generator=g), hs, (torch.rand(seq, generator=g) > 0.4).long()


def one(path: str, shard: Path, seq: int, samples: int, consume_s: float) -> dict[str, float]:
    """Runs in its own process: the path, then its peak over its RSS once every module it uses is imported."""
    from hsextract.dataset import HiddenStateDataset
    from hsextract.export import EXPORTERS
    from hsextract.progress import ProgressDataset
    from hsextract.report.stats import chunk_stats
    from hsextract.report.validate import validate_shard
    from hsextract.shard import ShardWriter

    class Slow(ProgressDataset):  # an exporter's own writes, slowed to a consumer that falls behind the read-ahead
        def __iter__(self):
            for s in super().__iter__():
                yield s
                time.sleep(consume_s)

    if path.startswith("write"):
        threads = int(path.partition("-t")[2] or 1)
        meta = placeholder_metadata(H, [2, 30, 58], final_state="pre_norm", vocab_size=163840)
        before, t0 = rss(), time.time()
        with ShardWriter(shard, meta, threads=threads) as w:
            for i in range(samples):
                w.add(*sample(seq, i), sample_id=f"s{i}")  # the writer holds the only reference once add() returns
    else:
        before, t0 = rss(), time.time()
        ds = HiddenStateDataset([shard])
        if path == "read":
            for i in range(len(ds)):
                s = ds[i]
                del s
        elif path == "iter":
            for _ in ds:
                time.sleep(consume_s)
        elif path == "validate":
            assert validate_shard(shard, REFERENCE)["passed"]
        elif path == "stats":
            chunk_stats(shard)
        else:
            with tempfile.TemporaryDirectory(dir=shard.parent) as out:
                EXPORTERS[path](Slow(ds, path), Path(out))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"extra": peak - before, "seconds": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--consume-s", type=float, default=0.5)
    p.add_argument("--dir", default=None, help="where the shard goes (about 0.7 x seq x samples x 57 KB)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, Path(a.dir) / "m.hss", a.seq, a.samples, a.consume_s)))
        return
    raw = a.seq * (16 + TENSORS * H * 2)
    print(f"hidden {H}, {TENSORS} bf16 tensors, {a.samples} samples of {a.seq} tokens: {raw / 1e6:,.0f} MB raw each")
    print("| path | peak over start, MB | samples' worth (/ raw sample) | seconds |\n|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        paths = a.paths.split(",")
        for path in (["write"] if "write" not in paths else []) + paths:  # the shard first, measured or not
            out = subprocess.run([sys.executable, __file__, "--one", path, "--dir", d, "--seq", str(a.seq),
                                  "--samples", str(a.samples), "--consume-s", str(a.consume_s)],
                                 check=True, capture_output=True, text=True)
            r = json.loads(out.stdout.splitlines()[-1])
            if path in paths:
                print(f"| {path} | {r['extra'] / 1e6:,.0f} | {r['extra'] / raw:.2f} | {r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
