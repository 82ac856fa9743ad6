"""Shared prefixes on the CPU (issue 37, docs/SHARED_PREFIX.md section 9): agentic data, flat against shared.
One script, over 400 lines: its data, both runs and its tables, to rerun as one command.

    PYTHONPATH=src python bench/shared_prefix.py [--conversations 200] [--min-turns 8] [--max-turns 30]
        [--tool-tokens 2000] [--prompts-per-chunk 50] [--check-full 8] [--no-flat-extract] [--out DIR] [--json]

Synthetic agentic conversations written here (seeded): a tool declaration of about `--tool-tokens` tokens and a
system prompt open every one; each of its 8-30 turns is a user request, an assistant message with reasoning and a
tool call, the tool's result, and an assistant answer with reasoning. They are rendered with the Kimi-K2.5-shaped
template of the tiny model (`make_tiny_model(tokenizer="kimi")`, 4 layers, hidden 128), which drops earlier turns'
reasoning, so `split_turns: auto` makes one sample per turn. Then prepare + extract (transformers engine, CPU) +
read, with `share_prefixes` off and on, and it reports:

- tokens: materialized (flat: stored and computed), distinct (prepare's count: each shared prefix once), and the
  shared run's stored and computed tokens, each against the distinct count (the limit: within 10%);
- bytes per stored token, flat and shared (the codec on the rows that are stored: no worse than flat);
- per conversation, stored tokens against turns: the log-log slope (2: quadratic, 1: linear);
- every sample of the shared run against the flat run's: ids and mask equal, hidden rows bit-equal or within the
  dense bound (1e-2 relative);
- CPU seconds of prepare, extract and a read of every sample (ds[i] in order, and the family stream), per mode.

`run(...)` returns the figures as a dict (tests/test_bench_shared_prefix.py runs a tiny version).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import struct
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
CONVERSATIONS = ROOT / "data" / "conversations.jsonl"
MODEL = {"num_hidden_layers": 4, "hidden_size": 128}
AUX = (1, 3)
TOL = 1e-2  # the dense per-sample bound (docs/SHARED_PREFIX.md, "Exactness")


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _words() -> list[str]:
    words = sorted({w.strip(".,!?\"'():;").lower() for line in CONVERSATIONS.read_text(encoding="utf-8").splitlines()
                    for m in json.loads(line)["messages"] for w in m["content"].split()} - {""})
    return words


def _text(rng: random.Random, words: list[str], n: int) -> str:
    return " ".join(rng.choice(words) for _ in range(n))


def tool_declaration(rng: random.Random, words: list[str], tokens: int, tokenizer: Any) -> list[dict[str, Any]]:
    """Function definitions whose JSON takes about `tokens` tokens."""
    tools: list[dict[str, Any]] = []
    while len(tokenizer.encode(json.dumps(tools))) < tokens:
        k = len(tools)
        tools.append({"type": "function", "function": {
            "name": f"tool_{k}_{rng.choice(words)}", "description": _text(rng, words, 30),
            "parameters": {"type": "object", "properties": {
                f"arg{j}": {"type": "string", "description": _text(rng, words, 8)} for j in range(3)},
                "required": ["arg0"]}}})
    return tools


def conversations(n: int, min_turns: int, max_turns: int, tool_tokens: int, tokenizer: Any,
                  seed: int = 0) -> list[dict[str, Any]]:
    """`n` agentic conversations (module docstring), every one opening with the same tools and system prompt."""
    rng = random.Random(seed)
    words = _words()
    tools = tool_declaration(rng, words, tool_tokens, tokenizer)
    system = {"role": "system", "content": "You are an agent. " + _text(rng, words, 40)}
    out = []
    for c in range(n):
        msgs = [system]
        for t in range(rng.randint(min_turns, max_turns)):
            name = tools[rng.randrange(len(tools))]["function"]["name"]
            call = f"call_{c}_{t}"
            msgs += [
                {"role": "user", "content": _text(rng, words, rng.randint(6, 16))},
                {"role": "assistant", "content": "", "reasoning_content": _text(rng, words, rng.randint(16, 32)),
                 "tool_calls": [{"type": "function", "id": call,
                                 "function": {"name": name, "arguments": {"arg0": _text(rng, words, 4)}}}]},
                {"role": "tool", "tool_call_id": call, "content": _text(rng, words, rng.randint(8, 20))},
                {"role": "assistant", "content": _text(rng, words, rng.randint(8, 16)),
                 "reasoning_content": _text(rng, words, rng.randint(12, 24))},
            ]
        out.append({"id": f"conv{c}", "messages": msgs, "tools": tools})
    return out


def _ids_mask_bytes(reader: Any) -> int:
    """Bytes of the input_ids and loss_mask frames (the first two of each record's frame table)."""
    from hsextract.shard import format as fmt

    at = fmt.RECORD.size + fmt.FRAME_COUNT.size  # then one u64 length per frame (docs/FORMAT.md)
    return sum(sum(struct.unpack_from("<2Q", reader._pread(at + 16, off), at)) for off in reader.index["offsets"])


def own_rows_as_v1(shards: list[Path], dst: Path) -> dict[str, float]:
    """The codec on the same rows: each sample's own rows of the shared shards (what version 2 stores) written by
    today's flat (version 1) writer at the workflow's level, so a difference is the format's, not the rows'
    (flat and shared store different rows: flat is mostly the repeated declaration)."""
    from hsextract.shard import ShardReader, ShardWriter

    dst.mkdir(parents=True, exist_ok=True)
    v1_bytes = v1_ids_mask = v2_bytes = v2_ids_mask = tokens = 0
    for k, src in enumerate(shards):
        r = ShardReader(src)
        path = dst / f"own-rows-{k:05d}.hss"
        meta = {key: v for key, v in r.metadata.items() if key not in ("format_version", "writer", "zstd_version")}
        with ShardWriter(path, meta, level=r.metadata["codec"]["level"]) as w:
            for i in range(len(r)):
                # the record alone: its own rows, no ancestor decoded only to be dropped
                x, n = r.own_rows(i), r.prefix_lens[i]
                w.add(x["input_ids"][n:], x["hidden_states"], x["loss_mask"][n:], r.sample_ids[i])
                tokens += len(x["input_ids"]) - n
        v1 = ShardReader(path)
        v1_bytes += path.stat().st_size
        v1_ids_mask += _ids_mask_bytes(v1)
        v2_bytes += src.stat().st_size
        v2_ids_mask += _ids_mask_bytes(r)
        v1.close()
        r.close()
        path.unlink()
    return {"tokens": tokens, "v1_hidden_bytes_per_token": (v1_bytes - v1_ids_mask) / tokens,
            "v2_hidden_bytes_per_token": (v2_bytes - v2_ids_mask) / tokens}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _full_forward(model: Path, prompts: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each prompt alone, whole, straight through transformers (no hsextract code): the stored tensors."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            hs = m(ids[None], output_hidden_states=True, use_cache=False).hidden_states
            # the last two: the final norm's output, and the layer above the first aux one (the control)
            out.append([hs[i][0] for i in AUX] + [hs[-1][0], hs[AUX[0] + 1][0]])
    return out


def compare(fig: dict[str, Any], model: Path, readers: dict[str, list[Any]], check_full: int) -> None:
    """Each shared sample against the flat run's, and the `check_full` furthest apart against an independent full
    forward; into `fig`."""
    worst = [0.0] * (len(AUX) + 1)  # per stored tensor: hidden_states[1], [3], the final post-norm state
    identical = 0
    errors = []
    for i, (a, b) in enumerate(zip(readers["flat"], readers["shared"], strict=True)):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        rel = [_rel(y, x) for x, y in zip(a["hidden_states"], b["hidden_states"], strict=True)]
        identical += max(rel) == 0.0
        worst = [max(w, r) for w, r in zip(worst, rel, strict=True)]
        errors.append((max(rel), i))
    fig["samples_bit_identical"] = identical
    fig["worst_relative_error"] = worst
    fig["tensors"] = [f"hidden_states[{i}]" for i in AUX] + ["final post_norm"]
    full = _full_forward(model, [readers["flat"][i]["input_ids"] for _, i in sorted(errors)[-check_full:]])
    fig["checked_full"] = len(full)
    fig["against_full_forward"] = {mode: [0.0] * (len(AUX) + 1) for mode in ("flat", "shared")}
    fig["one_layer_shift"] = float("inf")  # the least distance to the wrong layer: what the bound must stay below
    for (_, i), want in zip(sorted(errors)[-check_full:], full, strict=True):
        for mode in ("flat", "shared"):
            got = readers[mode][i]["hidden_states"]
            fig["against_full_forward"][mode] = [max(w, _rel(g, t)) for w, g, t in
                                                 zip(fig["against_full_forward"][mode], got, want[:-1], strict=True)]
            fig["one_layer_shift"] = min(fig["one_layer_shift"], _rel(got[0], want[-1]))


def run(out: Path, *, conversations_n: int, min_turns: int, max_turns: int, tool_tokens: int,
        prompts_per_chunk: int, seed: int = 0, token_budget: int = 8192, check_full: int = 8,
        flat_extract: bool = True) -> dict[str, Any]:
    """The figures of the module docstring. `flat_extract` False: the flat run is prepared only (its stored and
    computed tokens are then its materialized tokens, which is what the flat writer and engine do; the test of
    this script checks both modes give the same counts) and the two runs' samples are not compared, so the
    issue's size takes minutes of CPU instead of days."""
    from hsextract import open_dataset
    from hsextract.config.settings import from_config
    from hsextract.engines.base import CaptureSpec
    from hsextract.engines.transformers_engine import TransformersEngine
    from hsextract.extract.run import extract_chunk, read_prompts
    from hsextract.prepare.prefix_share import common_prefix
    from hsextract.prepare.run import chunk_name, load_tokenizer, num_chunks, run_prepare
    from hsextract.shard import ShardReader
    from hsextract.tinymodel.build import make_tiny_model

    model = out / "model"
    if not (model / "config.json").is_file():
        make_tiny_model(model, CONVERSATIONS, tokenizer="kimi", **MODEL)
    tok = load_tokenizer(str(model), trust_remote_code=True)
    data = out / "agentic.jsonl"
    convs = conversations(conversations_n, min_turns, max_turns, tool_tokens, tok, seed)
    data.write_text("".join(json.dumps(c) + "\n" for c in convs), encoding="utf-8")
    # sample ids are `agentic:<record>:t<turn>` (prepare, split_turns)
    turns = {f"agentic:{k}": sum(m["role"] == "user" for m in c["messages"]) for k, c in enumerate(convs)}

    fig: dict[str, Any] = {"conversations": conversations_n, "turns": [min_turns, max_turns],
                           "tool_tokens": len(tok.encode(json.dumps(convs[0]["tools"])))}
    meta = {"model": str(model), "engine": "transformers", "engine_version": "bench", "aux_layers": list(AUX),
            "layer_convention": "hidden_states", "final_state": "post_norm", "hidden_size": MODEL["hidden_size"],
            "dtype": "bfloat16", "config_hash": "bench", "tokenizer_hash": "bench", "chat_template_hash": "bench"}
    readers: dict[str, list[Any]] = {}
    with TransformersEngine(model, CaptureSpec(AUX, "post_norm"), token_budget=token_budget) as engine:
        for mode in ("flat", "shared"):
            cfg = from_config({"model": str(model), "sources": [{"path": str(data), "name": "agentic"}], "seed": seed,
                               "prompts_per_chunk": prompts_per_chunk, "split_turns": "auto",
                               "share_prefixes": mode == "shared", "trust_remote_code": True}).prepare
            n_chunks = num_chunks(cfg)
            t0 = cpu_seconds()
            summary = run_prepare(cfg, str(model), out / mode / "prompts", n_chunks)
            t1 = cpu_seconds()
            if mode == "flat" and not flat_extract:
                fig[mode] = _prepared_only(out / mode / "prompts", n_chunks, summary, t1 - t0)
                continue
            computed, shards = 0, []
            for k in range(n_chunks):
                prompts = read_prompts(out / mode / "prompts" / chunk_name(k))
                shard = out / mode / "shards" / f"chunk-{k:05d}.hss"
                shard.parent.mkdir(parents=True, exist_ok=True)
                computed += extract_chunk(prompts, shard, engine, meta | {"chunk": k}, progress=False)[
                    "computed_tokens"]
                shards.append(shard)
            t2 = cpu_seconds()
            ds = open_dataset(shards)
            if flat_extract:  # kept for compare()
                samples = [ds[i] for i in range(len(ds))]
                ids_all = [x["input_ids"] for x in samples]
            else:  # the issue's size: the samples together outgrow memory (25 M tokens: ~20 GB)
                samples = []
                ids_all = [ds[i]["input_ids"] for i in range(len(ds))]
            t3 = cpu_seconds()
            streamed = sum(1 for _ in ds.stream(seed=seed, group="family"))
            t4 = cpu_seconds()
            assert streamed == len(ds)
            rs = [ShardReader(s) for s in shards]
            if "opening_tokens" not in fig:  # the opening every sample shares: the tool declaration and system prompt
                first = ids_all[0].numpy()
                fig["opening_tokens"] = min((common_prefix(first, x.numpy()) for x in ids_all[1:]), default=0)
            ids_mask_bytes = sum(_ids_mask_bytes(r) for r in rs)
            per_conv: dict[str, int] = defaultdict(int)
            beyond: dict[str, int] = defaultdict(int)  # stored tokens past the shared opening
            for r in rs:
                for sid, n, k in zip(r.sample_ids, r.seq_lens, r.prefix_lens, strict=True):
                    c = _conversation(sid)
                    per_conv[c] += n - k
                    beyond[c] += n - max(k, fig["opening_tokens"])
            fig[mode] = {
                "samples": len(ds), "materialized_tokens": summary["tokens"],
                "distinct_tokens": summary.get("distinct_tokens"),
                "stored_tokens": sum(r.stored_tokens for r in rs), "computed_tokens": computed,
                "bytes": sum(s.stat().st_size for s in shards),
                "cpu_s": {"prepare": t1 - t0, "extract": t2 - t1, "read ds[i]": t3 - t2, "read stream": t4 - t3},
                "per_conversation": dict(per_conv),
                "per_conversation_beyond_opening": dict(beyond),
            }
            if mode == "shared" and not flat_extract:  # the flat run prepared only: each sample holds the opening
                fig["flat"]["per_conversation_beyond_opening"] = {
                    c: n - fig["flat"]["samples_of"][c] * fig["opening_tokens"]
                    for c, n in fig["flat"]["per_conversation"].items()}
            fig[mode]["bytes_per_stored_token"] = fig[mode]["bytes"] / fig[mode]["stored_tokens"]
            # the hidden rows' frames alone: the codec on what is stored once (ids and mask are stored whole)
            fig[mode]["ids_mask_bytes"] = ids_mask_bytes
            fig[mode]["hidden_bytes_per_stored_token"] = (fig[mode]["bytes"] - ids_mask_bytes) / fig[mode][
                "stored_tokens"]
            readers[mode] = samples
            if mode == "shared":
                fig[mode]["same_rows"] = own_rows_as_v1(shards, out / "own-rows")

    flat, shared = fig["flat"], fig["shared"]
    distinct = shared["distinct_tokens"]
    fig["distinct_tokens"] = distinct
    fig["turns_of"] = turns
    fig["stored_over_distinct"] = shared["stored_tokens"] / distinct
    fig["computed_over_distinct"] = shared["computed_tokens"] / distinct
    fig["flat_over_distinct"] = flat["stored_tokens"] / distinct
    # per conversation: stored tokens against turns, log-log slope by least squares
    ids = sorted(turns)
    x = np.log([turns[i] for i in ids])
    for mode in ("flat", "shared"):
        key = fig[mode]["per_conversation"]
        y = np.log([key[i] for i in ids])
        fig[mode]["slope"] = float(np.polyfit(x, y, 1)[0]) if len(set(x)) > 1 else float("nan")
        y = np.log([max(1, fig[mode]["per_conversation_beyond_opening"][i]) for i in ids])
        fig[mode]["slope_beyond_opening"] = float(np.polyfit(x, y, 1)[0]) if len(set(x)) > 1 else float("nan")
        by_turns: dict[int, list[int]] = defaultdict(list)
        for i in ids:
            by_turns[turns[i]].append(key[i])
        fig[mode]["by_turns"] = {t: float(np.mean(v)) for t, v in sorted(by_turns.items())}
        fig["conversations_by_turns"] = {t: len(v) for t, v in sorted(by_turns.items())}
    if flat_extract:
        compare(fig, model, readers, check_full)
    return fig


def _conversation(sample_id: str) -> str:
    """The conversation of a sample id (prepare names a conversation's per-turn samples `<id>:t<turn>`)."""
    return sample_id.rsplit(":t", 1)[0]


def _prepared_only(prompts: Path, n_chunks: int, summary: dict[str, Any], prepare_s: float) -> dict[str, Any]:
    """The flat run's figures from its prompts alone: every token stored and computed (no extract ran)."""
    import pyarrow.parquet as pq

    from hsextract.prepare.run import chunk_name

    per_conv: dict[str, int] = defaultdict(int)
    samples_of: dict[str, int] = defaultdict(int)
    for k in range(n_chunks):
        t = pq.read_table(prompts / chunk_name(k), columns=["sample_id", "num_tokens"]).to_pydict()
        for sid, n in zip(t["sample_id"], t["num_tokens"], strict=True):
            c = _conversation(sid)
            per_conv[c] += n
            samples_of[c] += 1
    tokens = summary["tokens"]
    return {"samples": sum(samples_of.values()), "materialized_tokens": tokens, "distinct_tokens": None,
            "stored_tokens": tokens, "computed_tokens": tokens,
            "cpu_s": {"prepare": prepare_s}, "per_conversation": dict(per_conv), "samples_of": dict(samples_of)}


def report(fig: dict[str, Any]) -> str:
    f, s, d = fig["flat"], fig["shared"], fig["distinct_tokens"]
    lines = [
        f"{fig['conversations']} conversations of {fig['turns'][0]}-{fig['turns'][1]} turns, a tool declaration of "
        f"{fig['tool_tokens']:,} tokens; {f['samples']:,} samples (one per assistant message)",
        "",
        "| | flat (share_prefixes off) | shared (on) | shared / distinct |",
        "|---|---|---|---|",
        f"| stored tokens | {f['stored_tokens']:,} | {s['stored_tokens']:,} | {s['stored_tokens'] / d:.3f} |",
        f"| computed tokens | {f['computed_tokens']:,} | {s['computed_tokens']:,} | {s['computed_tokens'] / d:.3f} |",
        f"| distinct tokens (prepare) | | {d:,} | 1 |",
        f"| materialized tokens (read) | {f['materialized_tokens']:,} | {s['materialized_tokens']:,} | "
        f"{s['materialized_tokens'] / d:.2f} |",
        f"| shard bytes | {_num(f.get('bytes'))} | {s['bytes']:,} | |",
        f"| bytes per stored token | {_num(f.get('bytes_per_stored_token'), '.1f')} | "
        f"{s['bytes_per_stored_token']:.1f} | |",
        f"| hidden-row bytes per stored token | {_num(f.get('hidden_bytes_per_stored_token'), '.1f')} | "
        f"{s['hidden_bytes_per_stored_token']:.1f} | |",
        f"| the same, on the shared run's own rows: written flat (version 1) / as stored (version 2) | "
        f"{s['same_rows']['v1_hidden_bytes_per_token']:.2f} | {s['same_rows']['v2_hidden_bytes_per_token']:.2f} | |",
        f"| stored tokens per conversation ~ turns^slope | {f['slope']:.2f} | {s['slope']:.2f} | |",
        f"| the same past the {fig['opening_tokens']:,}-token opening | {f['slope_beyond_opening']:.2f} | "
        f"{s['slope_beyond_opening']:.2f} | |",
    ]
    for stage in s["cpu_s"]:
        lines.append(f"| CPU s, {stage} | {_num(f['cpu_s'].get(stage), '.1f')} | {s['cpu_s'][stage]:.1f} | |")
    lines += ["", "| turns | conversations | stored tokens per conversation, flat | shared | flat / shared |",
              "|---|---|---|---|---|"]
    turns = fig["turns_of"]
    lo, hi = min(turns.values()), max(turns.values())
    width = max(1, math.ceil((hi - lo + 1) / 6))
    for a in range(lo, hi + 1, width):
        ids = [c for c, t in turns.items() if a <= t < a + width]
        if ids:
            mf = float(np.mean([f["per_conversation"][c] for c in ids]))
            ms = float(np.mean([s["per_conversation"][c] for c in ids]))
            span = f"{a}" if width == 1 else f"{a}-{min(a + width - 1, hi)}"
            lines.append(f"| {span} | {len(ids)} | {mf:,.0f} | {ms:,.0f} | {mf / ms:.2f} |")
    if "samples_bit_identical" not in fig:
        return "\n".join([*lines, "", "flat run prepared only (--no-flat-extract): its stored and computed tokens are "
                           "its materialized tokens; the samples of the two runs were not compared"])
    lines += ["", f"samples bit-identical to the flat run's: {fig['samples_bit_identical']} of {f['samples']}; "
                  "worst relative error of the others: " + ", ".join(
                      f"{e:.2e} at {n}" for n, e in zip(fig["tensors"], fig["worst_relative_error"], strict=True))
              + f" (bound {TOL})"]
    for mode in ("flat", "shared"):
        lines.append(f"{mode} run, the {fig['checked_full']} samples furthest from the other run's, against an "
                     "independent full forward: " + ", ".join(
                         f"{e:.2e} at {n}" for n, e in zip(fig["tensors"], fig["against_full_forward"][mode],
                                                           strict=True)))
    lines.append(f"control: {fig['tensors'][0]} against the layer above it, at least {fig['one_layer_shift']:.2e}")
    return "\n".join(lines)


def _num(x: float | None, spec: str = ",") -> str:
    return "not extracted" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--min-turns", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=30)
    ap.add_argument("--tool-tokens", type=int, default=2000)
    ap.add_argument("--prompts-per-chunk", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-full", type=int, default=8,
                    help="samples (those furthest apart between the runs) checked against an independent full forward")
    ap.add_argument("--out", type=Path, default=None, help="working folder (default: a temporary one)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--no-flat-extract", dest="flat_extract", action="store_false",
                    help="prepare the flat run only (run()'s flat_extract): the issue's size in minutes, not days")
    ap.add_argument("--same-rows", type=Path, metavar="SHARDS_DIR",
                    help="only the codec on the same rows (own_rows_as_v1) for the shared shards of an earlier run "
                         "(OUT/shared/shards)")
    args = ap.parse_args(argv)
    if args.same_rows:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(own_rows_as_v1(sorted(args.same_rows.glob("*.hss")), Path(tmp)), indent=1))
        return 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        fig = run(out, conversations_n=args.conversations, min_turns=args.min_turns, max_turns=args.max_turns,
                  tool_tokens=args.tool_tokens, prompts_per_chunk=args.prompts_per_chunk, seed=args.seed,
                  check_full=args.check_full, flat_extract=args.flat_extract)
    fig["wall_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps({k: v for k, v in fig.items()}, indent=1, default=str))
    else:
        print(report(fig))
        print(f"\nwall time {fig['wall_s']:.0f} s; torch threads {torch.get_num_threads()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
