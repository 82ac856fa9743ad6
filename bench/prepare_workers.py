"""prepare with worker processes against one process, side by side in one run, on agentic data.

    PYTHONPATH=src python bench/prepare_workers.py [--conversations 60] [--min-turns 8] [--max-turns 30]
        [--tool-tokens 2000] [--workers 2] [--out DIR] [--json]

The conversations of bench/shared_prefix.py (a tool declaration and system prompt open each; 8-30 turns of
reasoning and tool calls), rendered with the Kimi-K2.5-shaped template of the tiny model (`split_turns: auto`,
`share_prefixes: true`, as config/kimi.yaml). prepare runs with `workers=1` (the stage before this change), then
with `--workers`; it reports the wall seconds of each, their ratio, and checks that both wrote the same bytes
(every chunk, summary.json, token_freq.pt). The masks' cost grows with the square of a conversation's turns (each
turn is found by rendering the history before it), so long agentic conversations are where prepare takes seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_prefix import CONVERSATIONS, MODEL, conversations


def run(out: Path, *, conversations_n: int, min_turns: int, max_turns: int, tool_tokens: int,
        workers: int) -> dict[str, Any]:
    from hsextract.config.settings import from_config
    from hsextract.prepare.run import load_tokenizer, num_chunks, run_prepare
    from hsextract.tinymodel.build import make_tiny_model

    model = out / "model"
    if not (model / "config.json").is_file():
        make_tiny_model(model, CONVERSATIONS, tokenizer="kimi", **MODEL)
    tok = load_tokenizer(str(model), trust_remote_code=True)
    data = out / "agentic.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(conversations_n, min_turns, max_turns,
                                                                          tool_tokens, tok)), encoding="utf-8")
    cfg = from_config({"model": str(model), "sources": [{"path": str(data), "name": "agentic"}],
                       "prompts_per_chunk": 20, "split_turns": "auto", "share_prefixes": True,
                       "trust_remote_code": True}).prepare
    n = num_chunks(cfg)
    fig: dict[str, Any] = {"conversations": conversations_n, "turns": [min_turns, max_turns], "workers": workers,
                           "cpus": os.cpu_count()}
    for label, w in (("one", 1), ("workers", workers)):
        t0 = time.perf_counter()
        summary = run_prepare(cfg, str(model), out / label, n, workers=w)
        fig[f"{label}_s"] = round(time.perf_counter() - t0, 2)
    fig["samples"], fig["tokens"] = summary["kept"], summary["tokens"]
    fig["speedup"] = round(fig["one_s"] / fig["workers_s"], 2)
    names = sorted(p.name for p in (out / "one").iterdir())
    fig["same_bytes"] = names == sorted(p.name for p in (out / "workers").iterdir()) and all(
        (out / "one" / f).read_bytes() == (out / "workers" / f).read_bytes() for f in names)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=60)
    ap.add_argument("--min-turns", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=30)
    ap.add_argument("--tool-tokens", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=None, help="working folder (default: a temporary one)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = a.out or Path(tmp)
        fig = run(out, conversations_n=a.conversations, min_turns=a.min_turns, max_turns=a.max_turns,
                  tool_tokens=a.tool_tokens, workers=a.workers)
    if a.json:
        print(json.dumps(fig, indent=1))
    else:
        print(f"{fig['conversations']} conversations of {fig['turns'][0]}-{fig['turns'][1]} turns: "
              f"{fig['samples']} samples, {fig['tokens']:,} tokens; {fig['cpus']} CPUs")
        print(f"prepare, 1 process: {fig['one_s']} s; {fig['workers']} workers: {fig['workers_s']} s; "
              f"x{fig['speedup']}; same bytes: {fig['same_bytes']}")
    return 0 if fig["same_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
