"""bench/shared_prefix.py in miniature (issue 37, "what it must show"): agentic conversations rendered with the tiny
model's Kimi template, prepared and extracted flat and shared on the CPU. The shared run stores and computes the
distinct tokens (within 10%: here exactly), the flat run several times more; every shared sample reads back as the
flat run's (ids and mask equal, hidden rows within the dense bound); the family stream yields every sample."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_shared_prefix", ROOT / "bench" / "shared_prefix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tiny_agentic_run_stores_and_computes_each_token_once(tmp_path: Path) -> None:
    pytest.importorskip("tiktoken")  # the kimi tokenizer packaging
    bench = load_bench()
    fig = bench.run(tmp_path, conversations_n=3, min_turns=2, max_turns=4, tool_tokens=200, prompts_per_chunk=3)
    flat, shared, distinct = fig["flat"], fig["shared"], fig["distinct_tokens"]
    turns = sorted(fig["conversations_by_turns"])
    assert fig["conversations"] == 3 and 2 <= turns[0] and turns[-1] <= 4
    assert flat["samples"] == shared["samples"] == 2 * sum(t * n for t, n in fig["conversations_by_turns"].items())
    # one chunk: the declaration and each conversation's history are stored and computed once
    assert abs(shared["stored_tokens"] / distinct - 1) <= 0.1 and abs(shared["computed_tokens"] / distinct - 1) <= 0.1
    assert shared["stored_tokens"] == shared["computed_tokens"] == distinct  # the engine kept every parent's cache
    assert flat["stored_tokens"] == flat["computed_tokens"] == flat["materialized_tokens"] == shared[
        "materialized_tokens"] > 2.5 * distinct
    assert shared["hidden_bytes_per_stored_token"] <= 1.05 * flat["hidden_bytes_per_stored_token"]
    # the same rows cost what today's flat format costs them (the v2 index's references: a few bytes a sample)
    same = shared["same_rows"]
    assert same["tokens"] == distinct and same["v2_hidden_bytes_per_token"] <= 1.01 * same["v1_hidden_bytes_per_token"]
    # the flat run batches with padding, the shared one computes suffixes on caches: bf16 rounding. On the samples
    # furthest apart, the shared rows are within the dense bound of an independent full forward (measured 5.1e-3, the
    # flat run's padded batches 5.3e-3 there; 8.6e-3 and 1.1e-2 with the tiny model's former head widths), so flat
    # and shared within twice it. Bit-identical is possible: on an AVX-512-BF16 EPYC both round alike (all 0.0)
    assert fig["checked_full"] == 8 and max(fig["against_full_forward"]["shared"]) <= bench.TOL
    assert max(fig["worst_relative_error"]) <= 2 * bench.TOL
    assert fig["one_layer_shift"] > 10 * bench.TOL  # the comparison sees a wrong layer
    text = bench.report(fig)
    assert f"| stored tokens | {flat['stored_tokens']:,} | {shared['stored_tokens']:,} | 1.000 |" in text
    # --no-flat-extract (the size): the flat run prepared only gives the same token counts and curves
    quick = bench.run(tmp_path / "quick", conversations_n=3, min_turns=2, max_turns=4, tool_tokens=200,
                      prompts_per_chunk=3, flat_extract=False)
    for key in ("stored_tokens", "computed_tokens", "materialized_tokens", "samples", "per_conversation",
                "per_conversation_beyond_opening", "slope", "slope_beyond_opening", "by_turns"):
        assert quick["flat"][key] == flat[key], key
    assert quick["shared"]["stored_tokens"] == quick["shared"]["computed_tokens"] == distinct
    assert "samples_bit_identical" not in quick and "| shard bytes | not extracted |" in bench.report(quick)
