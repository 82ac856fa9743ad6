"""bench/moe_sensitivity.py on a very small tiny-model: fixed routing is the same in every numeric, the
reference is reproducible bit for bit, and the statistics attribute flips to route changes as defined."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "bench" / "moe_sensitivity.py"
_spec = importlib.util.spec_from_file_location("moe_sensitivity", _PATH)
ms = importlib.util.module_from_spec(_spec)
sys.modules["moe_sensitivity"] = ms  # dataclasses resolve the module by name
_spec.loader.exec_module(ms)

SMALL = {"num_hidden_layers": 3, "hidden_size": 64}  # layer 0 dense, layers 1-2 MoE (8 experts, top-2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, list[list[int]]]:
    torch.set_num_threads(1)
    model = ms.load_tiny_model(tmp_path_factory.mktemp("moe"), seed=0, **SMALL)
    prompts = ms.random_prompts(2, 6, 14, model.config.vocab_size, seed=3)
    return model, prompts


def test_fixed_routing_is_identical_in_every_numeric(setup: tuple[torch.nn.Module, list[list[int]]]) -> None:
    model, prompts = setup
    fixed = copy.deepcopy(model)
    ms.fix_routing(fixed)
    assert sorted(ms.moe_gates(fixed)) == [1, 2]
    ref = ms.numerics(fixed, prompts, "bf16_alone")
    # the bias decides: experts 6 and 7 (the two largest biases) for every token, in the reference...
    for t, p in zip(ref, prompts):
        for i in (1, 2):
            assert t.routes[i].tolist() == [[6, 7]] * len(p)
            assert bool((t.margins[i] > 1.0).all())  # 2 (bias gap) minus a sigmoid difference < 1
    for cand in ms.CANDIDATES:
        got = ms.numerics(fixed, prompts, cand, batch=2)
        for r, g in zip(ref, got):
            for i in (1, 2):
                assert torch.equal(r.routes[i], g.routes[i]), (cand, i)
        res = ms.compare(ref, got)
        assert res["route_diff_events"] == 0
        assert res["route_events"] == 2 * sum(map(len, prompts))
    # fp32 compute really is another numeric: the outputs differ, by bf16-rounding amounts
    rel = ms.token_rel(ref, ms.numerics(fixed, prompts, "fp32_alone"))
    assert 0 < float(rel[1].median()) < 5e-2


def test_reference_against_itself_is_exactly_zero(setup: tuple[torch.nn.Module, list[list[int]]]) -> None:
    model, prompts = setup
    a = ms.numerics(model, prompts, "bf16_alone")
    b = ms.numerics(model, prompts, "bf16_alone")
    rels = ms.token_rel(a, b)
    assert len(rels) == SMALL["num_hidden_layers"] + 1  # every decoder layer + the post-norm state
    for r in rels:
        assert r.numel() == sum(map(len, prompts))
        assert torch.count_nonzero(r) == 0
    res = ms.compare(a, b)
    assert res["route_diff_events"] == 0
    assert all(o["max"] == 0.0 and o["flipped"] == 0 for o in res["outputs"].values())


def _trace(hidden: list[list[float]], routes: list[list[int]], margins: list[float]) -> object:
    """A 2-layer trace (layer 0 dense, layer 1 MoE), hidden size 1 per token."""
    hs = [torch.tensor(h).view(-1, 1) for h in hidden]
    return ms.Trace(hidden=hs, routes={1: torch.tensor(routes)}, margins={1: torch.tensor(margins)})


def test_compare_attributes_flips_to_route_changes() -> None:
    ones = [1.0, 1.0, 1.0, 1.0]
    ref = [_trace([ones, ones, ones], [[0, 1]] * 4, [0.5, 0.001, 0.3, 0.4])]
    # token 1 changes route at layer 1 and is off by 50% there; token 2 (after it) by 20%: a cascade via
    # attention, not its own route; token 3 by 5% (not flipped); token 0 by 1%
    got_l1 = [1.01, 1.5, 1.2, 1.05]
    got = [_trace([ones, got_l1, got_l1], [[0, 1], [0, 2], [0, 1], [0, 1]], [0.5, 0.001, 0.3, 0.4])]
    res = ms.compare(ref, got)
    assert res["routing"] == {"layer1": {"tokens_diff": 1, "frac": 0.25}}
    assert res["route_diff_events"] == 1 and res["route_events"] == 4
    l0, l1 = res["outputs"]["layer0"], res["outputs"]["layer1"]
    assert l0["flipped"] == 0 and l0["tokens_route_diff_upto"] == 0 and l0["flipped_with_own_route_diff"] is None
    assert l1["flipped"] == 2 and l1["flipped_frac"] == 0.5
    assert l1["flipped_with_own_route_diff"] == 0.5  # token 1 only
    assert l1["flipped_with_context_route_diff"] == 1.0  # tokens 1 and 2
    assert l1["route_diff_tokens_flipped"] == 1.0
    assert l1["no_context_route_diff"] == {"tokens": 1, "flipped": 0, "max_rel": pytest.approx(0.01, rel=1e-5)}
    assert res["outputs"]["final_post_norm"]["flipped"] == 2
    m = res["margin"]
    assert m["route_diff"]["n"] == 1 and m["route_diff"]["max"] == pytest.approx(0.001)
    assert m["route_diff_primary"]["n"] == 1 and m["route_diff_secondary"] is None
    assert m["route_same"]["n"] == 3 and m["route_same"]["min"] == pytest.approx(0.3)
