"""CPU cost of the sglang client's dump collection (dumpfiles.collect), two piece layouts side by side.

`one wide block`: each piece holds one [rows, (K+1)*H] block, as the plugin wrote before 2026-12-02; the
collector copies every tensor's columns out of it. `block per tensor`: K+1 [rows, H] blocks, as the plugin
writes now; a one-piece dump's blocks are used as read. Pieces are written to /dev/shm first (not timed),
then collected (read, check, assemble, delete); MB are raw hidden-state bytes per second of process CPU time.

    PYTHONPATH=src python bench/collect_cpu.py [--hidden 4096] [--tokens 512 2048] [--n 24]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from hsextract.sglang_plugin import dumpfiles


def measure(layout: str, tokens: int, hidden: int, n: int, reps: int = 3) -> float:
    k1 = 4
    ids = list(range(tokens))
    rows = torch.randn(tokens, k1 * hidden).to(torch.bfloat16)
    blocks = [rows] if layout == "one wide block" else [rows[:, i * hidden:(i + 1) * hidden].contiguous() for i in range(k1)]
    cpu = 0.0
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        d = Path(tmp)
        for rep in range(reps):
            for r in range(n):
                rid = f"hsx-{rep}-{r}"
                dumpfiles.write_piece(d, rid, 0, tokens, tokens, blocks)
                dumpfiles.write_done(d, rid, {"n_tokens": tokens, "pieces": [[0, tokens]],
                                              "ids_sha256": dumpfiles.ids_digest(ids)})
            c0 = time.process_time()
            out = [dumpfiles.collect(d, f"hsx-{rep}-{r}", ids, k1, 5.0).hidden_states for r in range(n)]
            cpu += time.process_time() - c0
            if not all(torch.equal(o[2], rows[:, 2 * hidden:3 * hidden]) for o in out):
                raise SystemExit(f"{layout}: collected tensors differ from what was written")
            del out
    return reps * n * tokens * k1 * hidden * 2 / 1e6 / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--n", type=int, default=24)
    a = ap.parse_args()
    print("| tokens per request | one wide block, MB/s per core | block per tensor, MB/s per core | ratio |")
    print("|---|---|---|---|")
    for t in a.tokens:
        old, new = measure("one wide block", t, a.hidden, a.n), measure("block per tensor", t, a.hidden, a.n)
        print(f"| {t} | {old:,.0f} | {new:,.0f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
