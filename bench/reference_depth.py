"""What a crafted chain of references costs a reader, before and after the depth bound (docs/SHARED_PREFIX.md,
"Depth"): shards of N one-row samples (16 hidden values, 4 tensors, the ids zeros: a few bytes each), every sample
taking all rows but one from the sample before it. Times a full pass, `reader[i]` for every i, which is what
validate and an epoch do.

- unbounded: one chain of N (written with the bound lifted, as a writer that does not check would)
- bounded: the worst a shard of N samples can now hold, chains of MAX_REFERENCE_DEPTH + 1 (depth 0 to 256)

The unbounded shard is refused at open since the bound; it is read here with the bound lifted, as before it.

    PYTHONPATH=src python bench/reference_depth.py --n 1000 2000 --out /tmp/depth.json
    PYTHONPATH=src python bench/reference_depth.py --n 10000 --bounded-only
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shard_meta import placeholder_metadata

from hsextract.shard import ShardReader, ShardWriter
from hsextract.shard import format as fmt


def write_chains(path: Path, n: int, chain: int) -> Path:
    """n samples in chains of `chain` (the first of each holds 2 rows, the others take all but one)."""
    ids = torch.zeros(chain + 1, dtype=torch.int64)
    meta = placeholder_metadata(16, [1, 2, 3])
    with ShardWriter(path, meta, share_prefixes=True) as w:
        for i in range(n):
            d = i % chain  # depth within its chain
            seq = d + 2
            hs = [torch.ones(2 if d == 0 else 1, 16, dtype=torch.bfloat16) for _ in range(4)]
            w.add(ids[:seq], hs, torch.ones(seq, dtype=torch.int64), sample_id=f"s{i}",
                  parent=i - 1 if d else None, prefix_len=seq - 1 if d else 0)
    return path


def full_pass(path: Path) -> dict[str, float]:
    r = ShardReader(path)
    t = time.perf_counter()
    rows = sum(r[i]["input_ids"].numel() for i in range(len(r)))
    s = time.perf_counter() - t
    return {"samples": len(r), "bytes": path.stat().st_size, "materialized_rows": rows, "pass_s": round(s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[1000, 2000])
    ap.add_argument("--bounded-only", action="store_true",
                    help="skip the unbounded chain (quadratic: an hour at 10,000)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    bound = fmt.MAX_REFERENCE_DEPTH
    out = {"max_reference_depth": bound, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.n:
            row: dict = {"n": n, "bounded": full_pass(write_chains(Path(tmp) / f"bounded-{n}.hss", n, bound + 1))}
            if not a.bounded_only:
                fmt.MAX_REFERENCE_DEPTH = n  # lifted: an unchecking writer, and the reader before the bound
                try:
                    row["unbounded"] = full_pass(write_chains(Path(tmp) / f"chain-{n}.hss", n, n))
                finally:
                    fmt.MAX_REFERENCE_DEPTH = bound
                row["ratio"] = round(row["unbounded"]["pass_s"] / max(row["bounded"]["pass_s"], 1e-9), 1)
            out["runs"].append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        a.out.write_text(json.dumps(out, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
