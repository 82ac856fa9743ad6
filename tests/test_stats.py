"""Statistics of shards: exact sums on known tensors, exact aggregation, token_freq, plots."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from hsextract.report.plots import plot_rms_by_position, plot_seq_length_hist
from hsextract.report.stats import aggregate, chunk_stats, token_freq, write_table, write_token_freq
from hsextract.shard import ShardWriter

HIDDEN = 8
META = {
    "model": "m", "engine": "transformers", "engine_version": "test", "aux_layers": [0, 2],
    "final_state": "post_norm", "hidden_size": HIDDEN, "dtype": "bfloat16", "config_hash": "c",
    "tokenizer_hash": "t", "chat_template_hash": "h",
}


def write_shard(path: Path, samples: list[tuple[list[int], list[int], list[float]]], chunk: int) -> Path:
    """Each sample: ids, mask, and one constant value per tensor (so RMS and abs max are known)."""
    with ShardWriter(path, metadata={**META, "chunk": chunk}) as w:
        for k, (ids, mask, values) in enumerate(samples):
            seq = len(ids)
            hs = [torch.full((seq, HIDDEN), v, dtype=torch.bfloat16) for v in values]
            w.add(input_ids=torch.tensor(ids), hidden_states=hs, loss_mask=torch.tensor(mask),
                  sample_id=f"s{chunk}-{k}")
    return path


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    a = write_shard(tmp_path / "a.hss",
                    [([5, 6, 7], [0, 1, 1], [1.0, -2.0, 0.5]), ([5, 9], [0, 1], [3.0, 2.0, -0.5])], 0)
    b = write_shard(tmp_path / "b.hss", [([7, 7, 7, 7, 8], [1, 1, 0, 1, 1], [1.0, 1.0, 4.0])], 1)
    return [a, b]


def test_chunk_stats_values(shards: list[Path]) -> None:
    s = chunk_stats(shards[0], position_bins=2)
    assert (s["samples"], s["tokens"], s["trained_tokens"], s["seq_lengths"], s["trained_lengths"]) == (
        2, 5, 3, [3, 2], [2, 1])
    assert (s["format_version"], s["stored_tokens"]) == (1, 5)  # flat: every token stored
    assert s["token_freq"] == {"6": 1, "7": 1, "9": 1}
    assert [t["name"] for t in s["tensors"]] == ["hidden_states[0]", "hidden_states[2]", "final_post_norm"]
    # sum of squares: value^2 * hidden * tokens, summed over samples
    assert [t["sum_sq"] for t in s["tensors"]] == [(1 * 3 + 9 * 2) * HIDDEN, (4 * 3 + 4 * 2) * HIDDEN,
                                                   (0.25 * 3 + 0.25 * 2) * HIDDEN]
    assert [t["abs_max"] for t in s["tensors"]] == [3.0, 2.0, 0.5]
    assert [t["nonfinite"] for t in s["tensors"]] == [0, 0, 0]
    # positions 0-1 (both samples) and 2 (first sample only)
    assert s["position_tokens"] == [4, 1]
    assert s["position_sum_sq"][0] == [(1 + 1 + 9 + 9) * HIDDEN, 1 * HIDDEN]
    assert s["bytes_raw"] == 5 * 16 + 3 * 5 * HIDDEN * 2
    assert s["bytes_stored"] == shards[0].stat().st_size


def test_aggregate_is_exact_over_chunks(shards: list[Path], tmp_path: Path) -> None:
    stats = [chunk_stats(p, position_bins=2) for p in shards]
    tables = aggregate(stats, {"dropped": {"too_long": 2, "no_trained_tokens": 5, "duplicate": 1}})
    summary = dict(zip(tables["summary"]["metric"], tables["summary"]["value"], strict=True))
    # a duplicate drops a whole record (all its samples), the filters one sample each: never added up
    assert (summary["chunks"], summary["samples"], summary["tokens"], summary["trained_tokens"],
            summary["dropped_samples"], summary["dropped_records"]) == (2, 3, 10, 7, 7, 1)
    assert (summary["stored_tokens"], summary["share_saving"]) == (10, 1.0)
    raw = sum(s["bytes_raw"] for s in stats)
    stored = sum(p.stat().st_size for p in shards)
    assert (summary["bytes_raw"], summary["bytes_stored"]) == (raw, stored)
    assert summary["stored_over_raw"] == round(stored / raw, 4)
    layers = tables["layers"].set_index("tensor")
    # hidden_states[0]: squares 1 (3 tok), 9 (2 tok), 1 (5 tok) over 10 tokens
    assert layers.loc["hidden_states[0]", "rms"] == pytest.approx(math.sqrt((3 + 18 + 5) / 10))
    assert layers.loc["final_post_norm", "abs_max"] == 4.0
    assert list(tables["dropped"].itertuples(index=False, name=None)) == [
        ("no_trained_tokens", 5, "sample"), ("too_long", 2, "sample"), ("duplicate", 1, "record")]
    pos = tables["rms_by_position"]
    assert list(pos["position_start"]) == [0, 2, 4] and list(pos["tokens"]) == [6, 3, 1]
    # final tensor at position bin 2 (positions 2,3): sample a pos 2 (0.25) and sample b pos 2,3 (16)
    assert pos.loc[1, "final_post_norm"] == pytest.approx(math.sqrt((0.25 + 16 + 16) / 3))
    seq = dict(zip(tables["seq_lengths"]["statistic"], tables["seq_lengths"]["tokens"], strict=True))
    assert (seq["q00"], seq["q50"], seq["q100"], seq["mean"]) == (2.0, 3.0, 5.0, 10 / 3)
    write_table(tables["layers"], tmp_path / "layers.tsv")
    back = pd.read_csv(tmp_path / "layers.tsv", sep="\t")
    assert list(back["tensor"]) == ["hidden_states[0]", "hidden_states[2]", "final_post_norm"]


def test_token_freq_over_trained_tokens(shards: list[Path], tmp_path: Path) -> None:
    stats = [chunk_stats(p) for p in shards]
    assert token_freq(stats) == {6: 1, 7: 4, 8: 1, 9: 1}
    write_token_freq(stats, tmp_path / "token_freq.pt")
    assert torch.load(tmp_path / "token_freq.pt", weights_only=True) == {6: 1, 7: 4, 8: 1, 9: 1}


def test_plots_are_pngs(shards: list[Path], tmp_path: Path) -> None:
    stats = [chunk_stats(p, position_bins=2) for p in shards]
    tables = aggregate(stats, {"dropped": {}})
    plot_seq_length_hist(stats, tmp_path / "h.png", bins=5)
    plot_rms_by_position(tables["rms_by_position"], tmp_path / "r.png")
    for name in ("h.png", "r.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_seq_length_histogram_series_share_bin_edges_and_legend_is_off_the_data(shards: list[Path]) -> None:
    from hsextract.report.plots import seq_length_figure

    stats = [chunk_stats(p) for p in shards]
    fig = seq_length_figure(stats, bins=4)
    ax = fig.axes[0]
    # lengths 3, 2, 5 and trained 2, 1, 4: one set of edges over 1..5 for both series
    edges = [[round(b.get_x(), 6) for b in container] for container in ax.containers]
    assert edges == [[1.0, 2.0, 3.0, 4.0]] * 2
    assert [[b.get_height() for b in c] for c in ax.containers] == [[0, 1, 1, 1], [1, 1, 0, 1]]
    assert_legend_outside(fig)


def assert_legend_outside(fig) -> None:
    fig.canvas.draw()
    ax = fig.axes[0]
    legend, area = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 > area.x1, (legend, area)  # right of the axes: covers no line or bar


def test_rms_plot_legend_is_off_the_data(shards: list[Path]) -> None:
    from hsextract.report.plots import rms_figure

    tables = aggregate([chunk_stats(p, position_bins=2) for p in shards], {"dropped": {}})
    assert_legend_outside(rms_figure(tables["rms_by_position"]))


def test_report_pages_hold_the_tables_and_the_validation_summary(shards: list[Path], tmp_path: Path) -> None:
    import json

    from hsextract.report.tables import write_report_pages
    from hsextract.report.validate import CHECKS

    tables = aggregate([chunk_stats(p) for p in shards], {"dropped": {"too_long": 2, "duplicate": 1}})
    reports = []
    for i, (passed, failed) in enumerate([(True, {}), (False, {"finite": 3, "zero_row": 1})]):
        r = {"shard": f"shards/chunk-{i:05d}.hss", "passed": passed, "num_samples": 10 + i,
             "checks": {c: {"failed": failed.get(c, 0), "first": None} for c in CHECKS}}
        reports.append(tmp_path / f"v{i}.json")
        reports[-1].write_text(json.dumps(r))
    names = ("summary", "chunks", "layers", "seq_lengths", "dropped", "validation")
    paths = {n: tmp_path / f"{n}.html" for n in names}
    write_report_pages(tables, reports, paths)
    page = {n: paths[n].read_text() for n in names}
    assert "<th>metric</th><th>value</th>" in page["summary"]
    assert '<tr><td>samples</td><td class="num">3</td></tr>' in page["summary"]
    assert "<th>stored_over_raw</th>" in page["chunks"]
    # chunk, samples, tokens, stored tokens (version 1: every token), trained tokens
    assert ('<tr><td class="num">1</td><td class="num">1</td><td class="num">5</td><td class="num">5</td>'
            '<td class="num">4</td>') in page["chunks"]
    assert '<tr><td>hidden_states[0]</td><td class="num">' in page["layers"]
    assert ('<tr><td>too_long</td><td class="num">2</td><td>sample</td></tr><tr><td>duplicate</td><td class="num">1'
            '</td><td>record</td></tr>') in page["dropped"]
    v = page["validation"]
    assert '<p class="failed">1 of 2 shards passed validation (21 samples).</p>' in v
    assert "<li>shards/chunk-00001.hss</li>" in v
    assert '<tr><td>finite</td><td class="num">1</td><td class="num">3</td></tr>' in v
    assert '<tr><td>integrity</td><td class="num">2</td><td class="num">0</td></tr>' in v
    assert v.startswith("<!DOCTYPE html>") and "<h1>Validation</h1>" in v
