"""One long sample through the transformers engine (the CPU, or --device cuda): in pieces (the engine's way past
ONE_FORWARD_TOKENS) against one forward (the baseline: what the engine did before), side by side, each in a process
of its own.

    PYTHONPATH=src python bench/long_sample.py [--tokens 16384] [--token-budget 1024] [--dir DIR] [--device cuda]

The model: bench/shared_prefix.py's tiny DeepseekV3 (4 layers, hidden 128, the Kimi tokenizer; built under --dir
if missing); the sample: --tokens random ids of its vocabulary; capture: its eagle3 layers and the post-norm state.
Reported: the extract's wall seconds, the process's peak RSS (ru_maxrss; with --device cuda the GPU's peak
allocation instead), and the pieces' largest relative error against the one forward (bf16: attention split
differently).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shared_prefix as sp  # the model's shape and corpus


def one(model: Path, tokens: int, budget: int, whole: bool, out: Path, device: str) -> dict[str, float]:
    from hsextract.engines import transformers_engine as te
    from hsextract.engines.base import CaptureSpec, Prompt

    if whole:
        te.ONE_FORWARD_TOKENS = tokens
    ids = torch.randint(300, 3800, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    with te.TransformersEngine(model, CaptureSpec(sp.AUX, "post_norm"), token_budget=budget, device=device) as eng:
        t0 = time.perf_counter()
        (got,) = list(eng.extract([Prompt(0, "long", ids)]))
        seconds = time.perf_counter() - t0
    torch.save(got.hidden_states, out)
    if device == "cuda":
        return {"seconds": seconds, "peak_mb": torch.cuda.max_memory_allocated() / 2**20}
    return {"seconds": seconds, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--token-budget", type=int, default=1024, help="the tiny default's (config/config.yaml)")
    p.add_argument("--dir", default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--one", choices=["pieces", "whole"], help=argparse.SUPPRESS)
    a = p.parse_args()
    work = Path(a.dir or tempfile.mkdtemp())
    model = work / "model"
    if a.one:
        print(json.dumps(one(model, a.tokens, a.token_budget, a.one == "whole", work / f"{a.one}.pt", a.device)))
        return
    if not (model / "config.json").is_file():
        from hsextract.tinymodel.build import make_tiny_model

        make_tiny_model(model, sp.CONVERSATIONS, tokenizer="kimi", **sp.MODEL)
    rows = {}
    for way in ("whole", "pieces"):
        r = subprocess.run([sys.executable, __file__, "--one", way, "--tokens", str(a.tokens), "--token-budget",
                            str(a.token_budget), "--dir", str(work), "--device", a.device],
                           check=True, capture_output=True, text=True)
        rows[way] = json.loads(r.stdout.splitlines()[-1])
    whole, pieces = (torch.load(work / f"{w}.pt", weights_only=True) for w in ("whole", "pieces"))
    err = max(((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in zip(pieces, whole, strict=True))
    peak = "peak GPU allocation, MB" if a.device == "cuda" else "peak RSS, MB"
    print(f"one sample of {a.tokens} tokens, token_budget {a.token_budget}, {a.device}\n"
          f"| way | seconds | {peak} |\n|---|---:|---:|")
    for way, label in (("whole", "one forward (before)"), ("pieces", "in pieces (now)")):
        print(f"| {label} | {rows[way]['seconds']:.1f} | {rows[way]['peak_mb']:,.0f} |")
    print(f"pieces / one forward: {rows['pieces']['seconds'] / rows['whole']['seconds']:.2f}x the time, "
          f"{rows['pieces']['peak_mb'] / rows['whole']['peak_mb']:.2f}x the memory; largest relative error {err:.2e}")


if __name__ == "__main__":
    main()
