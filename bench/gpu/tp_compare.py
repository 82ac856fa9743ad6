"""Capture under tensor parallelism: TP=2 (and DP attention) against TP=1 of the same weights and ids (issue 9).

Two subcommands; the comparison logic is pure functions at the top (CPU-tested in tests/test_tp_compare.py):

  capture  start the patched server (hsextract.sglang.server, plugin capture) with --tp/--dp on the given GPUs,
           extract the prompts of fidelity.make_prompts (long ones chunked by --chunked-prefill-size)
           through SGLangEngine (retries 0: each prompt is sent exactly once), optionally the first K again
           one at a time, wait until the writer's stats file is current, read the plugin markers and
           stats files of the dump dir, stop the server. Writes RUN.safetensors (key "<sample>/<t>",
           t = tensor index, last = final post-norm state) and RUN.json (timings, writer check, error).
  compare  per sample and tensor: rel = |got-ref|/|ref| over [tokens, hidden]; per token (fidelity.token_rel
           pooled per tensor, fidelity.dist): median / p99 / flipped fraction. Checks ("sample" for dense
           models, "token" for MoE, as in fidelity.py; tol 2e-2):
             sample: every sample's rel <= tol per tensor;
             token:  per-tensor token median <= tol and flipped fraction (rel_t > 0.1) <= flip bound;
             both:   the wrong layer (got aux j vs ref aux j+1, cyclic) is far off: per sample > 10*tol;
                     every sample of the candidate is in the reference with the same token count.
           A tensor that fails with a norm ratio |got|/|ref| in [1/tp, 1/sqrt(tp)] is flagged as a PARTIAL SUM
           (the sglang#28343 failure: per-rank partial sums instead of the all-reduced activation).
           The writer checks of both runs (from their RUN.json) are part of the verdict.
Results: OUT/tp-<model>.json and .md; exit status 1 when anything fails.

CPU dry run of `capture` against tests/fake_sglang.py (real plugin code, fake model):
    PYTHONPATH=src:tests:bench/gpu python bench/gpu/tp_compare.py capture --module fake_sglang \\
        --model DIR_WITH_CONFIG_JSON --name x-tp1 --aux 2 4 6 --state /tmp/s --runs /tmp/r --n 8
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from hsextract.sglang_plugin import dumpfiles

from fidelity import FLIP, dist, make_prompts, rel, token_rel  # bench/gpu/fidelity.py: same statistics

TOL = 2e-2
FLIP_BOUND = 0.05  # as fidelity.py: provisional bound on the fraction of tokens with rel_t > FLIP (MoE)

def partial_sum_like(ratio: float, tp: int) -> bool:
    """|got|/|ref| of one rank's share of a sum over tp ranks: 1/tp when the shares are equal, about
    1/sqrt(tp) when they are independent; a failing tensor in (or near) that range is reported as such."""
    return tp > 1 and 1 / tp - 0.15 <= ratio <= 1 / tp**0.5 + 0.1


# ---- pure functions ----------------------------------------------------------------------------------
def tensor_names(aux: list[int] | tuple[int, ...]) -> list[str]:
    return [f"aux{a}" for a in aux] + ["final_post_norm"]


def norm_ratio(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(got.float().norm() / ref.float().norm().clamp_min(1e-12))


def compare_runs(ref: dict[str, list[torch.Tensor]], got: dict[str, list[torch.Tensor]], aux: list[int], *,
                 mode: str, tp: int, tol: float = TOL, flip_bound: float = FLIP_BOUND) -> dict:
    """Compare a candidate run with the reference run, sample by sample (dicts: sample id -> tensors).

    Each list holds len(aux) aux tensors then the final state, each [tokens, hidden]."""
    if mode not in ("sample", "token"):
        raise ValueError(f"mode {mode!r}: sample or token")
    names = tensor_names(aux)
    k = len(aux)
    res: dict = {"mode": mode, "tp": tp, "tol": tol, "flip_bound": flip_bound, "flip_threshold": FLIP,
                 "samples": len(got), "problems": []}
    missing = sorted(set(got) - set(ref))
    if missing:
        res["problems"].append(f"{len(missing)} candidate samples are not in the reference: {missing[:5]}")
    common = [s for s in got if s in ref]
    per = []
    tok: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for s in common:
        g, r = got[s], ref[s]
        if len(g) != k + 1 or len(r) != k + 1:
            res["problems"].append(f"sample {s}: {len(g)} / {len(r)} tensors, expected {k + 1}")
            continue
        if g[0].shape != r[0].shape:
            res["problems"].append(f"sample {s}: shape {tuple(g[0].shape)} vs reference {tuple(r[0].shape)}")
            continue
        row = {"sample": s, "tokens": int(g[0].shape[0]),
               "rel": {n: rel(g[i], r[i]) for i, n in enumerate(names)},
               # got aux j against ref aux j+1 (cyclic): the check has power only if this is far off
               "rel_wrong_layer": {names[j]: rel(g[j], r[(j + 1) % k]) for j in range(k)} if k > 1 else {}}
        per.append(row)
        for i, n in enumerate(names):
            tok[n].append(token_rel(g[i], r[i]))
            ratios[n].append(norm_ratio(g[i], r[i]))
    res["per_sample"] = per
    if not per:
        res["problems"].append("no sample to compare")
        res["checks"] = {"samples_match": False}
        res["pass"] = False
        return res
    res["max_rel"] = {n: max(p["rel"][n] for p in per) for n in names}
    res["min_rel_wrong_layer"] = min((v for p in per for v in p["rel_wrong_layer"].values()), default=None)
    res["token"] = {n: dist(torch.cat(tok[n])) for n in names}
    res["norm_ratio_median"] = {n: float(torch.tensor(ratios[n]).median()) for n in names}
    checks = {"samples_match": not res["problems"]}
    if mode == "sample":
        checks["every_sample_within_tol"] = all(v <= tol for v in res["max_rel"].values())
    else:
        checks["token_median_within_tol"] = all(d["median"] <= tol for d in res["token"].values())
        checks["flipped_fraction_small"] = all(d["flipped_frac"] <= flip_bound for d in res["token"].values())
    if res["min_rel_wrong_layer"] is not None:
        checks["wrong_layer_far_above_tol"] = res["min_rel_wrong_layer"] > 10 * tol
    failing = [n for n in names if (res["max_rel"][n] > tol if mode == "sample" else res["token"][n]["median"] > tol)]
    res["failing_tensors"] = failing
    res["partial_sum_suspected"] = [n for n in failing if partial_sum_like(res["norm_ratio_median"][n], tp)]
    res["checks"] = checks
    res["pass"] = all(checks.values())
    return res


def check_writers(markers: list[dict], stats: dict[int, dict], *, expected_requests: int, ranks: int,
                  dp_groups: int) -> dict:
    """Exactly one writer per DP group, and each request written once by one of them.

    markers: the plugin-<pid>.json files (one per scheduler process = GPU rank); stats: pid -> the
    stats-<pid>.json of that process (only a process whose writer ran has one)."""
    writers = sorted(int(m["pid"]) for m in markers if m.get("writer_rank"))
    others = sorted(int(m["pid"]) for m in markers if not m.get("writer_rank"))
    pids = {int(m["pid"]) for m in markers}
    done = {p: int(stats.get(p, {}).get("requests_done", 0)) for p in writers}
    res = {
        "ranks_seen": len(markers), "writer_pids": writers, "non_writer_pids": others,
        "requests_done_by_writer": {str(p): n for p, n in done.items()},
        "requests_done_total": sum(done.values()), "expected_requests": expected_requests,
        "stats_pids": sorted(stats),
    }
    checks = {
        "one_marker_per_rank": len(markers) == ranks,
        "one_writer_per_dp_group": len(writers) == dp_groups,
        "non_writers_wrote_nothing": all(p in writers for p in stats) and all(p in pids for p in stats),
        "each_request_written_once": sum(done.values()) == expected_requests,
        "no_failed_or_reused": all(int(stats.get(p, {}).get(k) or 0) == 0 for p in writers
                                   for k in ("requests_failed", "rids_reused", "write_errors")),
    }
    if dp_groups > 1:  # each DP group runs its own batches: each group's writer must have written some
        checks["every_dp_group_wrote"] = all(n > 0 for n in done.values()) and len(done) == dp_groups
    res["checks"] = checks
    res["pass"] = all(checks.values())
    return res


def read_dump_dir(dump_dir: Path) -> tuple[list[dict], dict[int, dict]]:
    markers = [json.loads(f.read_text()) for f in sorted(Path(dump_dir).glob("plugin-*.json"))]
    return markers, dumpfiles.read_writer_stats(dump_dir)


def verdict_markdown(model: str, results: dict) -> list[str]:
    lines = [f"## TP capture, {model}: {'PASS' if results.get('pass') else 'FAIL'}", ""]
    ref = results.get("reference", {})
    lines += [f"reference: `{ref.get('name')}` (tp {ref.get('tp')}), writer check "
              f"{'PASS' if (ref.get('writers') or {}).get('pass') else 'FAIL'}"
              f"{'; error: ' + ref['error'] if ref.get('error') else ''}", ""]
    for c in results.get("candidates", []):
        cmp = c.get("compare") or {}
        w = c.get("writers") or {}
        head = f"### {c['name']} (tp {c.get('tp')}, dp {c.get('dp')}): {'PASS' if c.get('pass') else 'FAIL'}"
        lines += [head, ""]
        failed = [k for k, v in cmp.get("checks", {}).items() if not v] + \
            [f"writer {k}" for k, v in (w.get("checks") or {}).items() if not v]
        if failed:
            lines += [f"failed checks: {', '.join(failed)}", ""]
        if c.get("error"):
            lines += [f"error: `{c['error']}`", ""]
        if cmp.get("partial_sum_suspected"):
            lines += [f"**PARTIAL SUM SUSPECTED** in {cmp['partial_sum_suspected']}: norm ratio near 1/tp "
                      "(per-rank partial sums captured instead of the all-reduced activation, cf. sglang#28343)", ""]
        for p in cmp.get("problems", []):
            lines.append(f"- problem: {p}")
        if "token" in cmp:
            lines += ["| tensor | worst sample rel | token median | p99 | max | flipped (>0.1) | norm ratio |",
                      "|---|---|---|---|---|---|---|"]
            for n, d in cmp["token"].items():
                lines.append(f"| {n} | {cmp['max_rel'][n]:.2e} | {d['median']:.2e} | {d['p99']:.2e} | {d['max']:.2f} "
                             f"| {d['flipped_frac']:.2%} | {cmp['norm_ratio_median'][n]:.3f} |")
            lines.append("")
        rows = {"samples": cmp.get("samples"), "check mode": cmp.get("mode"),
                "min rel, wrong layer": cmp.get("min_rel_wrong_layer"),
                **{f"check {k}": v for k, v in cmp.get("checks", {}).items()},
                "writer requests_done per writer pid": w.get("requests_done_by_writer"),
                "expected requests": w.get("expected_requests"),
                **{f"writer check {k}": v for k, v in (w.get("checks") or {}).items()}}
        lines += ["| quantity | value |", "|---|---|"]
        lines += [f"| {k} | {f'{v:.3g}' if isinstance(v, float) else v} |" for k, v in rows.items()]
        lines.append("")
    return lines


# ---- tensors on disk (safetensors: no pickle) ---------------------------------------------------------
def save_run(path: Path, caps: dict[str, list[torch.Tensor]]) -> None:
    from safetensors.torch import save_file

    flat = {f"{s}/{i}": t.contiguous() for s, ts in caps.items() for i, t in enumerate(ts)}
    tmp = path.with_name("." + path.name + ".tmp")
    save_file(flat, str(tmp))
    tmp.replace(path)


def load_run(path: Path) -> dict[str, list[torch.Tensor]]:
    from safetensors.torch import load_file

    flat = load_file(str(path))
    out: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in flat.items():
        s, i = key.rsplit("/", 1)
        out.setdefault(s, {})[int(i)] = t
    return {s: [d[i] for i in sorted(d)] for s, d in out.items()}


# ---- capture (on the device) --------------------------------------------------------------------------
def wait_stats(dump_dir: Path, expected: int, timeout_s: float) -> None:
    """The writer rewrites stats-<pid>.json when idle (every 2 s): wait until it counts every request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, stats = read_dump_dir(dump_dir)
        if sum(int(s.get("requests_done", 0)) + int(s.get("requests_failed", 0)) for s in stats.values()) >= expected:
            time.sleep(2.5)  # one more period: a duplicate write by a second rank would show up too
            return
        time.sleep(0.5)


def capture(a: argparse.Namespace) -> int:
    from hsextract.engines.base import CaptureSpec
    from hsextract.sglang.client import SGLangEngine
    from hsextract.sglang.server import ServerConfig, ensure_server, stop_servers

    runs = Path(a.runs)
    runs.mkdir(parents=True, exist_ok=True)
    res: dict = {"name": a.name, "model": a.model, "tp": a.tp, "dp": a.dp, "gpus": a.gpus, "aux": a.aux,
                 "n": a.n, "again": a.again, "chunked_prefill_size": a.chunked_prefill_size}
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(a.n, vocab, seed=7)
    spec = CaptureSpec(aux_layers=tuple(a.aux))
    extra = ["--enable-dp-attention", "--dp", str(a.dp)] if a.dp > 1 else []
    cfg = ServerConfig(model=a.model, aux_layers=spec.aux_layers, python=sys.executable, port=a.port, tp=a.tp,
                       gpus=tuple(a.gpus), chunked_prefill_size=a.chunked_prefill_size, module=a.module,
                       launch_args=tuple(shlex.split(a.sgl_args)) + tuple(extra), run_name=a.name,
                       startup_timeout_s=a.startup_timeout, stop_grace_s=10)

    def on_term(signum: int, frame: object) -> None:  # `timeout` on the device: still write the json
        raise RuntimeError(f"killed by signal {signum} (time budget of the device call)")

    signal.signal(signal.SIGTERM, on_term)
    stage, h = "start", None
    t0 = time.monotonic()
    try:
        h = ensure_server(a.state, cfg)
        res["startup_s"] = round(time.monotonic() - t0, 1)
        res["command"] = h.command
        print(f"[{a.name}] server up in {res['startup_s']} s", flush=True)
        stage = "extract"
        eng = SGLangEngine(h, spec, concurrency=a.concurrency, timeout_s=60, retries=0, run_name=a.name)
        res["engine_version"] = eng.version()
        t1 = time.monotonic()
        caps = {c.sample_id: c.hidden_states for c in eng.extract(prompts)}
        res["extract_s"] = round(time.monotonic() - t1, 2)
        if a.again:
            alone = SGLangEngine(h, spec, concurrency=1, timeout_s=60, retries=0, run_name=a.name + "-alone")
            save_run(runs / f"{a.name}-alone.safetensors",
                     {c.sample_id: c.hidden_states for c in alone.extract(prompts[: a.again])})
        save_run(runs / f"{a.name}.safetensors", caps)
        stage = "writers"
        expected = a.n + a.again
        wait_stats(h.dump_dir, expected, timeout_s=15)
        markers, stats = read_dump_dir(h.dump_dir)
        res["markers"], res["stats"] = markers, {str(k): v for k, v in stats.items()}
        res["writers"] = check_writers(markers, stats, expected_requests=expected, ranks=a.tp, dp_groups=a.dp)
        res["pass"] = res["writers"]["pass"]
    except Exception as e:
        res["error"] = f"{stage}: {type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        res["pass"] = False
        print(res["traceback"], file=sys.stderr, flush=True)
    finally:
        if h is not None and "markers" not in res:  # what the dump dir held when it failed
            try:
                res["markers"], st = read_dump_dir(h.dump_dir)
                res["stats"] = {str(k): v for k, v in st.items()}
            except Exception:
                pass
        stop_servers(a.state, grace_s=10)
    (runs / f"{a.name}.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"[{a.name}] {'PASS' if res['pass'] else 'FAIL'} writers {json.dumps((res.get('writers') or {}).get('checks'))}"
          f"{' error ' + res['error'] if 'error' in res else ''}", flush=True)
    return 0 if res["pass"] else 1


# ---- compare (CPU or device) --------------------------------------------------------------------------
def is_moe(model_dir: str) -> bool:
    from fidelity import is_moe as f

    return f(model_dir)


def compare(a: argparse.Namespace) -> int:
    runs, out = Path(a.runs), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    mode = a.mode if a.mode != "auto" else ("token" if is_moe(a.model) else "sample")

    def meta(name: str) -> dict:
        p = runs / f"{name}.json"
        if p.is_file():
            return json.loads(p.read_text())
        return {"name": name, "error": f"no {p.name}: the capture run did not finish (see run.log)"}

    rm = meta(a.ref)
    results: dict = {"model": a.name, "mode": mode, "reference": {k: rm.get(k) for k in
                     ("name", "tp", "dp", "gpus", "startup_s", "extract_s", "engine_version", "writers", "error")},
                     "candidates": []}
    ref_caps = None
    ref_file = runs / f"{rm.get('name', a.ref)}.safetensors"
    if ref_file.is_file():
        ref_caps = load_run(ref_file)
    for cand in a.cands:
        base = cand[: -len("-alone")] if cand.endswith("-alone") else cand
        cm = meta(base)  # an -alone rerun ran on its base run's server: that run's writer check covers it
        c = {k: cm.get(k) for k in ("name", "tp", "dp", "gpus", "startup_s", "extract_s", "writers", "error")}
        c["name"] = cand
        f = runs / f"{cand}.safetensors"
        if ref_caps is None:
            c["error"] = c.get("error") or f"no reference tensors ({ref_file.name})"
        elif not f.is_file():
            c["error"] = c.get("error") or f"no {f.name}"
        else:
            tp = int(cm.get("tp") or a.tp or 1)
            c["compare"] = compare_runs(ref_caps, load_run(f), a.aux, mode=mode, tp=tp, tol=a.tol,
                                        flip_bound=a.flip_bound)
        wpass = (c.get("writers") or {}).get("pass")
        c["pass"] = bool((c.get("compare") or {}).get("pass")) and bool(wpass) and not c.get("error")
        results["candidates"].append(c)
    results["pass"] = bool(results["candidates"]) and all(c["pass"] for c in results["candidates"]) \
        and bool((rm.get("writers") or {}).get("pass")) and not rm.get("error")
    (out / f"tp-{a.name}.json").write_text(json.dumps(results, indent=1, default=str))
    lines = verdict_markdown(a.name, results)
    (out / f"tp-{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if results["pass"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--model", required=True)
    c.add_argument("--name", required=True)
    c.add_argument("--aux", type=int, nargs="+", required=True)
    c.add_argument("--tp", type=int, default=1)
    c.add_argument("--dp", type=int, default=1, help=">1: --enable-dp-attention --dp N")
    c.add_argument("--gpus", type=int, nargs="+", default=[0])
    c.add_argument("--state", required=True)
    c.add_argument("--runs", required=True, help="directory for RUN.safetensors and RUN.json")
    c.add_argument("--port", type=int, default=30000)
    c.add_argument("--n", type=int, default=32)
    c.add_argument("--again", type=int, default=0, help="extract the first K prompts again, one at a time")
    c.add_argument("--concurrency", type=int, default=32)
    c.add_argument("--chunked-prefill-size", type=int, default=128)
    c.add_argument("--sgl-args", default="")
    c.add_argument("--module", default="sglang.launch_server")
    c.add_argument("--startup-timeout", type=float, default=300)
    m = sub.add_parser("compare")
    m.add_argument("--model", required=True, help="model dir (config.json: MoE or dense)")
    m.add_argument("--name", required=True)
    m.add_argument("--aux", type=int, nargs="+", required=True)
    m.add_argument("--runs", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--ref", required=True)
    m.add_argument("--cands", nargs="+", required=True)
    m.add_argument("--mode", choices=["auto", "sample", "token"], default="auto")
    m.add_argument("--tp", type=int, default=0, help="tp of the candidates when their json lacks it")
    m.add_argument("--tol", type=float, default=TOL)
    m.add_argument("--flip-bound", type=float, default=FLIP_BOUND)
    a = ap.parse_args(argv)
    return capture(a) if a.cmd == "capture" else compare(a)


if __name__ == "__main__":
    sys.exit(main())
