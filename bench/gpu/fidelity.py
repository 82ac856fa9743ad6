"""Fidelity of the sglang engine against the transformers engine on the same GPU, weights and ids (one model).

Starts the patched server (hsextract.sglang.server, plugin capture), extracts N prompts with 64 in flight
(short and long ones; long ones are chunked by --chunked-prefill-size), extracts a few again one at a
time (batch invariance), writes a shard and reads it back, stops the server. The reference is this
project's `TransformersEngine` with token_budget 1, so every prompt runs alone (a batch of one is
bit-identical to a plain transformers forward on the CPU, tests/test_transformers_engine.py); a plain
transformers forward of the first prompts is compared with it as a cross-check (reported, not a check).

Statistics and checks: hsextract.fidelity (per sample and per token; `--checks auto` picks the per-token
checks for MoE models, the per-sample ones for dense models), with the shard round trip exact and the shard
validating against the speculators v1 reference sample added here.
Results: OUT/fidelity-<name>.json and .md (written even when a stage fails: "error" says which).

CPU dry run without SGLang (the candidate is the transformers engine batched with padding, which is
also how the provisional flip bound was sized on the CPU):
    HSX_DEVICE=cpu PYTHONPATH=src python bench/gpu/fidelity.py --candidate transformers-batched \\
        --model DIR --name x --aux 1 3 5 --state /tmp/s --out /tmp/o --n 16
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from hsextract.engines.base import Captured, CaptureSpec, Prompt
from hsextract.fidelity import FLIP, evaluate, is_moe, neighbours, num_layers_of, rel

def make_prompts(n: int, vocab: int, seed: int) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(400, 900, (1,), generator=g)) if i % 4 == 3 else int(torch.randint(3, 200, (1,), generator=g))
        out.append(Prompt(i, f"{i:04d}", torch.randint(0, vocab, (L,), generator=g).tolist()))
    return out


def engine_reference(model_dir: str, prompts: list[Prompt], aux: tuple[int, ...], device: str) -> tuple[list[dict], str]:
    """The transformers engine, one prompt per forward: aux, neighbouring layers, pre- and post-norm final."""
    from hsextract.engines.transformers_engine import TransformersEngine

    L = num_layers_of(model_dir)
    nb = neighbours(aux, L)
    ids = sorted(set(aux) | set(nb) | {L - 1})  # id L-1: the last layer's own output = the pre-norm state
    eng = TransformersEngine(model_dir, CaptureSpec(aux_layers=tuple(ids), final_state="post_norm"), device=device,
                             token_budget=1, max_batch=1)
    refs = []
    try:
        for c in eng.extract(prompts):
            t = dict(zip(ids, c.hidden_states[:-1]))
            refs.append({"aux": [t[a] for a in aux], "wrong": [t[b] for b in nb], "pre": t[L - 1],
                         "post": c.hidden_states[-1]})
        version = eng.version()
    finally:
        eng.close()
        del eng
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return refs, version


def direct_hf(model_dir: str, prompts: list[Prompt], aux: tuple[int, ...], device: str) -> list[dict]:
    """A plain transformers forward (no engine), for the cross-check of the reference."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    cap: dict[str, torch.Tensor] = {}
    h = m.model.norm.register_forward_hook(lambda mod, i, o: cap.update(post=o))
    out_refs = []
    with torch.no_grad():
        for p in prompts:
            out = m(torch.tensor([p.input_ids], device=device), output_hidden_states=True, use_cache=False)
            out_refs.append({"aux": [out.hidden_states[a + 1][0].cpu() for a in aux], "post": cap["post"][0].cpu()})
    h.remove()
    del m
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out_refs


def sglang_candidate(a: argparse.Namespace, prompts: list[Prompt], spec: CaptureSpec, res: dict,
                     out: Path) -> tuple[list[Captured], list[Captured]]:
    from hsextract.sglang.client import SGLangEngine
    from hsextract.sglang.server import ServerConfig, ensure_server, stop_servers

    cfg = ServerConfig(model=a.model, aux_layers=spec.aux_layers, python=sys.executable, port=a.port,
                       chunked_prefill_size=a.chunked_prefill_size, capture="plugin",
                       launch_args=tuple(shlex.split(a.sgl_args)), run_name=a.name,
                       startup_timeout_s=a.startup_timeout, prefill_cuda_graph=a.prefill_cuda_graph)
    t0 = time.monotonic()
    h = None
    try:
        h = ensure_server(a.state, cfg)
        res["startup_s"] = round(time.monotonic() - t0, 1)
        print(f"[{a.name}] server up in {res['startup_s']} s", flush=True)
        eng = SGLangEngine(h, spec, concurrency=64, timeout_s=60, retries=1, run_name=a.name)
        res["engine_version"] = eng.version()
        res["plugin_marker"] = eng.plugin_info()
        t1 = time.monotonic()
        got = list(eng.extract(prompts))
        res["extract_s"] = round(time.monotonic() - t1, 2)
        alone = list(SGLangEngine(h, spec, concurrency=1, timeout_s=60, retries=1, run_name=a.name + "-alone")
                     .extract(prompts[: a.alone]))
        return got, alone
    finally:
        if h is not None:
            stats = sorted(h.dump_dir.glob("stats-*.json"))
            res["writer_stats"] = json.loads(stats[0].read_text()) if stats else None
            for f in [*stats, *h.dump_dir.glob("plugin-*.json")]:
                shutil.copyfile(f, out / f"{a.name}-{f.name}")
        stop_servers(a.state, grace_s=10)


def batched_candidate(a: argparse.Namespace, prompts: list[Prompt], spec: CaptureSpec, res: dict,
                      device: str) -> tuple[list[Captured], list[Captured]]:
    """CPU dry run / bound sizing: the transformers engine batched with right padding, and alone."""
    from hsextract.engines.transformers_engine import TransformersEngine

    t0 = time.monotonic()
    with TransformersEngine(a.model, spec, device=device, token_budget=8192, max_batch=64) as eng:
        got = list(eng.extract(prompts))
        res["engine_version"] = "candidate " + eng.version() + " batched (token_budget 8192)"
    with TransformersEngine(a.model, spec, device=device, token_budget=1, max_batch=1) as eng:
        alone = list(eng.extract(prompts[: a.alone]))
    res["extract_s"] = round(time.monotonic() - t0, 2)
    return got, alone


def shard_roundtrip(a: argparse.Namespace, prompts: list[Prompt], got: list[Captured], aux: tuple[int, ...],
                    res: dict, out: Path) -> None:
    try:
        from hsextract.shard import ShardReader, ShardWriter, placeholder_metadata

        shard = out / f"{a.name}.hss"
        H = got[0].hidden_states[0].shape[1]
        meta = placeholder_metadata(H, aux, model=a.name, engine="sglang",
                                    engine_version=res.get("engine_version", "?"))
        with ShardWriter(shard, metadata=meta, level=3, threads=4) as w:
            for p, c in zip(prompts, got):
                ids = torch.tensor(p.input_ids)
                w.add(input_ids=ids, hidden_states=c.hidden_states, loss_mask=torch.ones_like(ids), sample_id=p.sample_id)
        r = ShardReader(shard)
        res["shard_roundtrip_exact"] = all(
            all(torch.equal(x, y) for x, y in zip(r[i]["hidden_states"], got[i].hidden_states)) for i in range(len(r)))
        res["shard_bytes"] = shard.stat().st_size
        # what `hsextract validate --reference` says of it (the speculators v1 reference sample in resources/)
        from hsextract.validate import failure_line, validate_shard

        vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
        rep = validate_shard(shard, Path(__file__).resolve().parents[2] / "resources" / "reference" /
                             "speculators-v1-data_0.pt", vocab_size=vocab)
        res["shard_validate_passed"] = rep["passed"]
        res["shard_validate_failure"] = failure_line(rep)
        shard.unlink()
    except Exception as e:  # report, do not hide the fidelity numbers
        res["shard_error"] = f"{type(e).__name__}: {e}"
        res["shard_roundtrip_exact"] = False


def markdown(name: str, res: dict) -> list[str]:
    ok = res.get("pass")
    lines = [f"### {name}: {'PASS' if ok else 'FAIL'} (checks: {res.get('check_mode')})", ""]
    if "error" in res:
        lines += [f"error: `{res['error']}`", ""]
    if "token" in res:
        t = res["token"]
        lines += ["| layer | token median | p90 | p99 | max | flipped (>0.1) | neighbour median | neighbour flipped | "
                  "worst sample |", "|---|---|---|---|---|---|---|---|---|"]
        for n, d in t["right"].items():
            nb = t["neighbouring_layer"].get(n)
            nbm = f"{nb['median']:.3f}" if nb else f"pre-norm {t['final_vs_pre_norm']['median']:.2f}"
            nbf = f"{nb['flipped_frac']:.1%}" if nb else "-"
            lines.append(f"| {n} | {d['median']:.2e} | {d['p90']:.2e} | {d['p99']:.2e} | {d['max']:.2f} | "
                         f"{d['flipped_frac']:.2%} | {nbm} | {nbf} | {res['max_rel'][n]:.2e} |")
        inv = t["batch_invariance"]
        lines += ["", f"64 in flight vs alone, per token: median {inv['median']:.2e}, p99 {inv['p99']:.2e}, "
                  f"flipped {inv['flipped_frac']:.2%}; per sample max {res['batch_invariance_max_rel']:.2e}", ""]
    lines += ["| quantity | value |", "|---|---|"]
    rows = {
        "min rel, neighbouring layer (per sample)": res.get("min_rel_wrong_layer"),
        "min rel, final vs pre-norm (per sample)": res.get("min_rel_final_vs_pre_norm"),
        "long prompts (chunked), max rel": res.get("long_samples_max_rel"),
        "reference vs plain transformers forward, max rel": res.get("reference_vs_direct_hf_max_rel"),
        "server start s": res.get("startup_s"), "extract s": res.get("extract_s"),
        **{f"check {k}": v for k, v in res.get("checks", {}).items()},
    }
    for k, v in rows.items():
        lines.append(f"| {k} | {f'{v:.3g}' if isinstance(v, float) else v} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    ap.add_argument("--tol", type=float, default=2e-2, help="per-sample bound (dense models)")
    ap.add_argument("--token-tol", type=float, default=2e-2, help="per-layer median token error bound")
    ap.add_argument("--flip-bound", type=float, default=0.05, help="PROVISIONAL max fraction of tokens with rel > 0.1")
    ap.add_argument("--checks", choices=["auto", "sample", "token"], default="auto")
    ap.add_argument("--candidate", choices=["sglang", "transformers-batched"], default="sglang")
    ap.add_argument("--direct-hf", type=int, default=8, help="prompts cross-checked against a plain HF forward")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--prefill-cuda-graph", action="store_true", help="prefills on SGLang's graphs (default eager)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = os.environ.get("HSX_DEVICE", "cuda")
    aux = tuple(a.aux)
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(a.n, vocab, seed=7)
    spec = CaptureSpec(aux_layers=aux)
    mode = a.checks if a.checks != "auto" else ("token" if is_moe(a.model) else "sample")
    res: dict = {"model": a.name, "aux_layers": list(aux), "n": a.n, "tol": a.tol, "token_tol": a.token_tol,
                 "flip_bound": a.flip_bound, "flip_bound_provisional": True, "flip_threshold": FLIP,
                 "check_mode": mode, "candidate": a.candidate, "chunked_prefill_size": a.chunked_prefill_size}
    stage = "candidate"

    def on_term(signum: int, frame: object) -> None:  # `timeout` on the device: still write the json
        raise RuntimeError(f"killed by signal {signum} (time budget of the device call)")

    signal.signal(signal.SIGTERM, on_term)
    try:
        if a.candidate == "sglang":
            got, alone = sglang_candidate(a, prompts, spec, res, out)
        else:
            got, alone = batched_candidate(a, prompts, spec, res, device)
        stage = "shard"
        shard_roundtrip(a, prompts, got, aux, res, out)
        stage = "reference"
        t0 = time.monotonic()
        refs, res["reference"] = engine_reference(a.model, prompts, aux, device)
        res["reference"] += " (TransformersEngine, token_budget 1: each prompt alone)"
        if a.direct_hf:
            direct = direct_hf(a.model, prompts[: a.direct_hf], aux, device)
            res["reference_vs_direct_hf_max_rel"] = max(
                rel(x, y) for r, d in zip(refs, direct) for x, y in zip(r["aux"] + [r["post"]], d["aux"] + [d["post"]]))
            res["reference_vs_direct_hf_bitwise"] = all(
                torch.equal(x, y) for r, d in zip(refs, direct) for x, y in zip(r["aux"] + [r["post"]], d["aux"] + [d["post"]]))
        res["reference_s"] = round(time.monotonic() - t0, 1)
        stage = "evaluate"
        res.update(evaluate(prompts, got, alone, refs, aux, tol=a.tol, token_tol=a.token_tol,
                            flip_bound=a.flip_bound, mode=mode, long_from=a.chunked_prefill_size))
        res["checks"]["shard_roundtrip"] = res.get("shard_roundtrip_exact", False)
        res["checks"]["shard_validates"] = res.get("shard_validate_passed", False)
        res["pass"] = all(res["checks"].values())
    except Exception as e:
        res["error"] = f"{stage}: {type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        res["pass"] = False
        print(res["traceback"], file=sys.stderr, flush=True)
    (out / f"fidelity-{a.name}.json").write_text(json.dumps(res, indent=1, default=str))
    lines = markdown(a.name, res)
    (out / f"fidelity-{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
