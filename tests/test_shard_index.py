"""The reader's index in memory: a few tens of bytes a sample in arrays (shard/compact.py), no Python object per
sample, and everything it hands out the same Python ints, strs and lists as the file's JSON index."""

from __future__ import annotations

import gc
import json
import os
import pickle
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import shard_metadata

from hsextract.dataset import open_dataset
from hsextract.report.validate import validate_shard
from hsextract.shard import ShardReader, ShardWriter, parse
from hsextract.shard import format as fmt
from hsextract.shard.inspect import shard_info

N = 10_000  # samples of the memory test's shards
TURNS = 50  # version 2: chains of this many samples, each taking all but its last token from the one before
IDS = ["", "plain", "é—ü", "emoji \U0001f600", "lone \ud800 surrogate", "\udc00", "a\x00b", "x" * 300]


def tiny_shard(path: Path, n: int, shared: bool, ids: list[str] | None = None) -> Path:
    """n samples of 8 tokens, 4 hidden tensors of width 16; `shared`: version 2 (every sample but each TURNS-th
    takes 7 rows from the one before); ids like a conversation's turns unless given (cycled)."""
    mask, gen = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1]), torch.Generator().manual_seed(0)
    hs = [torch.randn(8, 16, generator=gen).to(torch.bfloat16) for _ in range(4)]
    with ShardWriter(path, shard_metadata(), share_prefixes=shared, sync_every_mb=0) as w:
        for i in range(n):
            tok = torch.arange(8)
            tok[7] += i % 1000  # payloads (and digests) differ; a sample's first 7 ids are its parent's
            sid = f"agentic-source:{i // TURNS}:t{2 * (i % TURNS) + 1}" if ids is None else ids[i % len(ids)]
            if shared and i % TURNS:
                w.add(tok, [h[7:] for h in hs], mask, sample_id=sid, parent=i - 1, prefix_len=7)
            else:
                w.add(tok, hs, mask, sample_id=sid)
    return path


def file_index(path: Path) -> dict[str, list[Any]]:
    """The index as the file's JSON holds it (what the reader kept before: lists of Python ints and strs)."""
    data = path.read_bytes()
    ix_off, ix_len, *_ = fmt.FOOTER.unpack(data[-fmt.FOOTER.size:])
    return json.loads(parse.index_bytes(data[ix_off:ix_off + ix_len]))


def index_bytes_per_sample(path: Path, n: int) -> float:
    """Bytes a ShardReader of `path` keeps allocated (tracemalloc), per sample."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        r = ShardReader(path)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(r) == n
    return kept / n


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("index")
    return {1: tiny_shard(root / "v1.hss", N, shared=False), 2: tiny_shard(root / "v2.hss", N, shared=True)}


@pytest.mark.parametrize("version", [1, 2])
def test_a_reader_keeps_a_few_tens_of_bytes_per_sample(shards: dict[int, Path], version: int) -> None:
    # ids of 17-22 bytes; the JSON lists cost ~265 (version 1) and ~290 (version 2) bytes a sample here, more with
    # larger ints (Python caches -5..256). Now: id bytes + 8 + 8 (bounds, digest) + 4 + 4 (seq, trained) + 8 id
    # offset, + 8 + 4 (parent, prefix) in version 2: 50 to 66
    path = shards[version]
    assert ShardReader(path).metadata["format_version"] == version
    per_sample = index_bytes_per_sample(path, N)
    assert per_sample < 100, f"{per_sample:.1f} bytes per sample"
    r = ShardReader(path)
    id_bytes = sum(len(s.encode()) for s in r.sample_ids)
    assert r._index.nbytes() == id_bytes + N * (32 if version == 1 else 44) + 16  # the arrays and nothing else


def test_a_dataset_of_many_shards_keeps_the_same_per_sample(shards: dict[int, Path], tmp_path: Path) -> None:
    for k in range(8):
        os.link(shards[2], tmp_path / f"s{k}.hss")  # distinct paths of one file: the dataset takes each
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ds = open_dataset(sorted(tmp_path.glob("*.hss")))
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(ds) == 8 * N and kept / (8 * N) < 100, f"{kept / (8 * N):.1f} bytes per sample"


def test_a_pickled_reader_stays_compact(shards: dict[int, Path]) -> None:
    """DataLoader workers under spawn get the reader pickled: the arrays travel as arrays."""
    r = ShardReader(shards[2])
    blob = pickle.dumps(r)
    assert len(blob) < 100 * N
    back = pickle.loads(blob)
    assert back.index == r.index and back._index.nbytes() == r._index.nbytes()
    assert torch.equal(back[N - 1]["hidden_states"][0], r[N - 1]["hidden_states"][0])


def only_python(value: Any) -> None:
    """Nothing but dicts, lists, tuples, Python ints, strs, floats, bools and None (no numpy scalar)."""
    if isinstance(value, dict):
        for k, v in value.items():
            only_python(k)
            only_python(v)
    elif isinstance(value, list | tuple):
        for v in value:
            only_python(v)
    else:
        assert value is None or type(value) in (int, str, float, bool), f"{value!r} is a {type(value)}"


def check_accessors(path: Path) -> None:
    ref = file_index(path)
    r = ShardReader(path)
    version = r.metadata["format_version"]
    n = len(ref["offsets"])
    assert len(r) == n
    # the index as the file's JSON, in its order: the same columns, values and types
    ix = r.index
    assert list(ix) == list(fmt.index_columns(version)) == list(ref)
    assert ix == ref
    only_python(ix)
    assert json.loads(json.dumps(ix)) == ref
    ix["seq_lens"][0] = -5  # a copy: the caller's to change
    assert r.index == ref
    parents = ref.get("parents", [fmt.NO_PARENT] * n)
    prefix = ref.get("prefix_lens", [0] * n)
    lists = {"sample_ids": ref["sample_ids"], "seq_lens": ref["seq_lens"], "parents": parents, "prefix_lens": prefix}
    for name, want in lists.items():
        got = getattr(r, name)
        assert type(got) is list and got == want, name
        only_python(got)
    for name in (*fmt.index_columns(fmt.FORMAT_VERSION),):
        got = r.column(name)
        assert got == (ref[name] if name in ref else lists[name]), name
        only_python(got)
    with pytest.raises(KeyError):
        r.column("nope")
    totals = {"num_tokens": sum(ref["seq_lens"]), "num_trained": sum(ref["num_trained"]),
              "raw_bytes": sum(ref["raw_bytes"]), "stored_tokens": sum(ref["seq_lens"]) - sum(prefix),
              "shared_samples": sum(p >= 0 for p in parents)}
    for name, want in totals.items():
        got = getattr(r, name)
        assert type(got) is int and got == want, name
    for i in (*range(min(n, 60)), n - 1, -1, -n):
        for name, col in (("sample_id", ref["sample_ids"]), ("seq_len", ref["seq_lens"]), ("parent", parents),
                          ("prefix_len", prefix)):
            got = getattr(r, name)(i)
            assert type(got) is type(col[i]) and got == col[i], (name, i)
    for i in (0, n - 1, -1, -n):  # record spans, as list indices
        assert r._index.span(i) == (ref["offsets"][i], ref["record_lens"][i])
        r.prefetch(i)
    for bad in (n, -n - 1):
        with pytest.raises(IndexError, match="out of range"):
            r.sample_id(bad)
    for i in range(min(n, 60)):  # supplies: from the index alone, as Python ints
        for seg in r.supplies(i):
            only_python(seg)
    info = shard_info(path, samples=True)
    only_python({k: v for k, v in info.items() if k != "metadata"})
    json.dumps(info)
    assert info["num_tokens"] == totals["num_tokens"] and info["raw_bytes"] == totals["raw_bytes"]
    assert [s["sample_id"] for s in info["samples"]] == ref["sample_ids"]
    assert [s["num_trained"] for s in info["samples"]] == ref["num_trained"]


@pytest.mark.parametrize("version", [1, 2])
def test_accessors_hand_out_python_values_equal_to_the_files_index(shards: dict[int, Path], version: int) -> None:
    check_accessors(shards[version])
    digests = ShardReader(shards[version]).index["payload_xxh3"]
    assert any(d >= 1 << 63 for d in digests)  # compared above: those come back unsigned, as the JSON has them


@pytest.mark.parametrize("shared", [False, True])
def test_any_sample_id_comes_back_as_written(tmp_path: Path, shared: bool) -> None:
    """Non-ASCII ids, the empty one, NUL, and the lone surrogates a JSON escape can hold."""
    path = tiny_shard(tmp_path / "ids.hss", 2 * len(IDS), shared, ids=IDS)
    check_accessors(path)
    r = ShardReader(path)
    assert r.sample_ids == IDS + IDS
    assert [r.sample_id(i) for i in range(len(r))] == IDS + IDS


def test_an_empty_shard(tmp_path: Path) -> None:
    path = tmp_path / "empty.hss"
    with ShardWriter(path, shard_metadata(), sync_every_mb=0):
        pass
    r = ShardReader(path)
    assert len(r) == 0 and r.index == file_index(path) and r.sample_ids == [] and r.num_tokens == 0
    assert r.stored_tokens == 0 and r.shared_samples == 0


def test_validation_report_totals_are_json_ints(tmp_path: Path) -> None:
    small = tiny_shard(tmp_path / "small.hss", 120, shared=True)
    ref = file_index(small)
    sample = ShardReader(small)[0]
    report = validate_shard(small, {"hidden_states": [h[:1] for h in sample["hidden_states"]],
                                    "input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"]},
                            vocab_size=5, report_path=tmp_path / "report.json")  # ids run to 7: every sample fails
    for key, want in (("num_samples", 120), ("num_tokens", sum(ref["seq_lens"])),
                      ("num_trained", sum(ref["num_trained"])),
                      ("distinct_tokens", sum(ref["seq_lens"]) - sum(ref["prefix_lens"]))):
        assert type(report[key]) is int and report[key] == want, key
    assert not report["passed"] and report["first_failure"]["sample_id"] == ref["sample_ids"][0]
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(json.dumps(report))
