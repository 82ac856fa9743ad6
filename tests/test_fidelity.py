"""hsextract.extract.fidelity on synthetic hidden states and dump dirs, values known by construction: the statistics
and checks of one engine against a reference engine, of one capture run against another (TP=2 vs TP=1), the
one-writer check, and the compare command of bench/gpu/tp_compare.py run as a script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hsextract.config.model_info import read_model_shape
from hsextract.engines.base import Captured, Prompt
from hsextract.extract import fidelity

ROOT = Path(__file__).resolve().parents[1]

E_AUX, E_H = (1, 3), 8  # one engine against a reference engine


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, E_H, generator=torch.Generator().manual_seed(seed))


def test_token_rel_and_dist_values() -> None:
    ref = torch.ones(4, E_H)
    got = ref.clone()
    got[1] *= 1.05  # rel 0.05
    got[2] *= 1.5  # rel 0.5: flipped
    e = fidelity.token_rel(got, ref)
    assert torch.allclose(e, torch.tensor([0.0, 0.05, 0.5, 0.0]), atol=1e-6)
    d = fidelity.dist(e)
    assert d["tokens"] == 4 and d["flipped_frac"] == 0.25 and d["max"] == pytest.approx(0.5)
    assert d["median"] == pytest.approx(0.025, abs=1e-6)  # midpoint of 0 and 0.05


def _case(flip_every: int | None, wrong_layer: bool = False, final: str = "right", n_aux: int = len(E_AUX)):
    """Captures [aux..., pre, post] against references; `final`: "right", "swapped" (pre and post exchanged),
    "close" (a model whose post-norm state is its pre-norm state: nothing to tell apart)."""
    aux_ids = E_AUX if n_aux == len(E_AUX) else tuple(range(n_aux))
    prompts, got, refs = [], [], []
    for i, n in enumerate([5, 40, 120]):
        prompts.append(Prompt(i, f"s{i}", list(range(n))))
        aux = [_rows(n, 10 * i + j) for j in range(n_aux)]
        wrong = [_rows(n, 100 + 10 * i + j) for j in range(n_aux)]
        pre = _rows(n, 1000 + i) * 3
        post = pre.clone() if final == "close" else pre / pre.norm(dim=-1, keepdim=True)
        finals = [post, pre] if final == "swapped" else [pre, post]
        g = [(w if wrong_layer else a) * 1.005 for a, w in zip(aux, wrong, strict=True)] + [f * 1.005 for f in finals]
        if flip_every:
            for t in g:
                t[::flip_every] += 0.5 * t[::flip_every].norm(dim=-1, keepdim=True)  # rel ~0.5 on those tokens
        got.append(Captured(i, f"s{i}", [t.to(torch.bfloat16) for t in g]))
        refs.append({"aux": aux, "wrong": wrong, "pre": pre, "post": post})
    return prompts, got, refs, aux_ids


def _eval(prompts, got, refs, aux_ids, mode: str, **kw) -> dict:
    return fidelity.evaluate(prompts, got, got[:2], refs, aux_ids, tol=2e-2, token_tol=2e-2, flip_bound="0.05",
                             mode=mode, long_from=100, **kw)


def test_moe_like_flips_fail_per_sample_but_pass_per_token() -> None:
    r = _eval(*_case(flip_every=50), "token")  # 3% of tokens flipped, the rest within 5e-3 + bf16 rounding
    assert r["checks_sample"]["right_layers_within_tol"] is False  # a flipped token dominates a sample's norm
    assert all(r["checks_token"].values()), r["checks_token"]
    right = r["token"]["right"]
    assert list(right) == ["aux1", "aux3", "final_pre_norm", "final_post_norm"]
    for d in right.values():
        assert d["tokens"] == 165 and d["median"] < 8e-3
        assert d["flipped"] == 5 and d["flipped_frac"] == 5 / 165  # row 0 of 5, of 40, rows 0, 50, 100 of 120
    assert r["token"]["wrong"]["aux1"]["flipped_frac"] > 0.9
    assert r["token"]["wrong"]["final_post_norm"]["median"] > 0.5  # the post-norm capture vs the pre-norm ref
    assert r["checks"] == r["checks_token"]
    assert [s["flipped_tokens"] for s in r["per_sample"]] == [[1] * 4, [1] * 4, [3] * 4]


def test_too_many_flips_and_wrong_layer_fail() -> None:
    r = _eval(*_case(flip_every=5), "token")  # 20% flipped
    assert r["checks_token"]["flipped_fraction_within_bound"] is False
    r = _eval(*_case(flip_every=None, wrong_layer=True), "token")
    assert r["checks_token"]["token_median_within_tol"] is False
    assert r["checks_token"]["wrong_median_10x"] is False


def test_dense_clean_case_passes_sample_checks() -> None:
    r = _eval(*_case(flip_every=None), "sample")
    assert r["checks"] == r["checks_sample"] and all(r["checks"].values())
    assert r["batch_invariance_max_rel"] == 0.0 and r["long_samples_max_rel"] < 1e-2
    assert r["min_rel_ref_pre_vs_post"] > 0.5


def test_swapped_final_states_fail_directly() -> None:
    r = _eval(*_case(flip_every=None, final="swapped"), "sample")
    assert r["max_rel"]["final_pre_norm"] > 0.5 and r["max_rel"]["final_post_norm"] > 0.5
    assert r["checks"]["right_layers_within_tol"] is False
    assert r["checks"]["final_pre_norm_is_not_post_norm"] is False
    assert r["checks"]["final_post_norm_is_not_pre_norm"] is False


def test_a_model_whose_final_states_coincide_cannot_pass() -> None:
    """The old inferred check passed such a model; the direct comparison says it has no power."""
    r = _eval(*_case(flip_every=None, final="close"), "sample")
    assert r["min_rel_ref_pre_vs_post"] == 0.0
    assert r["checks"]["final_states_distinguishable"] is False
    assert r["checks"]["right_layers_within_tol"] is True


def test_norm_relation_between_the_two_captured_final_states() -> None:
    from hsextract.extract.final_norm import FinalNorm

    # post = pre / |pre| = RMSNorm(pre) with eps 0 and weight 1/sqrt(H)
    norm = FinalNorm("rms_norm", 0.0, torch.full((E_H,), E_H ** -0.5).to(torch.bfloat16))
    r = _eval(*_case(flip_every=None), "sample", final_norm=norm)
    assert r["checks"]["post_norm_is_norm_of_pre_norm"] is True and r["max_norm_relation"] < 2e-2
    wrong = FinalNorm("rms_norm", 0.0, torch.full((E_H,), 2 * E_H ** -0.5).to(torch.bfloat16))
    r = _eval(*_case(flip_every=None), "sample", final_norm=wrong)
    assert r["checks"]["post_norm_is_norm_of_pre_norm"] is False and r["max_norm_relation"] > 0.9


def test_five_aux_layers() -> None:
    r = _eval(*_case(flip_every=None, n_aux=5), "sample")
    assert r["tensors"] == ["aux0", "aux1", "aux2", "aux3", "aux4", "final_pre_norm", "final_post_norm"]
    assert all(r["checks"].values())


def test_fractions_are_compared_exactly() -> None:
    assert fidelity.within_fraction(505, 10100, "0.05") and fidelity.within_fraction(505, 10100, 0.05)
    assert not fidelity.within_fraction(506, 10100, "0.05")
    e = torch.zeros(10100)
    e[:505] = 0.5
    d = fidelity.dist(e)
    assert d["flipped"] == 505 and (e > fidelity.FLIP).float().mean().item() > 0.05  # float32 says "above"
    assert fidelity.within_fraction(d["flipped"], d["tokens"], fidelity.FLIP_BOUND)


def test_is_moe_and_neighbours(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"n_routed_experts": 8, "num_hidden_layers": 10, "hidden_size": 64}')
    assert fidelity.is_moe(str(tmp_path)) and read_model_shape(str(tmp_path)).num_layers == 10
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 8}')
    assert not fidelity.is_moe(str(tmp_path))
    assert fidelity.neighbours((1, 3, 7), 8) == [2, 4, 6]


# ---- one capture run against another ---------------------------------------------------------------------
TP_AUX, TP_H = [2, 4, 6], 32  # one capture run against another


def _run(seed: int, n: int = 6) -> dict[str, list[torch.Tensor]]:
    """n samples of 4 tensors; layers differ from each other like a residual stream that grows."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        T = 5 + 7 * i
        base = torch.randn(T, TP_H, generator=g)
        out[f"{i:04d}"] = [(base * (1 + j) + torch.randn(T, TP_H, generator=g)).to(torch.bfloat16) for j in range(4)]
    return out


def _map(run: dict, f) -> dict:
    return {s: [f(j, t) for j, t in enumerate(ts)] for s, ts in run.items()}


@pytest.mark.parametrize("mode", ["sample", "token"])
def test_equal_runs_pass(mode: str) -> None:
    ref = _run(0)
    r = fidelity.compare_runs(ref, _map(ref, lambda j, t: t.clone()), TP_AUX, mode=mode, tp=2)
    assert r["pass"] and r["max_rel"] == {n: 0.0 for n in fidelity.tensor_names(TP_AUX)}
    assert r["min_rel_wrong_layer"] > 0.2 and r["partial_sum_suspected"] == [] and r["samples"] == 6


def test_bf16_noise_passes_both_modes() -> None:
    ref = _run(1)
    g = torch.Generator().manual_seed(5)
    got = _map(ref, lambda j, t: (t.float() * (1 + 4e-3 * torch.randn(t.shape, generator=g))).to(torch.bfloat16))
    for mode in ("sample", "token"):
        r = fidelity.compare_runs(ref, got, TP_AUX, mode=mode, tp=2)
        assert r["pass"], r["checks"]
        assert 1e-3 < max(r["max_rel"].values()) < 1e-2


@pytest.mark.parametrize("mode", ["sample", "token"])
def test_half_value_partial_sum_fails_loudly(mode: str) -> None:
    ref = _run(2)
    got = _map(ref, lambda j, t: (t.float() / 2).to(torch.bfloat16) if j == 1 else t.clone())  # aux4 halved
    r = fidelity.compare_runs(ref, got, TP_AUX, mode=mode, tp=2)
    assert not r["pass"]
    assert r["failing_tensors"] == ["aux4"] and r["partial_sum_suspected"] == ["aux4"]
    assert r["norm_ratio_median"]["aux4"] == pytest.approx(0.5, abs=1e-3)
    assert r["max_rel"]["aux4"] == pytest.approx(0.5, abs=1e-3)
    md = "\n".join(fidelity.verdict_markdown("m", {"pass": False, "reference": {"name": "m-tp1", "tp": 1},
                                              "candidates": [{"name": "m-tp2", "tp": 2, "dp": 1, "pass": False,
                                                              "compare": r}]}))
    assert "## TP capture, m: FAIL" in md and "**PARTIAL SUM SUSPECTED** in ['aux4']" in md
    want = "every_sample_within_tol" if mode == "sample" else "token_median_within_tol, flipped_fraction_small"
    assert f"failed checks: {want}\n" in md


def test_independent_rank_shares_fail_and_are_flagged() -> None:
    """ref = a + b (two ranks' independent partial sums), got = a: ratio ~ 1/sqrt(2), not 1/2."""
    g = torch.Generator().manual_seed(3)
    ref, got = {}, {}
    for i in range(4):
        parts = [(torch.randn(20, TP_H, generator=g), torch.randn(20, TP_H, generator=g)) for _ in range(4)]
        ref[f"s{i}"] = [(a + b).to(torch.bfloat16) for a, b in parts]
        got[f"s{i}"] = [a.to(torch.bfloat16) for a, b in parts]
    for mode in ("sample", "token"):
        r = fidelity.compare_runs(ref, got, TP_AUX, mode=mode, tp=2)
        assert not r["pass"] and r["failing_tensors"] == fidelity.tensor_names(TP_AUX)
        assert r["partial_sum_suspected"] == fidelity.tensor_names(TP_AUX)
        assert 0.6 < r["norm_ratio_median"]["aux2"] < 0.8


def test_wrong_layer_that_is_not_far_off_fails() -> None:
    """If the captured layers are indistinguishable, the comparison has no power: the check says so."""
    g = torch.Generator().manual_seed(4)
    ref = {}
    for i in range(3):
        t = torch.randn(10, TP_H, generator=g).to(torch.bfloat16)
        ref[f"s{i}"] = [t.clone() for _ in range(4)]
    r = fidelity.compare_runs(ref, _map(ref, lambda j, t: t.clone()), TP_AUX, mode="sample", tp=2)
    assert r["checks"]["wrong_layer_far_above_tol"] is False and not r["pass"]
    assert r["min_rel_wrong_layer"] == 0.0


def test_token_mode_tolerates_few_flipped_tokens_sample_mode_does_not() -> None:
    ref = _run(5, n=6)  # 135 tokens
    g = torch.Generator().manual_seed(6)

    def flip(frac: float):
        def f(j: int, t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            k = max(1, int(frac * t.shape[0])) if frac else 0
            t[:k] = torch.randn(k, TP_H, generator=g).to(torch.bfloat16) * 3  # a few tokens routed elsewhere
            return t
        return f

    few = _map(ref, flip(0.03))  # one token of each sample: 6 of 135 = 4.4%
    r = fidelity.compare_runs(ref, few, TP_AUX, mode="token", tp=2)
    assert r["token"]["aux2"]["flipped_frac"] == pytest.approx(6 / 135)
    assert fidelity.compare_runs(ref, few, TP_AUX, mode="token", tp=2)["pass"]
    assert not fidelity.compare_runs(ref, few, TP_AUX, mode="sample", tp=2)["checks"]["every_sample_within_tol"]
    many = _map(ref, flip(0.3))
    r = fidelity.compare_runs(ref, many, TP_AUX, mode="token", tp=2)
    assert r["checks"]["flipped_fraction_small"] is False and not r["pass"]


def test_sample_mismatch_fails_with_problem() -> None:
    ref = _run(7, n=3)
    got = dict(_map(ref, lambda j, t: t.clone()))
    got["extra"] = ref["0000"]
    got["0001"] = [t[:-1] for t in got["0001"]]
    r = fidelity.compare_runs(ref, got, TP_AUX, mode="sample", tp=2)
    assert not r["pass"] and r["checks"]["samples_match"] is False
    assert r["problems"][0] == "1 candidate samples are not in the reference: ['extra']"
    assert any(p.startswith("sample 0001: shape (11, 32) vs reference (12, 32)") for p in r["problems"])
    with pytest.raises(ValueError):
        fidelity.compare_runs(ref, ref, TP_AUX, mode="bogus", tp=1)


# ---- one rank per DP group writes ---------------------------------------------------------------------
def _check(procs: list[tuple[int, bool]], stats: dict[int, dict], **kw) -> dict:
    """check_writers on the plugin markers of `procs` (pid, writer_rank) and the writers' stats by pid."""
    markers = [{"pid": pid, "writer_rank": w, "aux_layers": TP_AUX} for pid, w in procs]
    return fidelity.check_writers(markers, {pid: {"requests_failed": 0, "rids_reused": 0, **st}
                                            for pid, st in stats.items()}, **kw)


def test_writers_tp2_one_writer_passes() -> None:
    d = ([(100, True), (101, False)], {100: {"requests_done": 35}})
    r = _check(*d, expected_requests=35, ranks=2, dp_groups=1)
    assert r["pass"] and r["writer_pids"] == [100] and r["non_writer_pids"] == [101]
    assert r["requests_done_by_writer"] == {"100": 35}


def test_writers_both_ranks_writing_fails() -> None:
    # both ranks believe they are the writer: every request written twice
    d = ([(100, True), (101, True)], {100: {"requests_done": 35}, 101: {"requests_done": 35}})
    r = _check(*d, expected_requests=35, ranks=2, dp_groups=1)
    assert not r["pass"]
    assert r["checks"]["one_writer_per_dp_group"] is False and r["checks"]["each_request_written_once"] is False
    assert r["requests_done_total"] == 70


def test_writers_non_writer_with_stats_fails() -> None:
    d = ([(100, True), (101, False)], {100: {"requests_done": 35}, 101: {"requests_done": 0}})
    r = _check(*d, expected_requests=35, ranks=2, dp_groups=1)
    assert r["checks"] == {"one_marker_per_rank": True, "one_writer_per_dp_group": True,
                           "non_writers_wrote_nothing": False, "each_request_written_once": True,
                           "no_failed_or_reused": True}


def test_writers_missing_rank_missing_requests_and_failures() -> None:
    d = ([(100, True)], {100: {"requests_done": 30}})
    r = _check(*d, expected_requests=35, ranks=2, dp_groups=1)
    assert r["checks"]["one_marker_per_rank"] is False and r["checks"]["each_request_written_once"] is False
    d = ([(100, True), (101, False)], {100: {"requests_done": 35, "requests_failed": 1}})
    assert _check(*d, expected_requests=35, ranks=2, dp_groups=1)["checks"]["no_failed_or_reused"] is False
    d = ([(100, True), (101, False)], {})  # writer never ran
    r = _check(*d, expected_requests=35, ranks=2, dp_groups=1)
    assert not r["pass"] and r["requests_done_total"] == 0


def test_writers_dp_attention() -> None:
    # dp 2 x attention-tp 1: both ranks are attn_tp_rank 0 of their group, each writes its own requests
    d = ([(100, True), (101, True)], {100: {"requests_done": 17}, 101: {"requests_done": 18}})
    r = _check(*d, expected_requests=35, ranks=2, dp_groups=2)
    assert r["pass"] and r["checks"]["every_dp_group_wrote"] is True
    d = ([(100, True), (101, True)], {100: {"requests_done": 35}})
    r = _check(*d, expected_requests=35, ranks=2, dp_groups=2)
    assert not r["pass"] and r["checks"]["every_dp_group_wrote"] is False
    d = ([(100, True), (101, True)], {100: {"requests_done": 35}, 101: {"requests_done": 35}})
    assert _check(*d, expected_requests=35, ranks=2, dp_groups=2)["checks"]["each_request_written_once"] is False


# ---- files and the compare command --------------------------------------------------------------------
def test_save_load_roundtrip_exact(tmp_path: Path) -> None:
    run = _run(8, n=3)
    fidelity.save_run(tmp_path / "r.safetensors", run)
    back = fidelity.load_run(tmp_path / "r.safetensors")
    assert list(back) == sorted(run) and all(
        all(torch.equal(x, y) and x.dtype == torch.bfloat16 for x, y in zip(back[s], run[s], strict=True)) for s in run)


def _write_run(runs: Path, name: str, caps: dict, tp: int, dp: int, writers_ok: bool = True) -> None:
    fidelity.save_run(runs / f"{name}.safetensors", caps)
    (runs / f"{name}.json").write_text(json.dumps({"name": name, "tp": tp, "dp": dp,
                                                   "writers": {"pass": writers_ok, "checks": {}}}))


def _runs(tmp_path: Path) -> tuple[Path, dict]:
    runs = tmp_path / "runs"
    runs.mkdir()
    ref = _run(9)
    _write_run(runs, "m-tp1", ref, 1, 1)
    fidelity.save_run(runs / "m-tp1-alone.safetensors", {s: ref[s] for s in list(ref)[:2]})
    _write_run(runs, "m-tp2", _map(ref, lambda j, t: t.clone()), 2, 1)
    _write_run(runs, "m-dp2", _map(ref, lambda j, t: t.clone()), 2, 2, writers_ok=False)
    return runs, ref


def test_compare_model_verdicts(tmp_path: Path) -> None:
    runs, ref = _runs(tmp_path)

    def verdict(*cands: str) -> dict:
        return fidelity.compare_model(runs, "m", "m-tp1", list(cands), TP_AUX, mode="token")

    res = verdict("m-tp2", "m-tp1-alone")
    assert res["pass"] and [c["compare"]["samples"] for c in res["candidates"]] == [6, 2]
    # a candidate whose writer check failed fails the model, even with equal tensors
    res = verdict("m-tp2", "m-dp2")
    assert not res["pass"] and [c["pass"] for c in res["candidates"]] == [True, False]
    # a candidate run that never finished is a failure that says so
    res = verdict("m-missing")
    assert not res["pass"]
    assert "error: `no m-missing.json: the capture run did not finish (see run.log)`" in \
        fidelity.verdict_markdown("m", res)
    # partial sums in the candidate: flagged in the markdown
    _write_run(runs, "m-tp2", _map(ref, lambda j, t: (t.float() / 2).to(torch.bfloat16)), 2, 1)
    res = verdict("m-tp2")
    assert not res["pass"] and "**PARTIAL SUM SUSPECTED**" in "\n".join(fidelity.verdict_markdown("m", res))


def test_tp_compare_script_writes_the_verdict(tmp_path: Path) -> None:
    """bench/gpu/tp_compare.py compare, run as the device script runs it: MoE from config.json, exit status."""
    runs, _ = _runs(tmp_path)
    model, out = tmp_path / "model", tmp_path / "out"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"n_routed_experts": 8, "num_hidden_layers": 8}))
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu" / "tp_compare.py"), "compare", "--model", str(model), "--name",
         "m", "--aux", "2", "4", "6", "--runs", str(runs), "--out", str(out), "--ref", "m-tp1", "--cands", "m-tp2",
         "m-dp2"],
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((out / "tp-m.json").read_text())
    assert res["mode"] == "token" and [c["pass"] for c in res["candidates"]] == [True, False]
    assert (out / "tp-m.md").read_text().startswith("## TP capture, m: FAIL\n")
