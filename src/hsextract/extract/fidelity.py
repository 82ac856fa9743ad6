"""Fidelity statistics: captured hidden states against a reference capture of the same weights and ids.

Length: the error measures, the pass rules that use them, the comparison of two runs' saved captures and
their verdict table are one module so that the rule a benchmark reports and the rule the tests check are the
same code; nothing outside the benchmarks and their tests imports it.

Used by the GPU benchmarks (bench/gpu/fidelity.py: the SGLang engine against the transformers engine;
bench/gpu/tp_compare.py: TP=2 and DP attention against TP=1) and tested on synthetic tensors in
tests/test_fidelity.py. The figures they produced are in bench/README.md.

Two kinds of error, both relative to the reference and computed in float32:
  * per sample and tensor: rel = |got - ref| / |ref| over the whole [tokens, hidden] tensor;
  * per token: rel_t = |got_t - ref_t| / |ref_t|, pooled over all tokens of all samples per tensor
    (median, p90, p99, max, and the fraction of "flipped" tokens, rel_t > FLIP).
Dense models are checked per sample. MoE models are checked per token: a router's near-tie decides a
token's experts differently under another kernel's rounding, and that token's state differs by far more
than rounding while the layer is right, so a whole-sample bound fails there although the capture is right.
FLIP_BOUND, the largest flipped fraction accepted, is provisional (chosen before any GPU measurement); it
is compared exactly, as integers (flipped * 20 <= tokens for 0.05). Every MoE model is also run as a
routing-fixed twin (router biases that make the top-k unambiguous), checked per sample like a dense model:
if the twin passes, the random-routing model's flipped tokens are routing near-ties, not capture errors.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hsextract.atomic import write_atomic
from hsextract.config.model_info import text_config
from hsextract.engines.base import Captured, Prompt

if TYPE_CHECKING:
    from hsextract.extract.final_norm import FinalNorm

FLIP = 0.1  # a token whose rel_t exceeds this counts as "flipped"
TOL = 2e-2  # per-sample bound (dense) and per-tensor token-median bound (MoE)
FLIP_BOUND = "0.05"  # provisional: largest accepted fraction of flipped tokens (MoE), compared exactly


# ---- statistics ----------------------------------------------------------------------------------------
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def token_rel(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token relative error of [n, H] tensors -> [n] (float32)."""
    g, r = got.float(), ref.float()
    return (g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)


def dist(errs: torch.Tensor, flip: float = FLIP) -> dict:
    """Median, p90, p99, max and flipped fraction of pooled per-token errors."""
    e = errs.float().flatten()
    q = torch.quantile(e, torch.tensor([0.5, 0.9, 0.99])).tolist() if e.numel() else [float("nan")] * 3
    flipped = int((e > flip).sum())
    return {"tokens": int(e.numel()), "median": q[0], "p90": q[1], "p99": q[2],
            "max": float(e.max()) if e.numel() else float("nan"), "flipped": flipped,
            "flipped_frac": flipped / e.numel() if e.numel() else float("nan")}


# ---- the model's layers ----------------------------------------------------------------------------------
def is_moe(model_dir: str | Path) -> bool:
    """Whether the model in `model_dir` (its config.json) routes tokens to experts."""
    cfg = text_config(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")))
    return any(int(cfg.get(k) or 0) > 0 for k in ("n_routed_experts", "num_experts", "num_local_experts"))


def neighbours(aux: tuple[int, ...], num_layers: int) -> list[int]:
    """The wrong layer next to each aux id (the following one; the previous one for the last layer)."""
    return [a + 1 if a + 1 < num_layers else a - 1 for a in aux]


# ---- one engine against a reference engine (bench/gpu/fidelity.py) -------------------------------------
FINAL_NAMES = ("final_pre_norm", "final_post_norm")
# post-norm = norm(pre-norm) within one forward: the candidate's own two final states, related by the
# model's final norm (hsextract.extract.final_norm) up to rounding. One bf16 ulp is at most 2^-7 of a value, so a
# per-sample relative error (an L2 ratio of per-value errors) of 1-ulp differences stays below 2^-7.
NORM_TOL = 2.0**-7


def within_fraction(count: int, total: int, bound: str | float | Fraction) -> bool:
    """count / total <= bound, exactly (integers against the bound as a decimal fraction: 505/10100 is
    0.05 exactly, not above it as float division can make it)."""
    b = bound if isinstance(bound, Fraction) else Fraction(str(bound))
    return count * b.denominator <= total * b.numerator


def evaluate(prompts: list[Prompt], got: list[Captured], alone: list[Captured], refs: list[dict],
             aux: tuple[int, ...], *, tol: float, token_tol: float, flip_bound: str | float, mode: str,
             long_from: int, final_norm: FinalNorm | None = None, norm_tol: float = NORM_TOL) -> dict:
    """Per-sample and per-token statistics and the checks of `mode` ("sample" or "token").

    `got` are the candidate's captures: the aux layers, then BOTH final states of the same forward, the
    pre-norm one (the last decoder layer's output) and the post-norm one (the final norm's output);
    `alone` the first of them captured again one at a time; `refs` per prompt the reference's {"aux",
    "wrong" (the neighbouring layers), "pre", "post"}. Each captured final state is compared with the
    reference's same state directly, and with the other one (which must be far: a model whose pre- and
    post-norm states are close cannot tell them apart, and then fails `final_states_distinguishable`).
    With `final_norm`, norm(captured pre) must equal captured post within `norm_tol` per sample.
    Checks:
      sample: every sample's rel <= tol per tensor; the neighbouring layer and the other final state
              > 10*tol for every sample; in flight vs alone <= tol.
      token:  per-tensor median rel_t <= token_tol; the neighbouring layer's (the other final state's)
              median >= 10x the right one's; the per-sample wrong-layer checks above; flipped tokens
              (rel_t > FLIP) at most flip_bound of all, compared exactly as integers; in flight vs alone:
              median <= token_tol and flipped within flip_bound.
    Prompts longer than `long_from` tokens (chunked prefills) are reported as long_samples_max_rel."""
    k = len(aux)
    names = [f"aux{x}" for x in aux] + list(FINAL_NAMES)
    per = []
    tok_right: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    tok_wrong: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for p, g, ref in zip(prompts, got, refs, strict=True):
        hs = g.hidden_states
        if len(hs) != k + 2:
            raise ValueError(f"sample {p.sample_id}: {len(hs)} tensors, expected {k} aux + pre- and post-norm")
        right = list(ref["aux"]) + [ref["pre"], ref["post"]]
        wrong = list(ref["wrong"]) + [ref["post"], ref["pre"]]
        row = {"sample": p.sample_id, "len": len(p.input_ids),
               "rel": {n: rel(hs[j], right[j]) for j, n in enumerate(names)},
               "rel_wrong": {n: rel(hs[j], wrong[j]) for j, n in enumerate(names)},
               "ref_pre_vs_post": rel(ref["pre"], ref["post"])}
        if final_norm is not None:
            row["norm_relation"] = rel(final_norm.apply(hs[k]), hs[k + 1])
        for j, n in enumerate(names):
            tok_right[n].append(token_rel(hs[j], right[j]))
            tok_wrong[n].append(token_rel(hs[j], wrong[j]))
        row["flipped_tokens"] = [int((tok_right[n][-1] > FLIP).sum()) for n in names]
        per.append(row)
    res: dict = {"per_sample": per, "tensors": names}
    res["max_rel"] = {n: max(s["rel"][n] for s in per) for n in names}
    res["min_rel_wrong"] = {n: min(s["rel_wrong"][n] for s in per) for n in names}
    res["min_rel_wrong_layer"] = min(res["min_rel_wrong"][n] for n in names[:k]) if k else None
    res["min_rel_ref_pre_vs_post"] = min(s["ref_pre_vs_post"] for s in per)
    res["max_norm_relation"] = max(s["norm_relation"] for s in per) if final_norm is not None else None
    longs = [max(s["rel"].values()) for s in per if s["len"] > long_from]
    res["long_samples_max_rel"] = max(longs) if longs else None
    tok = {n: dist(torch.cat(tok_right[n])) for n in names}
    tok_nb = {n: dist(torch.cat(tok_wrong[n])) for n in names}
    res["token"] = {"right": tok, "wrong": tok_nb}
    # batch invariance: the same prompt among many in flight vs alone
    # (`alone` holds the first few prompts only: zip stops at its end)
    inv_tok = torch.cat([token_rel(x, y) for g, s in zip(got, alone, strict=False)
                         for x, y in zip(g.hidden_states, s.hidden_states, strict=True)])
    res["batch_invariance_max_rel"] = max(rel(x, y) for g, s in zip(got, alone, strict=False)
                                          for x, y in zip(g.hidden_states, s.hidden_states, strict=True))
    res["token"]["batch_invariance"] = inv = dist(inv_tok)
    far = 10 * tol
    common = {
        "wrong_layer_far_above_tol": k == 0 or res["min_rel_wrong_layer"] > far,
        "final_states_distinguishable": res["min_rel_ref_pre_vs_post"] > far,
        "final_pre_norm_is_not_post_norm": res["min_rel_wrong"]["final_pre_norm"] > far,
        "final_post_norm_is_not_pre_norm": res["min_rel_wrong"]["final_post_norm"] > far,
    }
    if final_norm is not None:
        common["post_norm_is_norm_of_pre_norm"] = res["max_norm_relation"] <= norm_tol
    sample_checks = {
        "right_layers_within_tol": all(v <= tol for v in res["max_rel"].values()),
        **common,
        "batch_invariant": res["batch_invariance_max_rel"] <= tol,
    }
    token_checks = {
        "token_median_within_tol": all(d["median"] <= token_tol for d in tok.values()),
        "wrong_median_10x": all(tok_nb[n]["median"] >= 10 * tok[n]["median"] for n in names),
        **common,
        "flipped_fraction_within_bound": all(within_fraction(d["flipped"], d["tokens"], flip_bound)
                                             for d in tok.values()),
        "batch_invariant_tokens": inv["median"] <= token_tol
        and within_fraction(inv["flipped"], inv["tokens"], flip_bound),
    }
    res["checks_sample"] = sample_checks
    res["checks_token"] = token_checks
    res["checks"] = dict(token_checks if mode == "token" else sample_checks)
    return res


# ---- one capture run against another (bench/gpu/tp_compare.py) ----------------------------------------
def partial_sum_like(ratio: float, tp: int) -> bool:
    """|got|/|ref| of one rank's share of a sum over tp ranks: 1/tp when the shares are equal, about
    1/sqrt(tp) when they are independent; a failing tensor in (or near) that range is reported as such."""
    return tp > 1 and 1 / tp - 0.15 <= ratio <= 1 / tp**0.5 + 0.1


def tensor_names(aux: list[int] | tuple[int, ...]) -> list[str]:
    return [f"aux{a}" for a in aux] + ["final_post_norm"]


def norm_ratio(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(got.float().norm() / ref.float().norm().clamp_min(1e-12))


def compare_runs(ref: dict[str, list[torch.Tensor]], got: dict[str, list[torch.Tensor]], aux: list[int], *,
                 mode: str, tp: int, tol: float = TOL, flip_bound: str | float = FLIP_BOUND) -> dict:
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
        checks["flipped_fraction_small"] = all(within_fraction(d["flipped"], d["tokens"], flip_bound)
                                               for d in res["token"].values())
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


def compare_model(runs: Path, model: str, ref: str, cands: list[str], aux: list[int], *, mode: str, tp: int = 0,
                  tol: float = TOL, flip_bound: str | float = FLIP_BOUND) -> dict:
    """The verdict on one model's capture runs in `runs` (RUN.json and RUN.safetensors each): every
    candidate against the reference run `ref`, with the writer checks of both. A candidate "X-alone" (the
    first prompts again, one at a time, on X's server) is covered by X's writer check. `tp` is the
    candidates' tp where their json lacks it. A run that never finished fails, saying so."""

    def meta(name: str) -> dict:
        p = runs / f"{name}.json"
        if p.is_file():
            return json.loads(p.read_text(encoding="utf-8"))
        return {"name": name, "error": f"no {p.name}: the capture run did not finish (see run.log)"}

    rm = meta(ref)
    results: dict = {"model": model, "mode": mode, "reference": {k: rm.get(k) for k in
                     ("name", "tp", "dp", "gpus", "startup_s", "extract_s", "engine_version", "writers", "error")},
                     "candidates": []}
    ref_caps = None
    ref_file = runs / f"{rm.get('name', ref)}.safetensors"
    if ref_file.is_file():
        ref_caps = load_run(ref_file)
    for cand in cands:
        cm = meta(cand.removesuffix("-alone"))
        c = {k: cm.get(k) for k in ("name", "tp", "dp", "gpus", "startup_s", "extract_s", "writers", "error")}
        c["name"] = cand
        f = runs / f"{cand}.safetensors"
        if ref_caps is None:
            c["error"] = c.get("error") or f"no reference tensors ({ref_file.name})"
        elif not f.is_file():
            c["error"] = c.get("error") or f"no {f.name}"
        else:
            c["compare"] = compare_runs(ref_caps, load_run(f), aux, mode=mode, tp=int(cm.get("tp") or tp or 1),
                                        tol=tol, flip_bound=flip_bound)
        wpass = (c.get("writers") or {}).get("pass")
        c["pass"] = bool((c.get("compare") or {}).get("pass")) and bool(wpass) and not c.get("error")
        results["candidates"].append(c)
    results["pass"] = bool(results["candidates"]) and all(c["pass"] for c in results["candidates"]) \
        and bool((rm.get("writers") or {}).get("pass")) and not rm.get("error")
    return results


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


# ---- captured runs on disk (safetensors: no pickle) ------------------------------------------------------
def save_run(path: Path, caps: dict[str, list[torch.Tensor]]) -> None:
    """Captures by sample id, one safetensors file (key "<sample>/<tensor index>"), written atomically."""
    from safetensors.torch import save

    data = save({f"{s}/{i}": t.contiguous() for s, ts in caps.items() for i, t in enumerate(ts)})
    write_atomic(path, lambda f: f.write(data))


def load_run(path: Path) -> dict[str, list[torch.Tensor]]:
    """What save_run wrote: sample id -> tensors in their order."""
    from safetensors.torch import load_file

    flat = load_file(str(path))
    out: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in flat.items():
        s, i = key.rsplit("/", 1)
        out.setdefault(s, {})[int(i)] = t
    return {s: [d[i] for i in sorted(d)] for s, d in out.items()}
