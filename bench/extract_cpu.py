"""Overhead of the extract job on the CPU: a plain batched forward against our whole path.

    PYTHONPATH=src python bench/extract_cpu.py [--records 48] [--max-seq-len 1024] [--repeats 3] [--write-readme]

Same model (the workflow's tiny DeepseekV3, built if missing), same prompts (prepare of the shipped
conversations with the default config), same batches (the engine's token-budget batching):

- `plain forward`: `model.model(ids, attention_mask)` per batch; no hidden states kept, no hooks.
- `extract job`: `hsextract.extract.run.extract_chunk` with the TransformersEngine: forward with
  output_hidden_states and the final-norm hooks, per-sample slicing and copies, byte-plane zstd
  encoding, checksums, writing the shard, fsync and rename.

The two run alternately, `--repeats` times each; the table gives the best of each (the machine is
shared), as tokens per wall-clock second and per second of process CPU time, and ours / plain.
Target: ratio >= 0.85.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
MARK_START, MARK_END = "<!-- extract_cpu:start -->", "<!-- extract_cpu:end -->"


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{name}, {os.cpu_count()} logical cores visible, torch {torch.__version__} with {torch.get_num_threads()} "
        f"threads, Python {platform.python_version()}, load average {load:.1f} at start"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=48, help="conversations to prepare (default 48)")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the default extract job's)")
    ap.add_argument("--model", default=str(ROOT / "resources/tiny-model"))
    ap.add_argument("--write-readme", action="store_true", help="replace the extract_cpu section of bench/README.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from hsextract.config.settings import from_config
    from hsextract.engines.transformers_engine import TransformersEngine
    from hsextract.extract.run import capture_spec, extract_chunk, read_prompts, shard_metadata
    from hsextract.prepare.run import chunk_name, run_prepare

    config = yaml.safe_load((ROOT / "config/config.yaml").read_text(encoding="utf-8"))
    config["sources"][0].update(path=str(ROOT / config["sources"][0]["path"]), max_records=args.records)
    # flat: the baseline forwards every prompt whole (shared prefixes: bench/shared_prefix.py)
    config.update(prompts_per_chunk=args.records, max_seq_len=args.max_seq_len, model=args.model, share_prefixes=False)
    settings = from_config(config)
    if not Path(args.model, "config.json").is_file():
        from hsextract.tinymodel.build import make_tiny_model

        print(f"building the tiny model at {args.model}", file=sys.stderr)
        make_tiny_model(args.model, settings.prepare.sources[0].path, seed=settings.prepare.seed)

    with tempfile.TemporaryDirectory(prefix="hsx-bench-") as tmp:
        run_prepare(settings.prepare, args.model, tmp, 1)
        prompts = read_prompts(Path(tmp) / chunk_name(0))
        n_tokens = sum(len(x) for x in prompts.input_ids)
        spec = capture_spec(settings.extract)
        t = settings.extract.transformers
        engine = TransformersEngine(args.model, spec, device="cpu", dtype=t.dtype, token_budget=t.token_budget)
        meta = shard_metadata(settings.extract, engine, engine.hidden_size, 0)
        from hsextract.engines.base import Prompt

        items = [Prompt(i, s, list(ids))
                 for i, (s, ids) in enumerate(zip(prompts.sample_ids, prompts.input_ids, strict=True))]
        batches = list(engine._batches(items))  # the engine's own batching, so only capture/encode/write differ
        from transformers import AutoModelForCausalLM

        # a separate copy of the model, without the engine's hooks
        backbone = AutoModelForCausalLM.from_pretrained(args.model, dtype=engine.dtype).eval().model

        def plain() -> None:
            with torch.inference_mode():
                for batch in batches:
                    width = max(len(p.input_ids) for p in batch)
                    ids = torch.full((len(batch), width), engine.pad_id, dtype=torch.long)
                    mask = torch.zeros((len(batch), width), dtype=torch.long)
                    for r, p in enumerate(batch):
                        ids[r, : len(p.input_ids)] = torch.tensor(p.input_ids)
                        mask[r, : len(p.input_ids)] = 1
                    backbone(input_ids=ids, attention_mask=mask, use_cache=False)

        shard = Path(tmp) / "bench.hss"

        def ours() -> None:
            c = settings.extract.shard
            extract_chunk(prompts, shard, engine, meta, level=c.compression_level, threads=c.threads,
                          precision=c.precision, progress=False)

        plain()  # warm-up (allocator, kernels)
        best = {"plain forward": (float("inf"), float("inf")), "extract job": (float("inf"), float("inf"))}
        for _ in range(args.repeats):
            for name, fn in (("plain forward", plain), ("extract job", ours)):
                w0, c0 = time.perf_counter(), cpu_seconds()
                fn()
                w, c = time.perf_counter() - w0, cpu_seconds() - c0
                best[name] = (min(best[name][0], w), min(best[name][1], c))
        stored = shard.stat().st_size
        engine.close()

    pw, pc = best["plain forward"]
    ow, oc = best["extract job"]
    lines = [
        f"machine: {machine()}",
        "",
        f"{len(items)} samples, {n_tokens} tokens (tiny DeepseekV3: 10 layers, hidden 256, bf16), "
        f"{len(batches)} batches of at most {settings.extract.transformers.token_budget} tokens; "
        f"4 tensors per sample, shard {stored / 1e6:.1f} MB; best of {args.repeats}",
        "",
        "| path | tokens/s (wall) | tokens/s (per CPU second) | ratio wall | ratio CPU |",
        "|---|---|---|---|---|",
        f"| plain forward (no capture) | {n_tokens / pw:.0f} | {n_tokens / pc:.0f} | 1.00 | 1.00 |",
        f"| extract job (forward, capture, encode, write) | {n_tokens / ow:.0f} | {n_tokens / oc:.0f} "
        f"| {pw / ow:.2f} | {pc / oc:.2f} |",
    ]
    table = "\n".join(lines)
    print(table)
    if args.write_readme:
        readme = ROOT / "bench/README.md"
        text = readme.read_text(encoding="utf-8") if readme.exists() else "# Benchmarks\n"
        block = f"{MARK_START}\n{table}\n{MARK_END}"
        if MARK_START in text:
            text = re.sub(re.escape(MARK_START) + ".*?" + re.escape(MARK_END), lambda _: block, text, flags=re.S)
        else:
            text = text.rstrip("\n") + "\n\n" + SECTION_INTRO + "\n" + block + "\n"
        readme.write_text(text, encoding="utf-8")


SECTION_INTRO = """## extract_cpu

`PYTHONPATH=src python bench/extract_cpu.py --write-readme` runs the same prompts (prepare of the shipped
conversations, default config) through the workflow's tiny model twice, alternately: a plain batched
forward that keeps nothing, and the extract job's whole path (`hsextract.extract.run.extract_chunk`: forward
with captured layers, slicing, byte-plane zstd, checksums, shard write, fsync, rename), with the same
batches. Ratio = ours / plain in tokens per second; target >= 0.85. CPU only: absolute speeds on a
shared VM say little, the ratio is the figure.
"""


if __name__ == "__main__":
    main()
