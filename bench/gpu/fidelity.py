"""Fidelity of the sglang engine against the transformers engine on the same GPU, weights and ids (one model).

Starts the patched server (hsextract.sglang.server, plugin capture) with final_state "both": every prefill stores
the aux layers, then the pre-norm state (the plugin's forward pre-hook on the final norm: hidden +
residual) and the post-norm state of the SAME forward. Extracts N prompts with 64 in flight (short and
long ones; long ones are chunked by --chunked-prefill-size), a few again one at a time (batch invariance),
stops the server. The reference is this project's `TransformersEngine` with token_budget 1 (every prompt
alone), final_state "both": the last decoder layer's output from a forward hook on that layer (not
hidden_states[-1], which transformers 5 replaces with the normed state) and the final norm's output. A plain
transformers forward of the first prompts (its own hooks) cross-checks the reference (reported).

Checks (hsextract.extract.fidelity.evaluate; `--checks auto`: per token for MoE models, per sample for dense ones,
and a routing-fixed twin is run with `--checks sample`): each captured final state against the reference's
same state, and against the other one (must be far: the models of mk_models.py get a non-trivial final-norm
weight so that they are); norm(captured pre) = captured post within 2^-7 per sample, with the final norm read
from the checkpoint (hsextract.extract.final_norm); flipped-token fractions compared exactly. Then the pre-norm
capture goes through a shard (final_state pre_norm, final norm recorded) and `hsextract export --format
specforge`, whose hidden_state must equal the captured post-norm state within 2^-7 per sample, and through
validation against the speculators v1 reference sample (3 aux layers only: it holds 4 tensors).
Results: OUT/fidelity-<name>.json and .md (written even when a stage fails: "error" says which).

CPU dry run without SGLang (the candidate is the transformers engine batched with padding): FID_DRY=1 in
bench/gpu/run_fidelity.sh, or
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

from hsextract.capture import PRESETS, preset_layers
from hsextract.config.model_info import read_model_shape
from hsextract.engines.base import Captured, CaptureSpec, Prompt
from hsextract.export.specforge import group_dir
from hsextract.extract.fidelity import (
    FLIP,
    FLIP_BOUND,
    NORM_TOL,
    evaluate,
    is_moe,
    neighbours,
    rel,
)
from hsextract.extract.final_norm import read_final_norm


def make_prompts(n: int, vocab: int, seed: int, max_len: int | None = None) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = (int(torch.randint(400, 900, (1,), generator=g)) if i % 4 == 3
             else int(torch.randint(3, 200, (1,), generator=g)))
        L = min(L, max_len or L)
        out.append(Prompt(i, f"{i:04d}", torch.randint(0, vocab, (L,), generator=g).tolist()))
    return out


def engine_reference(
    model_dir: str, prompts: list[Prompt], aux: tuple[int, ...], device: str
) -> tuple[list[dict], str]:
    """The transformers engine, one prompt per forward: aux, neighbouring layers, pre- and post-norm final."""
    from hsextract.engines.transformers_engine import TransformersEngine

    nb = neighbours(aux, read_model_shape(model_dir).num_layers)
    ids = sorted(set(aux) | set(nb))
    eng = TransformersEngine(model_dir, CaptureSpec(aux_layers=tuple(ids), final_state="both"), device=device,
                             token_budget=1, max_batch=1)
    refs = []
    try:
        for c in eng.extract(prompts):
            t = dict(zip(ids, c.hidden_states[:-2], strict=True))
            refs.append({"aux": [t[a] for a in aux], "wrong": [t[b] for b in nb], "pre": c.hidden_states[-2],
                         "post": c.hidden_states[-1]})
        version = eng.version()
    finally:
        eng.close()
        del eng
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return refs, version


def direct_hf(model_dir: str, prompts: list[Prompt], aux: tuple[int, ...], device: str) -> list[dict]:
    """A plain transformers forward (no engine): hooks on the last decoder layer (pre) and the final norm (post)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    cap: dict[str, torch.Tensor] = {}
    hooks = [m.model.layers[-1].register_forward_hook(
                 lambda mod, i, o: cap.update(pre=o[0] if isinstance(o, tuple) else o)),
             m.model.norm.register_forward_hook(lambda mod, i, o: cap.update(post=o))]
    out_refs = []
    with torch.no_grad():
        for p in prompts:
            out = m(torch.tensor([p.input_ids], device=device), output_hidden_states=True, use_cache=False)
            out_refs.append({"aux": [out.hidden_states[a][0].cpu() for a in aux], "pre": cap["pre"][0].cpu(),
                             "post": cap["post"][0].cpu()})
    for h in hooks:
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
                       chunked_prefill_size=a.chunked_prefill_size, capture="plugin", final_state=spec.final_state,
                       launch_args=tuple(shlex.split(a.sgl_args)), run_name=a.name, module=a.server_module,
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
            res["writer_stats"] = json.loads(stats[0].read_text(encoding="utf-8")) if stats else None
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


def shard_and_export(a: argparse.Namespace, prompts: list[Prompt], got: list[Captured], aux: tuple[int, ...],
                     res: dict, out: Path) -> None:
    """The pre-norm capture as the workflow stores it (a shard, final norm recorded), read back, and exported
    to SpecForge: its hidden_state (RMSNorm(pre) at export) against the captured post-norm state."""
    try:
        from hsextract.export import export
        from hsextract.extract.final_norm import final_norm_metadata
        from hsextract.shard import ShardReader, ShardWriter

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from shard_meta import placeholder_metadata  # bench/shard_meta.py

        k = len(aux)
        run = out / f"{a.name}-run"
        (run / "shards").mkdir(parents=True, exist_ok=True)
        shard = run / "shards" / "chunk-00000.hss"
        H = got[0].hidden_states[0].shape[1]
        norm, why = final_norm_metadata(a.model)
        res["final_norm_recorded"] = norm is not None or why
        meta = placeholder_metadata(H, aux, model=a.name, engine="sglang", final_state="pre_norm", final_norm=norm,
                                    engine_version=res.get("engine_version", "?"))
        with ShardWriter(shard, metadata=meta, level=3, threads=4) as w:
            for p, c in zip(prompts, got, strict=True):
                ids = torch.tensor(p.input_ids)
                w.add(input_ids=ids, hidden_states=c.hidden_states[: k + 1], loss_mask=torch.ones_like(ids),
                      sample_id=p.sample_id)
        r = ShardReader(shard)
        res["shard_roundtrip_exact"] = all(
            all(torch.equal(x, y) for x, y in zip(r[i]["hidden_states"], got[i].hidden_states[: k + 1], strict=True))
            for i in range(len(r)))
        res["shard_bytes"] = shard.stat().st_size
        summary = export(run / "shards", out / f"{a.name}-specforge", "specforge")
        res["specforge_final_norm_applied"] = summary["final_norm_applied"]
        worst = 0.0
        for i, c in enumerate(got):
            d = torch.load(out / f"{a.name}-specforge" / group_dir(i) / f"data_{i}.ckpt", weights_only=True)
            worst = max(worst, rel(d["hidden_state"][0], c.hidden_states[-1]))
        res["specforge_vs_post_norm_max_rel"] = worst
        shutil.rmtree(out / f"{a.name}-specforge")
        if k == 3:  # `hsextract validate --reference`: the shipped speculators v1 sample holds 3 aux + final
            from hsextract.report.validate import failure_line, validate_shard

            vocab = json.loads((Path(a.model) / "config.json").read_text(encoding="utf-8"))["vocab_size"]
            rep = validate_shard(shard, Path(__file__).resolve().parents[2] / "resources" / "reference" /
                                 "speculators-v1-data_0.pt", vocab_size=vocab)
            res["shard_validate_passed"] = rep["passed"]
            res["shard_validate_failure"] = failure_line(rep)
        shutil.rmtree(run)
    except Exception as e:  # noqa: BLE001 - reported; the fidelity numbers are kept
        res["shard_error"] = f"{type(e).__name__}: {e}"
        res["shard_roundtrip_exact"] = False


def markdown(name: str, res: dict) -> list[str]:
    ok = res.get("pass")
    lines = [f"### {name}: {'PASS' if ok else 'FAIL'} (checks: {res.get('check_mode')}, aux {res.get('aux_layers')})",
             ""]
    if "error" in res:
        lines += [f"error: `{res['error']}`", ""]
    failed = [k for k, v in res.get("checks", {}).items() if not v]
    if failed:
        lines += [f"failed checks: {', '.join(failed)}", ""]
    if "token" in res:
        t = res["token"]
        lines += ["| tensor | worst sample | token median | p90 | p99 | max | flipped (>0.1) | wrong: median | "
                  "wrong: min sample |", "|---|---|---|---|---|---|---|---|---|"]
        for n, d in t["right"].items():
            w = t["wrong"][n]
            lines.append(f"| {n} | {res['max_rel'][n]:.2e} | {d['median']:.2e} | {d['p90']:.2e} | {d['p99']:.2e} | "
                         f"{d['max']:.2f} | {d['flipped']}/{d['tokens']} | {w['median']:.3f} | "
                         f"{res['min_rel_wrong'][n]:.3f} |")
        inv = t["batch_invariance"]
        lines += ["", "wrong = the neighbouring layer for aux layers, the other final state for the final ones.",
                  f"64 in flight vs alone, per token: median {inv['median']:.2e}, p99 {inv['p99']:.2e}, "
                  f"flipped {inv['flipped']}/{inv['tokens']}; per sample max {res['batch_invariance_max_rel']:.2e}",
                  ""]
    lines += ["| quantity | value |", "|---|---|"]
    rows = {
        "reference pre vs post norm, min per sample (separation)": res.get("min_rel_ref_pre_vs_post"),
        "norm(captured pre) vs captured post, max per sample": res.get("max_norm_relation"),
        "specforge export (norm applied) vs captured post, max per sample": res.get("specforge_vs_post_norm_max_rel"),
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
    ap.add_argument("--aux", nargs="+", required=True,
                    help=f"layer ids, or one capture preset ({', '.join(p for p in PRESETS if p != 'custom')})")
    ap.add_argument("--state", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--alone", type=int, default=6)
    ap.add_argument("--max-len", type=int, default=None, help="cut prompts to this many tokens (CPU dry run)")
    ap.add_argument("--chunked-prefill-size", type=int, default=128)
    ap.add_argument("--sgl-args", default="")
    ap.add_argument("--tol", type=float, default=2e-2, help="per-sample bound (dense models)")
    ap.add_argument("--token-tol", type=float, default=2e-2, help="per-layer median token error bound")
    ap.add_argument("--flip-bound", default=FLIP_BOUND,
                    help="PROVISIONAL max fraction of tokens with rel > 0.1 (a decimal, compared exactly)")
    ap.add_argument("--checks", choices=["auto", "sample", "token"], default="auto")
    ap.add_argument("--candidate", choices=["sglang", "transformers-batched"], default="sglang")
    ap.add_argument("--server-module", default="sglang.launch_server",
                    help="fake_sglang (tests/) runs the sglang path's plumbing on a CPU; its states are not a model's")
    ap.add_argument("--direct-hf", type=int, default=8, help="prompts cross-checked against a plain HF forward")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--prefill-cuda-graph", action="store_true", help="prefills on SGLang's graphs (default eager)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = os.environ.get("HSX_DEVICE", "cuda")
    if len(a.aux) == 1 and a.aux[0] in PRESETS:
        aux = tuple(preset_layers(a.aux[0], read_model_shape(a.model).num_layers))
    else:
        aux = tuple(int(x) for x in a.aux)
    vocab = json.loads((Path(a.model) / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    prompts = make_prompts(a.n, vocab, seed=7, max_len=a.max_len)
    spec = CaptureSpec(aux_layers=aux, final_state="both")
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
        shard_and_export(a, prompts, got, aux, res, out)
        stage = "reference"
        t0 = time.monotonic()
        refs, res["reference"] = engine_reference(a.model, prompts, aux, device)
        res["reference"] += " (TransformersEngine, token_budget 1: each prompt alone)"
        if a.direct_hf:
            direct = direct_hf(a.model, prompts[: a.direct_hf], aux, device)
            pairs = [(x, y) for r, d in zip(refs, direct, strict=False)
                     for x, y in zip(r["aux"] + [r["pre"], r["post"]], d["aux"] + [d["pre"], d["post"]], strict=True)]
            res["reference_vs_direct_hf_max_rel"] = max(rel(x, y) for x, y in pairs)
            res["reference_vs_direct_hf_bitwise"] = all(torch.equal(x, y) for x, y in pairs)
        res["reference_s"] = round(time.monotonic() - t0, 1)
        stage = "evaluate"
        res.update(evaluate(prompts, got, alone, refs, aux, tol=a.tol, token_tol=a.token_tol,
                            flip_bound=a.flip_bound, mode=mode, long_from=a.chunked_prefill_size,
                            final_norm=read_final_norm(a.model)))
        res["checks"]["shard_roundtrip"] = res.get("shard_roundtrip_exact", False)
        res["checks"]["specforge_export_is_post_norm"] = bool(res.get("specforge_final_norm_applied")) and \
            res.get("specforge_vs_post_norm_max_rel", 1.0) <= NORM_TOL
        if len(aux) == 3:
            res["checks"]["shard_validates"] = res.get("shard_validate_passed", False)
        res["pass"] = all(res["checks"].values())
    except Exception as e:  # noqa: BLE001 - any failure is the result, written with its stage
        res["error"] = f"{stage}: {type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        res["pass"] = False
        print(res["traceback"], file=sys.stderr, flush=True)
    (out / f"fidelity-{a.name}.json").write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    lines = markdown(a.name, res)
    (out / f"fidelity-{a.name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines), flush=True)
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
