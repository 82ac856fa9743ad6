"""extract_chunk: prompts + an engine -> one shard; engine contract violations are errors, never data."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hsextract.engines.base import Captured, Engine, Prompt
from hsextract.errors import EngineError, ShardError
from hsextract.extract.run import ChunkPrompts, extract_chunk, read_prompts
from hsextract.report.stats import chunk_stats
from hsextract.report.validate import validate_shard
from hsextract.shard import ShardReader

HIDDEN = 16
META = {
    "model": "m", "engine": "test", "engine_version": "0", "aux_layers": [0, 1], "final_state": "post_norm",
    "hidden_size": HIDDEN, "dtype": "bfloat16", "config_hash": "c", "tokenizer_hash": "t",
    "chat_template_hash": "h", "vocab_size": 100,
}


class FakeEngine(Engine):
    """Deterministic activations from the ids; `pad` leaves padding rows on, `swap` breaks the order."""

    name = "test"

    def __init__(self, pad: int = 0, swap: bool = False) -> None:
        self.pad, self.swap = pad, swap

    def version(self) -> str:
        return "0"

    def extract(self, prompts: Iterable[Prompt]) -> Iterator[Captured]:
        out = []
        for p in prompts:
            ids = torch.tensor(p.input_ids + [0] * self.pad, dtype=torch.float32)
            hs = [(ids[:, None] * (k + 1) + torch.arange(HIDDEN)).to(torch.bfloat16) for k in range(3)]
            out.append(Captured(p.index, p.sample_id, hs))
        if self.swap:
            out[0], out[1] = out[1], out[0]
        yield from out


def prompts(n: int = 3) -> ChunkPrompts:
    ids = [[1 + i, 2, 3 + i][: 2 + i % 2] + [7] * i for i in range(n)]
    return ChunkPrompts([f"s:{i}" for i in range(n)], ids, [[0] + [1] * (len(x) - 1) for x in ids])


def test_writes_every_sample_in_order(tmp_path: Path) -> None:
    p = prompts(4)
    summary = extract_chunk(p, tmp_path / "c.hss", FakeEngine(), META, progress=False)
    r = ShardReader(tmp_path / "c.hss")
    assert r.sample_ids == p.sample_ids and summary["samples"] == 4
    assert summary["tokens"] == sum(map(len, p.input_ids)) and summary["trained_tokens"] == sum(map(sum, p.loss_masks))
    for i in range(4):
        s = r[i]
        assert s["input_ids"].tolist() == p.input_ids[i] and s["loss_mask"].tolist() == p.loss_masks[i]
        ids = torch.tensor(p.input_ids[i], dtype=torch.float32)
        assert torch.equal(s["hidden_states"][2], (ids[:, None] * 3 + torch.arange(HIDDEN)).to(torch.bfloat16))
    assert validate_shard(tmp_path / "c.hss", _reference(tmp_path))["passed"]


def test_summary_says_where_the_time_went(tmp_path: Path) -> None:
    """A slow engine shows as engine_wait_s, a slow shard writer as shard_add_s / shard_close_s."""

    class SlowEngine(FakeEngine):
        def extract(self, prompts):
            for c in super().extract(prompts):
                time.sleep(0.2)
                yield c

    s = extract_chunk(prompts(4), tmp_path / "c.hss", SlowEngine(), META, progress=False)
    assert 0.8 <= s["engine_wait_s"] <= s["seconds"]
    assert s["shard_add_s"] + s["shard_close_s"] < 0.5 < s["engine_wait_s"] - 0.3
    # each figure is rounded to the millisecond on its own: their sum may pass the rounded total by 1.5 ms
    assert s["engine_wait_s"] + s["shard_add_s"] + s["shard_close_s"] <= s["seconds"] + 0.0015


def _reference(tmp_path: Path) -> Path:
    ref = tmp_path / "ref.pt"
    torch.save({"input_ids": torch.arange(4), "hidden_states": [torch.zeros(4, 8, dtype=torch.bfloat16)] * 3,
                "loss_mask": torch.ones(4, dtype=torch.int64)}, ref)
    return ref


def test_padding_left_on_is_an_error_and_leaves_no_shard(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"sample s:0: engine returned tensors \[\(4, 16\), \(4, 16\), \(4, 16\)\], "
                                          r"expected 3 of \(2, 16\); padding must be sliced off"):
        extract_chunk(prompts(), tmp_path / "c.hss", FakeEngine(pad=2), META, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_out_of_order_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"engine returned sample 's:1' \(index 1\) where 's:0' \(index 0\) was due"):
        extract_chunk(prompts(), tmp_path / "c.hss", FakeEngine(swap=True), META, progress=False)
    assert not (tmp_path / "c.hss").exists()


def test_empty_chunk_gives_an_empty_valid_shard(tmp_path: Path) -> None:
    summary = extract_chunk(ChunkPrompts([], [], []), tmp_path / "c.hss", FakeEngine(), META, progress=False)
    assert summary["samples"] == 0 and len(ShardReader(tmp_path / "c.hss")) == 0
    s = chunk_stats(tmp_path / "c.hss")
    assert (s["samples"], s["tokens"], s["position_tokens"]) == (0, 0, [])
    assert validate_shard(tmp_path / "c.hss", _reference(tmp_path))["passed"]


def test_read_prompts(tmp_path: Path) -> None:
    table = pa.table({"sample_id": ["a", "b"], "input_ids": [[1, 2], [3]],
                      "loss_mask": pa.array([[0, 1], [1]], pa.list_(pa.int8())),
                      "num_tokens": pa.array([2, 1], pa.int32()), "num_trained": pa.array([1, 1], pa.int32()),
                      "source": ["x", "x"]})
    pq.write_table(table, tmp_path / "p.parquet")
    p = read_prompts(tmp_path / "p.parquet")
    assert (p.sample_ids, p.input_ids, p.loss_masks) == (["a", "b"], [[1, 2], [3]], [[0, 1], [1]])
    # what run_extract records in the shard as prompts_sha256 (the manifest compares it with the file then)
    assert p.sha256 == hashlib.sha256((tmp_path / "p.parquet").read_bytes()).hexdigest()
    (tmp_path / "bad.parquet").write_bytes(b"garbage")
    with pytest.raises(ShardError, match=r"bad.parquet: cannot read the prompts parquet"):
        read_prompts(tmp_path / "bad.parquet")


class PagedEngine(FakeEngine):
    """Computes each child from its prefix rounded down to a page of `page` positions (SGLang's radix hit with a
    page size above 1); a prefix shorter than a page is computed whole."""

    def __init__(self, page: int) -> None:
        super().__init__()
        self.page = page

    def lost_prefixes(self) -> str:
        return "pages"

    def extract(self, prompts: Iterable[Prompt]) -> Iterator[Captured]:
        for c, p in zip(super().extract(prompts), prompts, strict=True):
            m = p.prefix_len // self.page * self.page
            yield Captured(c.index, c.sample_id, [h[m:] for h in c.hidden_states], start=m)


def test_a_chunk_counts_prefixes_computed_whole_or_from_inside(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A few positions recomputed per child (a page's worth) are counted, not warned; a prefix computed whole, or
    more than 5% over the plan, is warned."""
    root = list(range(1, 41))
    ids = [root, root[:36] + [50, 51, 52, 53], root[:8] + [60] * 12]
    chunk = ChunkPrompts(["a", "b", "c"], ids, [[1] * len(x) for x in ids], [-1, 0, 0], [0, 36, 8])
    out = extract_chunk(chunk, tmp_path / "p.hss", PagedEngine(page=16), META, progress=False)
    # b from 32 (4 of its 36 again), c whole (8 < a page)
    assert (out["computed_tokens"], out["planned_computed_tokens"]) == (40 + 8 + 20, 40 + 4 + 12)
    assert (out["lost_prefixes"], out["shortened_prefixes"]) == (1, 1)
    assert capsys.readouterr().err == (
        "WARNING: p.hss: of 2 samples that share a prefix, 1 were computed whole and 1 from inside their prefix "
        "(68 tokens computed and stored where prepare planned 56): pages\n")
    long = [k % 90 + 1 for k in range(200)]
    chunk = ChunkPrompts(["a", "b"], [long, long[:196] + [95] * 4], [[1] * 200] * 2, [-1, 0], [0, 196])
    out = extract_chunk(chunk, tmp_path / "q.hss", PagedEngine(page=16), META, progress=False)
    assert (out["computed_tokens"], out["planned_computed_tokens"], out["shortened_prefixes"]) == (208, 204, 1)
    assert capsys.readouterr().err == ""  # 2% over the plan, every reference kept
