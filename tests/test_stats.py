"""Statistics of shards: exact sums on known tensors, exact aggregation, token_freq, plots."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import torch

from hsextract.prepare.vocab import save_token_freq
from hsextract.report.plots import plot_rms_by_position, plot_seq_length_hist
from hsextract.report.stats import ChunkTotals, chunk_stats, write_table
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
    tables = ChunkTotals(stats).tables({"dropped": {"too_long": 2, "no_trained_tokens": 5, "duplicate": 1}})
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
    assert ChunkTotals(stats).token_freq() == {6: 1, 7: 4, 8: 1, 9: 1}
    save_token_freq(ChunkTotals(stats).token_freq(), tmp_path / "token_freq.pt")
    assert torch.load(tmp_path / "token_freq.pt", weights_only=True) == {6: 1, 7: 4, 8: 1, 9: 1}


def test_plots_are_pngs(shards: list[Path], tmp_path: Path) -> None:
    stats = [chunk_stats(p, position_bins=2) for p in shards]
    tables = ChunkTotals(stats).tables({"dropped": {}})
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

    tables = ChunkTotals([chunk_stats(p, position_bins=2) for p in shards]).tables({"dropped": {}})
    assert_legend_outside(rms_figure(tables["rms_by_position"]))


def test_report_pages_hold_the_tables_and_the_validation_summary(shards: list[Path], tmp_path: Path) -> None:
    import json

    from hsextract.report.tables import write_report_pages
    from hsextract.report.validate import CHECKS

    tables = ChunkTotals([chunk_stats(p) for p in shards]).tables({"dropped": {"too_long": 2, "duplicate": 1}})
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


# --- aggregation one chunk at a time (ChunkTotals over iter_json_files) -------------------------------------------

def _aggregate_whole_list(chunks, prepare_summary):
    """stats.aggregate as it was when every chunk's statistics were held in one list: the reference the running
    totals must match to the byte."""
    import numpy as np

    from hsextract.prepare import drops
    from hsextract.prepare.prefix_share import codec_ratio, raw_stored, share_saving, stored_tokens
    from hsextract.report.stats import SEQ_QUANTILES, _dropped

    per_chunk = pd.DataFrame(
        [
            {"chunk": c["chunk"], "samples": c["samples"], "tokens": c["tokens"],
             "stored_tokens": stored_tokens(c), "trained_tokens": c["trained_tokens"], "bytes_raw": c["bytes_raw"],
             "bytes_raw_stored": raw_stored(c), "bytes_stored": c["bytes_stored"]}
            for c in chunks
        ]
    )
    for col, raw in (("stored_over_raw", "bytes_raw"), ("codec_ratio", "bytes_raw_stored")):
        per_chunk[col] = (per_chunk["bytes_stored"] / per_chunk[raw].where(per_chunk[raw] > 0)).round(4)
    names = [t["name"] for t in chunks[0]["tensors"]]
    tensors = pd.DataFrame([dict(t, chunk=c["chunk"]) for c in chunks for t in c["tensors"]])
    by_name = tensors.groupby("name", sort=False).agg(
        sum_sq=("sum_sq", "sum"), count=("count", "sum"), abs_max=("abs_max", "max"), nonfinite=("nonfinite", "sum")
    ).reindex(names)
    layers = pd.DataFrame(
        {
            "tensor": names,
            "rms": np.sqrt(by_name["sum_sq"] / by_name["count"].clip(lower=1)).to_numpy(),
            "abs_max": by_name["abs_max"].to_numpy(),
            "nonfinite": by_name["nonfinite"].astype("int64").to_numpy(),
        }
    )
    bin_size = int(chunks[0]["position_bins"])
    n_bins = max(len(c["position_tokens"]) for c in chunks)
    tok = np.zeros(n_bins, dtype=np.int64)
    sq = np.zeros((len(names), n_bins))
    for c in chunks:
        m = len(c["position_tokens"])
        tok[:m] += np.asarray(c["position_tokens"], dtype=np.int64)
        if m:
            sq[:, :m] += np.asarray(c["position_sum_sq"], dtype=np.float64)
    hidden = int(chunks[0]["hidden_size"])
    rms_pos = pd.DataFrame({"position_start": np.arange(n_bins) * bin_size, "tokens": tok})
    for k, name in enumerate(names):
        rms_pos[name] = np.sqrt(sq[k] / np.maximum(tok * hidden, 1))
    lengths = np.asarray([n for c in chunks for n in c["seq_lengths"]], dtype=np.int64)
    if lengths.size:
        qs = np.quantile(lengths, SEQ_QUANTILES)
        seq = pd.DataFrame({"statistic": [f"q{int(q * 100):02d}" for q in SEQ_QUANTILES] + ["mean"],
                            "tokens": [float(v) for v in qs] + [float(lengths.mean())]})
    else:
        seq = pd.DataFrame({"statistic": [], "tokens": []})
    dropped = _dropped(prepare_summary)
    tokens, stored = int(per_chunk["tokens"].sum()), int(per_chunk["stored_tokens"].sum())
    tot_raw, tot_stored = int(per_chunk["bytes_raw"].sum()), int(per_chunk["bytes_stored"].sum())
    totals = {
        "chunks": len(chunks),
        "samples": int(per_chunk["samples"].sum()),
        "tokens": tokens,
        "stored_tokens": stored,
        "share_saving": share_saving(tokens, stored),
        "trained_tokens": int(per_chunk["trained_tokens"].sum()),
        **drops.totals(prepare_summary.get("dropped") or {}),
        "bytes_raw": tot_raw,
        "bytes_stored": tot_stored,
        "stored_over_raw": round(tot_stored / tot_raw, 4) if tot_raw else float("nan"),
        "codec_ratio": codec_ratio(tot_stored, per_chunk["bytes_raw_stored"].sum(skipna=False)),
        "hidden_size": hidden,
        "tensors_per_sample": len(names),
    }
    summary = pd.DataFrame({"metric": list(totals), "value": pd.Series(list(totals.values()), dtype=object)})
    return {"summary": summary, "chunks": per_chunk, "layers": layers, "rms_by_position": rms_pos,
            "seq_lengths": seq, "dropped": dropped}


TENSORS = ["hidden_states[1]", "hidden_states[3]", "final_post_norm"]


def synthetic_chunk(k: int, samples: int, vocab: int = 500, freq_entries: int = 50, bin_size: int = 4) -> dict:
    """chunk_stats' dict without a shard: random lengths, and sums of magnitudes far apart (so the order and
    method of summation show in the last bits), the newest release's keys (stored_tokens, bytes_raw_stored)."""
    import random

    rng = random.Random(k)

    def wide() -> float:
        return rng.random() * rng.choice([1.0, 1e3, 1e16])
    seq = [rng.randint(1, 40) for _ in range(samples)]
    trained = [rng.randint(0, n) for n in seq]
    n_bins = (max(seq, default=0) + bin_size - 1) // bin_size
    tokens = sum(seq)
    return {
        "shard": f"shards/chunk-{k:05d}.hss", "chunk": k, "aux_layers": [1, 3], "layer_convention": "hidden_states",
        "final_state": "post_norm", "hidden_size": HIDDEN, "format_version": 2, "samples": samples,
        "tokens": tokens, "stored_tokens": tokens - rng.randint(0, tokens // 2), "trained_tokens": sum(trained),
        "seq_lengths": seq, "trained_lengths": trained, "bytes_raw": 1000 * tokens + k,
        "bytes_raw_stored": 900 * tokens + k, "bytes_stored": 400 * tokens + k,
        "tensors": [{"name": n, "sum_sq": wide(), "count": tokens * HIDDEN,
                     "abs_max": rng.random() * 100, "nonfinite": rng.choice([0, 0, 3])} for n in TENSORS],
        "position_bins": bin_size,
        "position_tokens": [rng.randint(1, samples + 1) for _ in range(n_bins)],
        "position_sum_sq": [[wide() for _ in range(n_bins)] for _ in TENSORS],
        "token_freq": {str(t): rng.randint(1, 99) for t in sorted(rng.sample(range(vocab), min(freq_entries, vocab)))},
    }


def chunk_sets() -> dict[str, list[dict]]:
    chunks = [synthetic_chunk(k, samples=k % 4 + 1) for k in range(14)]
    chunks[2] = synthetic_chunk(2, samples=0)  # an empty chunk: no bins, no lengths, no token counts, no bytes
    chunks[2].update(bytes_raw=0, bytes_raw_stored=0, token_freq={},
                     tensors=[dict(t, sum_sq=0.0, abs_max=0.0, nonfinite=0) for t in chunks[2]["tensors"]])
    chunks[9] = synthetic_chunk(9, samples=30)  # the most bins, mid-way: the position sums grow
    for c in chunks[4:7]:  # an earlier release's statistics, of flat (version 1) shards: every token stored
        c.update(format_version=1, stored_tokens=c["tokens"])
        del c["bytes_raw_stored"]
    del chunks[5]["stored_tokens"]  # older still: stored tokens not said either
    older_shared = [dict(c) for c in chunks]  # and one of a shared-prefix shard without bytes_raw_stored: unknown
    del older_shared[11]["bytes_raw_stored"]
    return {"mixed": chunks, "older_shared": older_shared, "empty_first": [chunks[2], *chunks[:2]],
            "only_empty": [chunks[2]], "one": [chunks[9]]}


@pytest.mark.parametrize("name", list(chunk_sets()))
def test_chunk_totals_over_files_equal_the_whole_list(name: str, tmp_path: Path) -> None:
    """aggregate_stats reads the chunk statistics one file at a time (iter_json_files into ChunkTotals): every
    table, token_freq.pt and the histogram's data are what the whole list of statistics gave, to the byte."""
    import io
    import json

    import numpy as np

    from hsextract.report.plots import seq_length_figure
    from hsextract.report.stats import ChunkTotals, iter_json_files
    from hsextract.report.tables import table_html

    paths = []
    for k, c in enumerate(chunk_sets()[name]):
        paths.append(tmp_path / f"c{k}.json")
        paths[-1].write_text(json.dumps(c))
    whole = [json.loads(p.read_text()) for p in paths]
    prep = {"dropped": {"too_long": 2, "duplicate": 1}}
    want = _aggregate_whole_list(whole, prep)
    totals = ChunkTotals(iter_json_files(paths))
    got = totals.tables(prep)
    assert list(got) == list(want)
    for t in want:
        pd.testing.assert_frame_equal(got[t], want[t], check_exact=True)
        write_table(want[t], tmp_path / "want.tsv")
        write_table(got[t], tmp_path / "got.tsv")
        assert (tmp_path / "got.tsv").read_bytes() == (tmp_path / "want.tsv").read_bytes(), t
        assert table_html(got[t]) == table_html(want[t]), t
    for k, v in zip(want["summary"]["value"], got["summary"]["value"], strict=True):  # None stays None, not NaN
        assert type(k) is type(v)

    before: Counter[int] = Counter()
    for c in whole:
        before.update({int(t): int(n) for t, n in c["token_freq"].items()})
    saved = io.BytesIO()
    torch.save(dict(sorted(before.items())), saved)
    save_token_freq(totals.token_freq(), tmp_path / "token_freq.pt")
    assert (tmp_path / "token_freq.pt").read_bytes() == saved.getvalue()
    assert ChunkTotals(iter_json_files(paths)).token_freq() == totals.token_freq()

    lengths = np.asarray([n for c in whole for n in c["seq_lengths"]], dtype=np.int64)
    trained = np.asarray([n for c in whole for n in c["trained_lengths"]], dtype=np.int64)
    edges = np.histogram_bin_edges(np.concatenate([lengths, trained]), bins=7)
    fig = seq_length_figure(iter_json_files(paths), bins=7)
    bars = fig.axes[0].containers
    for series, container in zip((lengths, trained), bars, strict=True):
        assert [b.get_height() for b in container] == list(np.histogram(series, edges)[0])
        assert [b.get_x() for b in container] == pytest.approx(list(edges[:-1]), abs=1e-9)  # bar at its left edge


def test_chunk_totals_hold_one_chunk_not_all(tmp_path: Path) -> None:
    """Peak memory of the aggregation (tracemalloc) over 4N chunk files is that over N plus less than one chunk's
    parsed statistics: the chunks are read and folded one at a time, never held together."""
    import json
    import tracemalloc

    from hsextract.report.stats import ChunkTotals, iter_json_files

    paths = []
    for k in range(40):
        paths.append(tmp_path / f"c{k}.json")
        paths[-1].write_text(json.dumps(synthetic_chunk(k, samples=4, vocab=8000, freq_entries=5000)))

    def peak(fn) -> int:
        tracemalloc.start()
        try:
            fn()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def fold(files: list[Path]) -> None:
        totals = ChunkTotals(iter_json_files(files))
        totals.tables({})
        totals.token_freq()

    fold(paths[:2])  # first use: pandas' lazily built caches and imports, outside the measurements
    one_chunk = peak(lambda: json.loads(paths[0].read_text()))
    few, many = peak(lambda: fold(paths[:10])), peak(lambda: fold(paths))
    assert many - few < one_chunk, (few, many, one_chunk)


def test_chunk_stats_by_blocks_of_rows_equal_the_whole_tensor_at_once(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A long sample's tensors are taken to float64 a block of rows at a time (memory: a Kimi-K2.5 sample is GBs):
    every figure equal to one block of the whole tensor, non-finite values in a later block counted and left out."""
    from hsextract.report import stats

    g = torch.Generator().manual_seed(3)
    with ShardWriter(tmp_path / "s.hss", metadata={**META, "chunk": 0}) as w:
        for k, seq in enumerate((7, 12, 1)):
            hs = [torch.randn(seq, HIDDEN, generator=g).mul(3).to(torch.bfloat16) for _ in range(3)]
            if k == 1:
                hs[1][9, 2], hs[2][10, 0] = float("nan"), float("inf")
            w.add(input_ids=torch.arange(seq), hidden_states=hs, loss_mask=torch.ones(seq, dtype=torch.long),
                  sample_id=f"s{k}")
    whole = chunk_stats(tmp_path / "s.hss", position_bins=4)
    monkeypatch.setattr(stats, "BLOCK_VALUES", 2 * HIDDEN)  # two rows a block: blocks end inside every sample
    assert chunk_stats(tmp_path / "s.hss", position_bins=4) == whole
    assert [t["nonfinite"] for t in whole["tensors"]] == [0, 1, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunk_stats_blocks_leave_no_row_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               dtype: torch.dtype) -> None:
    """A block of a single row sums in another order than the whole tensor does (wide rows, several threads):
    blocks keep two rows or more, so a wide model's figures equal the whole tensor's to the bit."""
    from hsextract.report import stats

    hidden, g = 33_000, torch.Generator().manual_seed(5)
    with ShardWriter(tmp_path / "w.hss", metadata={**META, "chunk": 0, "hidden_size": hidden,
                                                   "dtype": str(dtype).removeprefix("torch.")}) as w:
        for k, seq in enumerate((5, 3, 1)):
            hs = [torch.randn(seq, hidden, generator=g).mul(1 + 100 * torch.rand(hidden, generator=g)).to(dtype)
                  for _ in range(3)]
            w.add(input_ids=torch.arange(seq), hidden_states=hs, loss_mask=torch.ones(seq, dtype=torch.long),
                  sample_id=f"s{k}")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        whole = chunk_stats(tmp_path / "w.hss")
        monkeypatch.setattr(stats, "BLOCK_VALUES", hidden)  # a row a block, asked for: two given
        assert chunk_stats(tmp_path / "w.hss") == whole
        monkeypatch.setattr(stats, "BLOCK_VALUES", 2 * hidden)  # 5 rows: 2 and 3, not 2, 2 and 1
        assert chunk_stats(tmp_path / "w.hss") == whole
    finally:
        torch.set_num_threads(threads)
