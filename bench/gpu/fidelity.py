"""Fidelity of the sglang engine against transformers on the same GPU, weights and ids (one model).

Starts the patched server (hsextract.server, plugin capture), extracts N prompts with 64 in flight
(short and long ones; long ones are chunked by --chunked-prefill-size), extracts a few again one at a
time (batch invariance), writes a shard and reads it back, stops the server, then runs the transformers
forward per prompt and compares per sample and layer: rel = |got - ref| / |ref| (float32). The right
layer must be <= --tol, the neighbouring layer must be far above it, and the final state must match the
post-norm output of the final norm (not its input). Results: OUT/fidelity-<name>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from hsextract.engines.base import CaptureSpec, Prompt
from hsextract.engines.sglang_engine import SGLangEngine
from hsextract.server import ServerConfig, ensure_server, stop_servers


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def make_prompts(n: int, vocab: int, seed: int) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(400, 900, (1,), generator=g)) if i % 4 == 3 else int(torch.randint(3, 200, (1,), generator=g))
        out.append(Prompt(i, f"{i:04d}", torch.randint(0, vocab, (L,), generator=g).tolist()))
    return out


def hf_reference(model_dir: str, prompts: list[Prompt], aux: tuple[int, ...]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    dev = os.environ.get("HSX_DEVICE", "cuda")
    m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).to(dev).eval()
    cap: dict[str, torch.Tensor] = {}
    m.model.norm.register_forward_hook(lambda mod, i, o: cap.update(pre=i[0], post=o))
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = m(torch.tensor([p.input_ids], device=dev), output_hidden_states=True, use_cache=False)
            hs = out.hidden_states
            refs.append({
                "aux": [hs[a + 1][0].cpu() for a in aux],
                "wrong": [hs[a + 2][0].cpu() for a in aux],  # the neighbouring layer
                "post": cap["post"][0].cpu(), "pre": cap["pre"][0].cpu(),
            })
    del m
    torch.cuda.empty_cache()
    return refs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--aux", type=int, nargs="+", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--alone", type=int, default=6)
    ap.add_argument("--chunked-prefill-size", type=int, default=128)
    ap.add_argument("--sgl-args", default="")
    ap.add_argument("--tol", type=float, default=2e-2)
    ap.add_argument("--startup-timeout", type=float, default=400)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    aux = tuple(a.aux)
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(a.n, vocab, seed=7)
    spec = CaptureSpec(aux_layers=aux)
    res: dict = {"model": a.name, "aux_layers": list(aux), "n": a.n, "tol": a.tol,
                 "chunked_prefill_size": a.chunked_prefill_size}
    cfg = ServerConfig(model=a.model, aux_layers=aux, python=sys.executable, port=a.port,
                       chunked_prefill_size=a.chunked_prefill_size, capture="plugin",
                       launch_args=tuple(shlex.split(a.sgl_args)), run_name=a.name,
                       startup_timeout_s=a.startup_timeout)
    t0 = time.monotonic()
    try:
        h = ensure_server(a.state, cfg)
        res["startup_s"] = round(time.monotonic() - t0, 1)
        eng = SGLangEngine(h, spec, concurrency=64, timeout_s=120, retries=1, run_name=a.name)
        res["engine_version"] = eng.version()
        res["plugin_marker"] = eng.plugin_info()
        t1 = time.monotonic()
        got = list(eng.extract(prompts))
        res["extract_s"] = round(time.monotonic() - t1, 2)
        alone = list(SGLangEngine(h, spec, concurrency=1, timeout_s=120, retries=1, run_name=a.name + "-alone")
                     .extract(prompts[: a.alone]))
        stats = sorted(h.dump_dir.glob("stats-*.json"))
        res["writer_stats"] = json.loads(stats[0].read_text()) if stats else None
    finally:
        stop_servers(a.state)
    # batch invariance: the same sample among 64 in flight vs alone
    res["batch_invariance_max_rel"] = max(rel(x, y) for g, s in zip(got, alone)
                                          for x, y in zip(g.hidden_states, s.hidden_states))
    # shard round trip
    try:
        from hsextract.shard import ShardReader, ShardWriter

        shard = out / f"{a.name}.hss"
        H = got[0].hidden_states[0].shape[1]
        meta = {"model": a.name, "engine": "sglang", "engine_version": res["engine_version"], "aux_layers": list(aux),
                "final_state": "post_norm", "hidden_size": H, "dtype": "bfloat16", "config_hash": "-",
                "tokenizer_hash": "-", "chat_template_hash": "-"}
        with ShardWriter(shard, metadata=meta, level=3, threads=4) as w:
            for p, c in zip(prompts, got):
                ids = torch.tensor(p.input_ids)
                w.add(input_ids=ids, hidden_states=c.hidden_states, loss_mask=torch.ones_like(ids), sample_id=p.sample_id)
        r = ShardReader(shard)
        res["shard_roundtrip_exact"] = all(
            all(torch.equal(x, y) for x, y in zip(r[i]["hidden_states"], got[i].hidden_states)) for i in range(len(r)))
        res["shard_bytes"] = shard.stat().st_size
        shard.unlink()
    except Exception as e:  # report, do not hide the fidelity numbers
        res["shard_error"] = f"{type(e).__name__}: {e}"
    refs = hf_reference(a.model, prompts, aux)
    per = []
    for p, g, ref in zip(prompts, got, refs):
        per.append({
            "sample": p.sample_id, "len": len(p.input_ids),
            "aux": [rel(g.hidden_states[j], ref["aux"][j]) for j in range(len(aux))],
            "aux_wrong_layer": [rel(g.hidden_states[j], ref["wrong"][j]) for j in range(len(aux))],
            "final_post_norm": rel(g.hidden_states[-1], ref["post"]),
            "final_vs_pre_norm": rel(g.hidden_states[-1], ref["pre"]),
        })
    res["per_sample"] = per
    worst = {f"aux{aux[j]}": max(s["aux"][j] for s in per) for j in range(len(aux))}
    worst["final_post_norm"] = max(s["final_post_norm"] for s in per)
    best_wrong = min(min(s["aux_wrong_layer"]) for s in per)
    best_pre = min(s["final_vs_pre_norm"] for s in per)
    res["max_rel"] = worst
    res["min_rel_wrong_layer"] = best_wrong
    res["min_rel_final_vs_pre_norm"] = best_pre
    res["long_samples_max_rel"] = max(max(s["aux"] + [s["final_post_norm"]]) for s in per if s["len"] > a.chunked_prefill_size)
    checks = {
        "right_layers_within_tol": all(v <= a.tol for v in worst.values()),
        "wrong_layer_far_above_tol": best_wrong > 10 * a.tol,
        "final_is_post_norm": best_pre > 10 * a.tol,
        "batch_invariant": res["batch_invariance_max_rel"] <= a.tol,
        "shard_roundtrip": res.get("shard_roundtrip_exact", False),
    }
    res["checks"] = checks
    res["pass"] = all(checks.values())
    (out / f"fidelity-{a.name}.json").write_text(json.dumps(res, indent=1))
    lines = [f"### {a.name}: {'PASS' if res['pass'] else 'FAIL'}", "", "| quantity | value |", "|---|---|"]
    for k, v in {**{f"max rel {k}": f"{v:.2e}" for k, v in worst.items()},
                 "min rel, neighbouring layer": f"{best_wrong:.3f}", "min rel, final vs pre-norm": f"{best_pre:.3f}",
                 "batch invariance (64 vs alone), max rel": f"{res['batch_invariance_max_rel']:.2e}",
                 f"long prompts (> {a.chunked_prefill_size} tok, chunked), max rel": f"{res['long_samples_max_rel']:.2e}",
                 "server start s": res.get("startup_s"), "extract s": res.get("extract_s"),
                 **{f"check {k}": v for k, v in checks.items()}}.items():
        lines.append(f"| {k} | {v} |")
    (out / f"fidelity-{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
