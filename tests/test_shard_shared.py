"""Shard format version 2 (docs/SHARED_PREFIX.md): samples that take their first rows from an earlier sample read
back byte-identical to the flat layout; a shard without references is version 1, byte for byte, and reads as before;
the writer refuses a reference it cannot prove."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import zstandard as zstd
from conftest import make_sample, shard_metadata
from hostile import FAMILY, family, shared_shard

from hsextract.errors import ShardError
from hsextract.shard import ShardReader, ShardWriter
from hsextract.shard import format as fmt


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == ["hidden_states", "input_ids", "loss_mask"]
    for key in ("input_ids", "loss_mask"):
        assert got[key].dtype == torch.int64 and torch.equal(got[key], want[key]), key
    assert len(got["hidden_states"]) == len(want["hidden_states"])
    for g, w in zip(got["hidden_states"], want["hidden_states"], strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
        assert torch.equal(bits(g), bits(w))


def flat_shard(path: Path, samples: list, **kw: object) -> Path:
    with ShardWriter(path, shard_metadata(), **kw) as w:
        for k, (ids, hs, mask) in enumerate(samples):
            w.add(ids, hs, mask, sample_id=f"s{k}")
    return path


def header_and_footer_versions(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    return struct.unpack_from("<H", data, 8)[0], struct.unpack_from("<H", data, len(data) - 16)[0]


def index_columns(path: Path) -> list[str]:
    data = path.read_bytes()
    ix_off, ix_len = struct.unpack_from("<QQ", data, len(data) - fmt.FOOTER.size)
    return sorted(json.loads(zstd.ZstdDecompressor().decompress(data[ix_off:ix_off + ix_len])))


@pytest.mark.parametrize(("precision", "threads", "decode_threads"),
                         [("bf16", 1, 1), ("bf16", 3, 3), ("fp8_e4m3", 1, 1), ("fp8_e4m3", 3, 2)])
def test_assembled_samples_equal_the_flat_layout_byte_for_byte(tmp_path: Path, precision: str, threads: int,
                                                               decode_threads: int) -> None:
    samples = family()
    flat = ShardReader(flat_shard(tmp_path / "flat.hss", samples, precision=precision, threads=threads),
                       decode_threads=decode_threads)
    shared = ShardReader(shared_shard(tmp_path / "shared.hss", samples, precision=precision, threads=threads),
                         decode_threads=decode_threads)
    assert (flat.metadata["format_version"], shared.metadata["format_version"]) == (1, 2)
    assert header_and_footer_versions(shared.path) == (2, 2)
    assert shared.parents == [p for p, _ in FAMILY] and shared.prefix_lens == [k for _, k in FAMILY]
    assert shared.seq_lens == flat.seq_lens and shared.index["raw_bytes"] == flat.index["raw_bytes"]
    assert shared.index["num_trained"] == flat.index["num_trained"]
    assert shared.stored_tokens == sum(flat.seq_lens) - sum(k for _, k in FAMILY) and flat.stored_tokens == 78
    for i in range(len(samples)):
        assert_same(shared[i], flat[i])
        assert_same(shared.sample(i, shared_memory=True), flat[i])
        own, k = shared.own_rows(i), shared.prefix_lens[i]
        assert all(torch.equal(own[key], flat[i][key]) for key in ("input_ids", "loss_mask"))
        for g, w in zip(own["hidden_states"], flat[i]["hidden_states"], strict=True):
            assert g.shape[0] == len(w) - k and torch.equal(bits(g), bits(w[k:]))
    for got, want in zip(shared.iter_samples(threads=3), flat, strict=True):
        assert_same(got, want)
    shared.check_records()
    shared.verify()
    assert shared.path.stat().st_size < flat.path.stat().st_size


def test_rows_come_from_each_ancestor_that_holds_them(tmp_path: Path) -> None:
    """Sample 4 takes [0, 5) from sample 0 and [5, 6) from sample 1, skipping sample 2 (its own rows start at 7):
    the ids and rows of every segment are the ones of the sample that stores them."""
    samples = family()
    r = ShardReader(shared_shard(tmp_path / "a.hss", samples))
    got = r[4]["hidden_states"][0]
    assert torch.equal(bits(got[:5]), bits(samples[0][1][0][:5]))
    assert torch.equal(bits(got[5:6]), bits(samples[1][1][0][5:6]))
    assert torch.equal(bits(got[6:]), bits(samples[4][1][0][6:]))


def test_a_writer_without_references_writes_version_1_bytes(tmp_path: Path) -> None:
    """share_prefixes=True with no reference given, and a plain writer: the same bytes, version 1, seven index
    columns; a version-1 shard reads with no parent anywhere."""
    samples = [make_sample(5 + k, seed=k) for k in range(4)]
    a = flat_shard(tmp_path / "a.hss", samples)
    b = flat_shard(tmp_path / "b.hss", samples, share_prefixes=True, threads=2)
    assert a.read_bytes() == b.read_bytes()
    assert header_and_footer_versions(a) == (1, 1)
    assert index_columns(a) == sorted(fmt.INDEX_COLUMNS)
    assert index_columns(shared_shard(tmp_path / "c.hss")) == sorted(fmt.INDEX_COLUMNS + fmt.REF_COLUMNS)
    r = ShardReader(a)
    assert r.metadata["format_version"] == 1 and r.parents == [-1] * 4 and r.prefix_lens == [0] * 4
    assert r.stored_tokens == sum(r.seq_lens)
    for k, (ids, hs, mask) in enumerate(samples):
        assert_same(r[k], {"input_ids": ids, "hidden_states": hs, "loss_mask": mask})
    r.verify()


def test_the_writer_refuses_a_reference_it_cannot_prove(tmp_path: Path) -> None:
    root = make_sample(8, seed=1)
    ids, hs, mask = make_sample(10, seed=2)
    ids[:5] = root[0][:5]
    own = [h[5:] for h in hs]

    def attempt(path: str, **kw: object) -> str:
        with pytest.raises(ShardError) as e, ShardWriter(tmp_path / f"{path}.hss", shard_metadata(),
                                                         share_prefixes=kw.pop("share", True)) as w:
            w.add(*root, sample_id="root")
            w.add(kw.pop("ids", ids), kw.pop("hs", own), mask, sample_id="child", **kw)
        assert not (tmp_path / f"{path}.hss").exists()
        return str(e.value)

    where = f"{tmp_path / 'x.hss'}: sample 1: "
    assert attempt("x", parent=1, prefix_len=5) == where + "parent 1 must be an earlier sample of this shard (0..0)"
    assert attempt("x", parent=-1, prefix_len=5).startswith(where + "parent -1 must be an earlier sample")
    assert attempt("x", parent=True, prefix_len=5).startswith(where + "parent True must be an earlier sample")
    assert attempt("x", parent=0, prefix_len=0).startswith(where + "prefix_len 0 outside [1, 8] (parent 0 holds 8 "
                                                           "tokens, the sample 10")
    assert attempt("x", parent=0, prefix_len=9, hs=[h[9:] for h in hs]).startswith(where + "prefix_len 9 outside")
    assert attempt("x", prefix_len=5) == where + "prefix_len 5 without a parent; give parent= or prefix_len=0"
    assert attempt("x", parent=0, prefix_len=6, hs=[h[6:] for h in hs]) == (
        where + "input_ids differ from parent 0's at token 5, within the prefix of 6 tokens it would take from it")
    assert attempt("x", parent=0, prefix_len=5, hs=hs) == (
        where + "hidden_states[0] is bfloat16 (10, 16), expected bfloat16 (5, 16) (its own rows: 10 tokens less the "
        "5 taken from its parent)")
    assert attempt("x", parent=0, prefix_len=5, share=False) == (
        where + "a reference (parent 0) needs ShardWriter(..., share_prefixes=True)")


def test_validate_inspect_and_open_dataset_read_a_version_2_shard(tmp_path: Path) -> None:
    from hsextract.dataset import open_dataset
    from hsextract.report.validate import validate_shard
    from hsextract.shard.inspect import shard_info

    samples = family()
    shared = shared_shard(tmp_path / "chunk-00001.hss", samples)
    flat = flat_shard(tmp_path / "chunk-00000.hss", samples)
    ids, hs, mask = samples[0]
    report = validate_shard(shared, {"input_ids": ids, "hidden_states": hs, "loss_mask": mask})
    assert report["passed"], report["first_failure"]
    assert report["num_tokens"] == sum(8 + 2 * k for k in range(len(FAMILY)))
    info = shard_info(shared)
    assert info["metadata"]["format_version"] == 2 and info["num_samples"] == len(FAMILY)
    ds = open_dataset(tmp_path)  # a v1 and a v2 shard in one dataset
    assert [r.path.name for r in ds.readers] == ["chunk-00000.hss", "chunk-00001.hss"]
    n = len(FAMILY)
    for i in range(n):
        assert_same(ds[n + i], ds[i])
    assert flat.stat().st_size > shared.stat().st_size


@pytest.mark.parametrize("precision", ["bf16", "fp8_e4m3"])
def test_ancestors_decode_only_the_rows_they_supply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    precision: str) -> None:
    """Sample 4 takes row 5 from sample 1 and rows 0..4 from sample 0 (FAMILY): those records decode 1 and 5 rows of
    each hidden tensor (straight into the sample's tensors), not their 5 and 8 own rows, and ids only below the
    segment's end; the sample is still the flat one."""
    samples = family()
    want = ShardReader(flat_shard(tmp_path / "flat.hss", samples, precision=precision))[4]
    r = ShardReader(shared_shard(tmp_path / "s.hss", precision=precision))
    assert r.supplies(4) == [(1, 5, 6), (0, 0, 5)]
    decoded: list[tuple[int, str, int]] = []
    real = ShardReader._decode_piece

    def spy(self, i, piece, frames, seq, shared=False, rows=None, into=None):
        decoded.append((i, piece["name"].split(".")[0], seq if rows is None else rows))
        return real(self, i, piece, frames, seq, shared, rows, into)

    monkeypatch.setattr(ShardReader, "_decode_piece", spy)
    assert_same(r[4], want)
    tensors = 4 * (2 if precision == "fp8_e4m3" else 1)  # fp8: values and scales
    assert decoded == ([(4, "input_ids", 16), (4, "loss_mask", 16)] + [(4, "hidden_states", 10)] * tensors
                       + [(1, "input_ids", 6)] + [(1, "hidden_states", 1)] * tensors  # ids below 6, row 5
                       + [(0, "input_ids", 5)] + [(0, "hidden_states", 5)] * tensors)  # ids and rows below 5


def test_a_damaged_ancestor_fails_the_sample_asked_for_naming_both(tmp_path: Path) -> None:
    """A trainer that skips the failing sample (`e.sample`) skips the one it asked for, not the ancestor."""
    from hsextract.errors import CorruptShardError

    path = shared_shard(tmp_path / "a.hss")
    r = ShardReader(path)
    start, size = r.index["offsets"][0], r.index["record_lens"][0]
    r.close()
    data = bytearray(path.read_bytes())
    data[start + size - 2] ^= 0xFF  # the last frame of sample 0's record: a hidden tensor's
    path.write_bytes(bytes(data))
    r = ShardReader(path)
    with pytest.raises(CorruptShardError) as e:
        r[1]  # rows [0, 5) from sample 0
    assert e.value.sample == 1
    assert e.value.what.startswith("its rows 0 to 5 come from sample 0, whose record is damaged (")
    with pytest.raises(CorruptShardError) as e:
        r[0]
    assert e.value.sample == 0
    assert torch.equal(r[5]["input_ids"], family()[5][0])  # no reference to 0: unaffected
