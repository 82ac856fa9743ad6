"""The plugin's side-stream copies on a real GPU: right bytes, and what they save per batch.

Checks (exit 1 if one fails), each through `DumpWriter` as the plugin drives it:
  * the rows written equal the rows captured, although the forward's stream overwrites the captured
    buffer right after `submit` (as the next CUDA graph replay does) and was still busy when `submit`
    was called; with the copy stream on, off, and on with the clone failing for lack of memory (fallback);
  * time per batch of a stand-in forward (bf16 matmuls of about a prefill's length) followed by the dump
    of a 16 x 512-token Llama-3-8B batch (4 tensors of [8192, 4096] bf16 = 268 MB), copy stream on vs off,
    alternated.
    python3 bench/gpu/check_copy_stream.py --out $OUT/copy_stream.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from hsextract.sglang_plugin import dumpfiles
from hsextract.sglang_plugin.slicing import PieceSlice
from hsextract.sglang_plugin.staging import StagingRing
from hsextract.sglang_plugin.writer import DumpWriter


def columns(src: torch.Tensor, h: int) -> list[torch.Tensor]:
    return [src[:, j : j + h] for j in range(0, src.shape[1], h)]  # as Dumper._sources hands them over


def clear(dump: Path) -> None:
    for p in dump.iterdir():
        p.unlink()


def busy(a: torch.Tensor, n: int) -> None:
    for _ in range(n):
        a = a @ a
        a = a / a.norm()


def check_bytes(copy_stream: bool, oom: bool, dump: Path) -> str | None:
    torch.manual_seed(0)
    t, h, k = 1000, 256, 4
    ref = torch.randn(t, k * h, dtype=torch.bfloat16)
    src = torch.empty(t, k * h, dtype=torch.bfloat16, device="cuda")
    w = DumpWriter(dump, StagingRing(64 << 20, pin=True), threads=2, copy_stream=copy_stream)
    real_clone = torch.Tensor.clone
    if oom:
        def no_memory(self, *a, **kw):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        torch.Tensor.clone = no_memory
    try:
        busy(torch.randn(2048, 2048, device="cuda"), 50)  # the forward still runs when submit comes
        src.copy_(ref, non_blocking=True)
        pieces = [PieceSlice(f"hsx-{i}", 100, 0, 100, i * 100, list(range(100))) for i in range(10)]
        w.submit(pieces, columns(src, h))
    finally:
        torch.Tensor.clone = real_clone
    src.zero_()  # the next forward overwrites the captured buffer
    junk = [torch.full((t, k * h), 7.0, dtype=torch.bfloat16, device="cuda") for _ in range(8)]  # reuse bait
    del junk
    w.flush(timeout_s=60)
    fallbacks = w.copy_fallbacks
    w.close()
    if fallbacks != (1 if oom and copy_stream else 0):
        return f"copy_fallbacks {fallbacks}"
    for i in range(10):
        _, blocks = dumpfiles.read_piece(dump / dumpfiles.piece_name(f"hsx-{i}", 0, 100))
        got = torch.cat(blocks, dim=1)
        if not torch.equal(got, ref[i * 100 : (i + 1) * 100]):
            return f"hsx-{i}: rows differ from the captured ones"
    return None


def timing(copy_stream: bool, dump: Path, batches: int, matmuls: int) -> float:
    t, h, k = 8192, 4096, 4
    src = torch.randn(t, k * h, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    w = DumpWriter(dump, StagingRing(4096 << 20, pin=True), threads=4, copy_stream=copy_stream)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in range(batches):
        busy(x, matmuls)
        src.add_(1)  # the forward writes its output buffer
        w.submit([PieceSlice(f"hsx-b{b}-{i}", 512, 0, 512, i * 512, [0] * 512) for i in range(16)],
                 columns(src, h))
    torch.cuda.synchronize()  # the GPU's time: forwards plus whatever copies sat between them
    wall = time.perf_counter() - t0
    w.close()
    clear(dump)
    return wall / batches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--matmuls", type=int, default=600, help="stand-in forward length (4096^2 bf16 matmuls)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "checks": {}, "ms_per_batch": {"on": [], "off": []}}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        dump = Path(d)
        for name, cs, oom in (("on", True, False), ("off", False, False), ("on, clone fails", True, True)):
            res["checks"][name] = check_bytes(cs, oom, dump) or "ok"
            clear(dump)
        timing(True, dump, 2, a.matmuls)  # warm-up: kernels, pinned allocation
        for _ in range(a.repeats):
            for key, cs in (("off", False), ("on", True)):
                res["ms_per_batch"][key].append(round(timing(cs, dump, a.batches, a.matmuls) * 1e3, 2))
    x = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    busy(x, a.matmuls)
    torch.cuda.synchronize()
    res["forward_alone_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    a.out.write_text(json.dumps(res, indent=1), encoding="utf-8")
    print(json.dumps(res))
    return 0 if all(v == "ok" for v in res["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
