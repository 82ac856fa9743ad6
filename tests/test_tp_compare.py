"""bench/gpu/tp_compare.py on synthetic tensors and dump dirs: TP=2 vs TP=1 checks and the one-writer check."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

_GPU = Path(__file__).parents[1] / "bench" / "gpu"
sys.path.insert(0, str(_GPU))  # tp_compare imports fidelity's statistics
_spec = importlib.util.spec_from_file_location("tp_compare", _GPU / "tp_compare.py")
tpc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tpc)

AUX, H = [2, 4, 6], 32


def _run(seed: int, n: int = 6) -> dict[str, list[torch.Tensor]]:
    """n samples of 4 tensors; layers differ from each other like a residual stream that grows."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        T = 5 + 7 * i
        base = torch.randn(T, H, generator=g)
        out[f"{i:04d}"] = [(base * (1 + j) + torch.randn(T, H, generator=g)).to(torch.bfloat16) for j in range(4)]
    return out


def _map(run: dict, f) -> dict:
    return {s: [f(j, t) for j, t in enumerate(ts)] for s, ts in run.items()}


@pytest.mark.parametrize("mode", ["sample", "token"])
def test_equal_runs_pass(mode: str) -> None:
    ref = _run(0)
    r = tpc.compare_runs(ref, _map(ref, lambda j, t: t.clone()), AUX, mode=mode, tp=2)
    assert r["pass"] and r["max_rel"] == {n: 0.0 for n in tpc.tensor_names(AUX)}
    assert r["min_rel_wrong_layer"] > 0.2 and r["partial_sum_suspected"] == [] and r["samples"] == 6


def test_bf16_noise_passes_both_modes() -> None:
    ref = _run(1)
    g = torch.Generator().manual_seed(5)
    got = _map(ref, lambda j, t: (t.float() * (1 + 4e-3 * torch.randn(t.shape, generator=g))).to(torch.bfloat16))
    for mode in ("sample", "token"):
        r = tpc.compare_runs(ref, got, AUX, mode=mode, tp=2)
        assert r["pass"], r["checks"]
        assert 1e-3 < max(r["max_rel"].values()) < 1e-2


@pytest.mark.parametrize("mode", ["sample", "token"])
def test_half_value_partial_sum_fails_loudly(mode: str) -> None:
    ref = _run(2)
    got = _map(ref, lambda j, t: (t.float() / 2).to(torch.bfloat16) if j == 1 else t.clone())  # aux4 halved
    r = tpc.compare_runs(ref, got, AUX, mode=mode, tp=2)
    assert not r["pass"]
    assert r["failing_tensors"] == ["aux4"] and r["partial_sum_suspected"] == ["aux4"]
    assert r["norm_ratio_median"]["aux4"] == pytest.approx(0.5, abs=1e-3)
    assert r["max_rel"]["aux4"] == pytest.approx(0.5, abs=1e-3)
    md = "\n".join(tpc.verdict_markdown("m", {"pass": False, "reference": {"name": "m-tp1", "tp": 1},
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
        parts = [(torch.randn(20, H, generator=g), torch.randn(20, H, generator=g)) for _ in range(4)]
        ref[f"s{i}"] = [(a + b).to(torch.bfloat16) for a, b in parts]
        got[f"s{i}"] = [a.to(torch.bfloat16) for a, b in parts]
    for mode in ("sample", "token"):
        r = tpc.compare_runs(ref, got, AUX, mode=mode, tp=2)
        assert not r["pass"] and r["failing_tensors"] == tpc.tensor_names(AUX)
        assert r["partial_sum_suspected"] == tpc.tensor_names(AUX)
        assert 0.6 < r["norm_ratio_median"]["aux2"] < 0.8


def test_wrong_layer_that_is_not_far_off_fails() -> None:
    """If the captured layers are indistinguishable, the comparison has no power: the check says so."""
    g = torch.Generator().manual_seed(4)
    ref = {}
    for i in range(3):
        t = torch.randn(10, H, generator=g).to(torch.bfloat16)
        ref[f"s{i}"] = [t.clone() for _ in range(4)]
    r = tpc.compare_runs(ref, _map(ref, lambda j, t: t.clone()), AUX, mode="sample", tp=2)
    assert r["checks"]["wrong_layer_far_above_tol"] is False and not r["pass"]
    assert r["min_rel_wrong_layer"] == 0.0


def test_token_mode_tolerates_few_flipped_tokens_sample_mode_does_not() -> None:
    ref = _run(5, n=6)  # 135 tokens
    g = torch.Generator().manual_seed(6)

    def flip(frac: float):
        def f(j: int, t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            k = max(1, int(frac * t.shape[0])) if frac else 0
            t[:k] = torch.randn(k, H, generator=g).to(torch.bfloat16) * 3  # a few tokens routed elsewhere
            return t
        return f

    few = _map(ref, flip(0.03))  # one token of each sample: 6 of 135 = 4.4%
    r = tpc.compare_runs(ref, few, AUX, mode="token", tp=2)
    assert r["token"]["aux2"]["flipped_frac"] == pytest.approx(6 / 135)
    assert tpc.compare_runs(ref, few, AUX, mode="token", tp=2)["pass"]
    assert not tpc.compare_runs(ref, few, AUX, mode="sample", tp=2)["checks"]["every_sample_within_tol"]
    many = _map(ref, flip(0.3))
    r = tpc.compare_runs(ref, many, AUX, mode="token", tp=2)
    assert r["checks"]["flipped_fraction_small"] is False and not r["pass"]


def test_sample_mismatch_fails_with_problem() -> None:
    ref = _run(7, n=3)
    got = dict(_map(ref, lambda j, t: t.clone()))
    got["extra"] = ref["0000"]
    got["0001"] = [t[:-1] for t in got["0001"]]
    r = tpc.compare_runs(ref, got, AUX, mode="sample", tp=2)
    assert not r["pass"] and r["checks"]["samples_match"] is False
    assert r["problems"][0] == "1 candidate samples are not in the reference: ['extra']"
    assert any(p.startswith("sample 0001: shape (11, 32) vs reference (12, 32)") for p in r["problems"])
    with pytest.raises(ValueError):
        tpc.compare_runs(ref, ref, AUX, mode="bogus", tp=1)


# ---- one rank per DP group writes ---------------------------------------------------------------------
def _dump(tmp: Path, ranks: list[tuple[int, bool]], stats: dict[int, dict]) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    for pid, w in ranks:
        (tmp / f"plugin-{pid}.json").write_text(json.dumps({"pid": pid, "writer_rank": w, "aux_layers": AUX}))
    for pid, st in stats.items():
        (tmp / f"stats-{pid}.json").write_text(json.dumps({"requests_failed": 0, "rids_reused": 0, **st}))
    return tmp


def _check(d: Path, **kw) -> dict:
    markers, stats = tpc.read_dump_dir(d)
    return tpc.check_writers(markers, stats, **kw)


def test_writers_tp2_one_writer_passes(tmp_path: Path) -> None:
    d = _dump(tmp_path, [(100, True), (101, False)], {100: {"requests_done": 35}})
    r = _check(d, expected_requests=35, ranks=2, dp_groups=1)
    assert r["pass"] and r["writer_pids"] == [100] and r["non_writer_pids"] == [101]
    assert r["requests_done_by_writer"] == {"100": 35}


def test_writers_both_ranks_writing_fails(tmp_path: Path) -> None:
    # both ranks believe they are the writer: every request written twice
    d = _dump(tmp_path, [(100, True), (101, True)], {100: {"requests_done": 35}, 101: {"requests_done": 35}})
    r = _check(d, expected_requests=35, ranks=2, dp_groups=1)
    assert not r["pass"]
    assert r["checks"]["one_writer_per_dp_group"] is False and r["checks"]["each_request_written_once"] is False
    assert r["requests_done_total"] == 70


def test_writers_non_writer_with_stats_fails(tmp_path: Path) -> None:
    d = _dump(tmp_path, [(100, True), (101, False)], {100: {"requests_done": 35}, 101: {"requests_done": 0}})
    r = _check(d, expected_requests=35, ranks=2, dp_groups=1)
    assert r["checks"] == {"one_marker_per_rank": True, "one_writer_per_dp_group": True,
                           "non_writers_wrote_nothing": False, "each_request_written_once": True,
                           "no_failed_or_reused": True}


def test_writers_missing_rank_missing_requests_and_failures(tmp_path: Path) -> None:
    d = _dump(tmp_path / "a", [(100, True)], {100: {"requests_done": 30}})
    r = _check(d, expected_requests=35, ranks=2, dp_groups=1)
    assert r["checks"]["one_marker_per_rank"] is False and r["checks"]["each_request_written_once"] is False
    d = _dump(tmp_path / "b", [(100, True), (101, False)], {100: {"requests_done": 35, "requests_failed": 1}})
    assert _check(d, expected_requests=35, ranks=2, dp_groups=1)["checks"]["no_failed_or_reused"] is False
    d = _dump(tmp_path / "c", [(100, True), (101, False)], {})  # writer never ran
    r = _check(d, expected_requests=35, ranks=2, dp_groups=1)
    assert not r["pass"] and r["requests_done_total"] == 0


def test_writers_dp_attention(tmp_path: Path) -> None:
    # dp 2 x attention-tp 1: both ranks are attn_tp_rank 0 of their group, each writes its own requests
    d = _dump(tmp_path / "ok", [(100, True), (101, True)], {100: {"requests_done": 17}, 101: {"requests_done": 18}})
    r = _check(d, expected_requests=35, ranks=2, dp_groups=2)
    assert r["pass"] and r["checks"]["every_dp_group_wrote"] is True
    d = _dump(tmp_path / "one", [(100, True), (101, True)], {100: {"requests_done": 35}})
    r = _check(d, expected_requests=35, ranks=2, dp_groups=2)
    assert not r["pass"] and r["checks"]["every_dp_group_wrote"] is False
    d = _dump(tmp_path / "dup", [(100, True), (101, True)], {100: {"requests_done": 35}, 101: {"requests_done": 35}})
    assert _check(d, expected_requests=35, ranks=2, dp_groups=2)["checks"]["each_request_written_once"] is False


# ---- files and the compare command --------------------------------------------------------------------
def test_save_load_roundtrip_exact(tmp_path: Path) -> None:
    run = _run(8, n=3)
    tpc.save_run(tmp_path / "r.safetensors", run)
    back = tpc.load_run(tmp_path / "r.safetensors")
    assert list(back) == sorted(run) and all(
        all(torch.equal(x, y) and x.dtype == torch.bfloat16 for x, y in zip(back[s], run[s])) for s in run)


def _write_run(runs: Path, name: str, caps: dict, tp: int, dp: int, writers_ok: bool = True) -> None:
    tpc.save_run(runs / f"{name}.safetensors", caps)
    (runs / f"{name}.json").write_text(json.dumps({"name": name, "tp": tp, "dp": dp,
                                                   "writers": {"pass": writers_ok, "checks": {}}}))


def test_compare_command(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"n_routed_experts": 8, "num_hidden_layers": 8}))
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    ref = _run(9)
    _write_run(runs, "m-tp1", ref, 1, 1)
    tpc.save_run(runs / "m-tp1-alone.safetensors", {s: ref[s] for s in list(ref)[:2]})
    _write_run(runs, "m-tp2", _map(ref, lambda j, t: t.clone()), 2, 1)
    _write_run(runs, "m-dp2", _map(ref, lambda j, t: t.clone()), 2, 2, writers_ok=False)
    base = ["compare", "--model", str(model), "--name", "m", "--aux", "2", "4", "6", "--runs", str(runs),
            "--out", str(out), "--ref", "m-tp1"]
    assert tpc.main(base + ["--cands", "m-tp2", "m-tp1-alone"]) == 0
    res = json.loads((out / "tp-m.json").read_text())
    assert res["pass"] and res["mode"] == "token" and [c["compare"]["samples"] for c in res["candidates"]] == [6, 2]
    # a candidate whose writer check failed fails the model, even with equal tensors
    assert tpc.main(base + ["--cands", "m-tp2", "m-dp2"]) == 1
    res = json.loads((out / "tp-m.json").read_text())
    assert [c["pass"] for c in res["candidates"]] == [True, False]
    # a candidate run that never finished is a failure that says so
    assert tpc.main(base + ["--cands", "m-missing"]) == 1
    assert "error: `no m-missing.json: the capture run did not finish (see run.log)`" in (out / "tp-m.md").read_text()
    # partial sums in the candidate: exit 1, flagged in the markdown
    _write_run(runs, "m-tp2", _map(ref, lambda j, t: (t.float() / 2).to(torch.bfloat16)), 2, 1)
    assert tpc.main(base + ["--cands", "m-tp2"]) == 1
    assert "**PARTIAL SUM SUSPECTED**" in (out / "tp-m.md").read_text()
