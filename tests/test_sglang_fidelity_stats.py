"""bench/gpu/fidelity.py's statistics and checks on synthetic hidden states (values known by construction)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hsextract.engines.base import Captured, Prompt

_spec = importlib.util.spec_from_file_location("fidelity", Path(__file__).parents[1] / "bench" / "gpu" / "fidelity.py")
fid = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fid)

AUX, H = (1, 3), 8


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


def test_token_rel_and_dist_values() -> None:
    ref = torch.ones(4, H)
    got = ref.clone()
    got[1] *= 1.05  # rel 0.05
    got[2] *= 1.5  # rel 0.5: flipped
    e = fid.token_rel(got, ref)
    assert torch.allclose(e, torch.tensor([0.0, 0.05, 0.5, 0.0]), atol=1e-6)
    d = fid.dist(e)
    assert d["tokens"] == 4 and d["flipped_frac"] == 0.25 and d["max"] == pytest.approx(0.5)
    assert d["median"] == pytest.approx(0.025, abs=1e-6)  # midpoint of 0 and 0.05


def _case(flip_every: int | None, wrong_layer: bool = False):
    prompts, got, refs = [], [], []
    for i, n in enumerate([5, 40, 120]):
        prompts.append(Prompt(i, f"s{i}", list(range(n))))
        aux = [_rows(n, 10 * i + j) for j in range(len(AUX))]
        wrong = [_rows(n, 100 + 10 * i + j) for j in range(len(AUX))]
        pre = _rows(n, 1000 + i) * 3
        post = pre / pre.norm(dim=-1, keepdim=True)
        g = [(w if wrong_layer else a) * 1.005 for a, w in zip(aux, wrong)] + [post * 1.005]
        if flip_every:
            for t in g:
                t[::flip_every] += 0.5 * t[::flip_every].norm(dim=-1, keepdim=True)  # rel ~0.5 on those tokens
        got.append(Captured(i, f"s{i}", [t.to(torch.bfloat16) for t in g]))
        refs.append({"aux": aux, "wrong": wrong, "pre": pre, "post": post})
    return prompts, got, refs


def _eval(prompts, got, refs, mode: str) -> dict:
    return fid.evaluate(prompts, got, got[:2], refs, AUX, tol=2e-2, token_tol=2e-2, flip_bound=0.05, mode=mode,
                        long_from=100)


def test_moe_like_flips_fail_per_sample_but_pass_per_token() -> None:
    prompts, got, refs = _case(flip_every=50)  # 3% of tokens flipped, the rest within 5e-3 + bf16 rounding
    r = _eval(prompts, got, refs, "token")
    assert r["checks_sample"]["right_layers_within_tol"] is False  # a flipped token dominates a sample's norm
    assert all(r["checks_token"].values()), r["checks_token"]
    right = r["token"]["right"]
    assert set(right) == {"aux1", "aux3", "final_post_norm"}
    for d in right.values():
        assert d["tokens"] == 165 and d["median"] < 8e-3
        assert d["flipped_frac"] == pytest.approx(5 / 165)  # row 0 of 5, row 0 of 40, rows 0, 50, 100 of 120
    assert r["token"]["neighbouring_layer"]["aux1"]["flipped_frac"] > 0.9
    assert r["token"]["final_vs_pre_norm"]["median"] > 0.5
    assert r["checks"] == r["checks_token"]
    assert [s["flipped_tokens"] for s in r["per_sample"]] == [[1, 1, 1], [1, 1, 1], [3, 3, 3]]


def test_too_many_flips_and_wrong_layer_fail() -> None:
    r = _eval(*_case(flip_every=5), "token")  # 20% flipped
    assert r["checks_token"]["flipped_fraction_small"] is False
    r = _eval(*_case(flip_every=None, wrong_layer=True), "token")
    assert r["checks_token"]["token_median_within_tol"] is False
    assert r["checks_token"]["wrong_layer_median_10x"] is False


def test_dense_clean_case_passes_sample_checks() -> None:
    r = _eval(*_case(flip_every=None), "sample")
    assert r["checks"] == r["checks_sample"] and all(r["checks"].values())
    assert r["batch_invariance_max_rel"] == 0.0 and r["long_samples_max_rel"] < 1e-2


def test_is_moe_and_neighbours(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"n_routed_experts": 8, "num_hidden_layers": 10}')
    assert fid.is_moe(str(tmp_path)) and fid.num_layers_of(str(tmp_path)) == 10
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 8}')
    assert not fid.is_moe(str(tmp_path))
    assert fid.neighbours((1, 3, 7), 8) == [2, 4, 6]
