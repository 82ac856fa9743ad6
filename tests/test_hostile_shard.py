"""Hostile shards: crafted structure (valid checksums around invalid content), size claims, every header and
index byte, non-regular files. Each case must be refused with the exact error type and a message naming the
file and what is wrong, inside an address-space limit, and `hsextract inspect` must exit 2 on it."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard as zstd
from hostile import TESTS, Parts, bomb, frame_header_claiming, real_shard, run_limited, shared_shard

from hsextract.errors import CorruptShardError, ShardError
from hsextract.shard import ShardReader, parse
from hsextract.shard import format as fmt

BIG = 100 << 30  # 100 GB


def meta_with(**over: object) -> Callable[[Parts], bytes]:
    def build(p: Parts) -> bytes:
        p.meta.update(over)
        return p.build()
    return build


def meta_raw(raw: bytes) -> Callable[[Parts], bytes]:
    return lambda p: p.build(meta_raw=raw)


def index_with(
    relocate: bool = False, n: int | None = None, **cols: Callable[[list], list]
) -> Callable[[Parts], bytes]:
    def build(p: Parts) -> bytes:
        for c, f in cols.items():
            p.index[c] = f(p.index[c])
        return p.build(relocate=relocate, n=n)
    return build


def index_raw(raw: bytes) -> Callable[[Parts], bytes]:
    return lambda p: p.build(index_raw=raw)


def split_frames(payload: bytes) -> list[bytes]:
    (n,) = struct.unpack_from("<I", payload)
    lens = struct.unpack_from(f"<{n}Q", payload, 4)
    pos, out = 4 + 8 * n, []
    for ln in lens:
        out.append(payload[pos:pos + ln])
        pos += ln
    return out


def payload_of(frames: list[bytes]) -> bytes:
    return fmt.pack_frame_table([len(f) for f in frames]) + b"".join(frames)


def frame0(frame: bytes) -> Callable[[Parts], bytes]:
    """Sample 0's first frame (input_ids) replaced; index and record checksums rewritten to match."""
    def build(p: Parts) -> bytes:
        frames = split_frames(p.payloads[0])
        p.payloads[0] = payload_of([frame, *frames[1:]])
        return p.build()
    return build


def payload0(f: Callable[[bytes], bytes]) -> Callable[[Parts], bytes]:
    def build(p: Parts) -> bytes:
        p.payloads[0] = f(p.payloads[0])
        return p.build()
    return build


def record_header(sample: int = 0, plen_delta: int = 0, digest_xor: int = 0) -> Callable[[Parts], bytes]:
    """Sample 0's record header rewritten (with a valid crc) to claim another sample, length or digest."""
    def build(p: Parts) -> bytes:
        data = bytearray(p.build())
        off = fmt.HEADER.size + len(p.meta_bytes())
        payload = p.payloads[0]
        data[off:off + fmt.RECORD.size] = fmt.pack_record_header(sample, len(payload) + plen_delta,
                                                                 fmt.payload_hash(payload) ^ digest_xor)
        return bytes(data)
    return build


def refoot(**fields: int) -> Callable[[Parts], bytes]:
    """The footer rewritten with other index_offset / index_len / n, its crc recomputed."""
    def build(p: Parts) -> bytes:
        data = p.build()
        ix_off, ix_len, ix_crc, n, version, reserved, _, magic = fmt.FOOTER.unpack(data[-fmt.FOOTER.size:])
        vals = {"ix_off": ix_off, "ix_len": ix_len, "n": n, **fields}
        head = struct.pack("<QQIIHH", vals["ix_off"], vals["ix_len"], ix_crc, vals["n"], version, reserved)
        return data[:-fmt.FOOTER.size] + head + struct.pack("<I", fmt.crc32(head)) + magic
    return build


def drop_last(p: Parts) -> bytes:
    """The index omits the last record (footer n and every column agree on one fewer)."""
    for c in fmt.INDEX_COLUMNS:
        p.index[c] = p.index[c][:-1]
    data = p.build(relocate=False, n=len(p.payloads) - 1)
    return data


def long_claim(p: Parts) -> bytes:
    """Sample 0 claims 10^7 tokens with a raw_bytes that agrees: only the record's size refutes it."""
    seq = 10**7
    p.index["seq_lens"][0] = seq
    p.index["raw_bytes"][0] = parse.raw_bytes(p.meta, seq)
    return p.build()


def seq_claim_frames(p: Parts) -> bytes:
    """Sample 0 claims 5000 tokens (within zstd's reach of its record): its frames' declared sizes refute it."""
    p.index["seq_lens"][0] = 5000
    p.index["raw_bytes"][0] = parse.raw_bytes(p.meta, 5000)
    return p.build()


def ids_differ(p: Parts) -> bytes:
    """Sample 1's input_ids changed at token 2 (inside the 5 tokens it takes from sample 0), re-encoded, every
    checksum valid: only comparing the ids with the parent's finds it."""
    frames = split_frames(p.payloads[1])
    ids = bytearray(zstd.ZstdDecompressor().decompress(frames[0]))
    ids[16] ^= 1
    p.payloads[1] = payload_of([zstd.ZstdCompressor().compress(bytes(ids)), *frames[1:]])
    return p.build()


def rebound(p: Parts) -> bytes:
    """Sample 2's reference changed in the index (parent 0 instead of 1, in range, own rows as stored, index crc
    valid) around records whose digests were seeded with the old one: the seed binds a record to its reference."""
    records = [fmt.pack_record_header(k, len(pl), fmt.payload_hash(pl, p.seed(k))) + pl
               for k, pl in enumerate(p.payloads)]
    p.index["parents"][2] = 0
    return p.build(records=records)


def as_version_1(p: Parts) -> bytes:
    """A version-1 header, metadata and footer around the version-2 index (its two reference columns)."""
    p.version = p.meta["format_version"] = 1
    return p.build()


# only decoding finds these (a frame's bytes, not its header): `validate` reports them, `inspect` does not
CONTENT_ONLY = {"frame_bomb_undeclared_1MB", "ref_ids_differ", "ref_rebound_digest"}

DEEP = b"[" * 200_000 + b"]" * 200_000

# name -> (build, expected part of the message); every case must raise CorruptShardError
CASES: dict[str, tuple[Callable[[Parts], bytes], str]] = {
    # header
    "header_reserved_10": (lambda p: p.build(reserved=1), "header bytes 10-11 (reserved) hold 1, not 0"),
    "header_reserved_11": (lambda p: p.build(reserved=0x100), "header bytes 10-11 (reserved) hold 256, not 0"),
    "meta_len_4GiB": (lambda p: p.build(meta_len=0xFFFFFFFF), "header metadata length 4294967295 exceeds 1048576"),
    "meta_len_past_end": (lambda p: p.build(meta_len=(1 << 20) - 1), "inside the header's metadata (bytes "
                                                                      "20..1048594), or its length damaged"),
    # metadata
    "meta_not_utf8": (meta_raw(b'{"a":"\xff\xfe"}'), "metadata is not UTF-8"),
    "meta_utf16": (meta_raw('{"a":1}'.encode("utf-16")), "metadata is not UTF-8"),
    "meta_not_json": (meta_raw(b"{not json"), "metadata is not JSON"),
    "meta_nested_200k": (meta_raw(DEEP), "metadata is nested too deeply"),
    "meta_list": (meta_raw(b"[1,2]"), "metadata is a JSON list, not an object"),
    "meta_string": (meta_raw(b'"x"'), "metadata is a JSON str, not an object"),
    "meta_empty": (meta_raw(b"{}"), "metadata lacks ['aux_layers'"),
    "meta_format_version_2": (meta_with(format_version=2), "metadata format_version 2"),
    "meta_format_version_str": (meta_with(format_version="1"), "metadata format_version '1'"),
    "meta_stored_dtype_unknown": (meta_with(stored_dtype="int4"), "metadata stored_dtype 'int4'"),
    "meta_stored_dtype_fp8_in_bf16": (meta_with(stored_dtype="float8_e4m3fn"), "metadata stored_dtype 'float8"),
    "meta_dtype_unknown": (meta_with(dtype="int8", stored_dtype="int8"), "metadata dtype 'int8'"),
    "meta_precision_unknown": (meta_with(precision="fp4"), "metadata precision 'fp4'"),
    "meta_final_state": (meta_with(final_state="middle"), "metadata final_state 'middle'"),
    "meta_layer_convention": (meta_with(layer_convention="output"), "metadata layer_convention 'output'"),
    "meta_layer_convention_null": (meta_with(layer_convention=None), "metadata layer_convention None"),
    "meta_hidden_str": (meta_with(hidden_size="16"), "metadata hidden_size '16'"),
    "meta_hidden_float": (meta_with(hidden_size=16.0), "metadata hidden_size 16.0"),
    "meta_hidden_bool": (meta_with(hidden_size=True), "metadata hidden_size True"),
    "meta_hidden_negative": (meta_with(hidden_size=-16), "metadata hidden_size -16"),
    "meta_hidden_zero": (meta_with(hidden_size=0), "metadata hidden_size 0"),
    "meta_hidden_2^40": (meta_with(hidden_size=1 << 40), "metadata hidden_size 1099511627776"),
    "meta_hidden_nan": (meta_with(hidden_size=float("nan")), "metadata hidden_size nan"),
    "meta_aux_not_list": (meta_with(aux_layers=3), "metadata aux_layers must be a list"),
    "meta_aux_strings": (meta_with(aux_layers=["1", "2", "3"]), "metadata aux_layers must be a list"),
    "meta_aux_5000": (meta_with(aux_layers=list(range(5000)), num_hidden_tensors=5001), "aux_layers must be a list"),
    "meta_aux_3M": (meta_with(aux_layers=list(range(3_000_000)), num_hidden_tensors=3_000_001), "exceeds 1048576"),
    "meta_hidden_tensors_3M": (meta_with(num_hidden_tensors=3_000_000), "num_hidden_tensors 3000000, aux_layers"),
    "meta_hidden_tensors_str": (meta_with(num_hidden_tensors="4"), "metadata num_hidden_tensors '4'"),
    "meta_vocab_str": (meta_with(vocab_size="big"), "metadata vocab_size 'big'"),
    "meta_vocab_negative": (meta_with(vocab_size=-1), "metadata vocab_size -1"),
    # footer
    "footer_reserved": (lambda p: p.build(footer_reserved=1), "footer checksum mismatch"),
    "footer_n_2^32-1": (refoot(n=0xFFFFFFFF), "footer claims 4294967295 samples"),
    "footer_n_one_less": (refoot(n=2), "index lists disagree with the footer's 2 samples"),
    "footer_index_len_100GB": (refoot(ix_len=BIG), "footer places the index at bytes"),
    "footer_index_offset_0": (refoot(ix_off=0), "footer places the index at bytes"),
    "footer_index_in_header": (lambda p: refoot(ix_off=8, ix_len=len(p.build()) - 48)(p), "outside"),
    # index container
    "index_not_utf8": (index_raw(b'{"a":"\xff"}'), "index is not UTF-8"),
    "index_not_json": (index_raw(b"{]"), "index is not JSON"),
    "index_nested_200k": (index_raw(DEEP), "index is nested too deeply"),
    "index_list": (index_raw(b"[]"), "index holds list, expected the columns"),
    "index_empty": (index_raw(b"{}"), "index holds [], expected the columns"),
    "index_missing_column": (lambda p: p.build(index_raw=json.dumps({k: v for k, v in p.index.items()
                                                                     if k != "raw_bytes"}).encode()), "index holds"),
    "index_extra_column": (lambda p: p.build(index_raw=json.dumps(dict(p.index, x=[1, 2, 3])).encode()), "index holds"),
    "index_column_not_list": (index_with(seq_lens=lambda v: 5), "column seq_lens"),
    "index_column_short": (index_with(seq_lens=lambda v: v[:-1]), "disagree with the footer's 3 samples"),
    "index_omits_last_record": (drop_last, "the index's records end at byte"),
    "index_bomb_512MiB_declared": (lambda p: p.build(index_frame=bomb(512 << 20, declare=True)),
                                   "index frame declares 536870912 bytes"),
    "index_bomb_512MiB_undeclared": (lambda p: p.build(index_frame=bomb(512 << 20, declare=False)),
                                     "index does not decode"),
    "index_frame_claims_100GB": (lambda p: p.build(index_frame=frame_header_claiming(BIG)),
                                 "index frame declares 107374182400 bytes"),
    "index_not_zstd": (lambda p: p.build(index_frame=b"not a zstd frame"), "index does not decode"),
    # index entries
    "index_sample_id_int": (index_with(sample_ids=lambda v: [7, *v[1:]]), "sample_ids entry is a int"),
    "index_sample_id_null": (index_with(sample_ids=lambda v: [None, *v[1:]]), "sample_ids entry is a NoneType"),
    "index_offset_string": (index_with(offsets=lambda v: [str(v[0]), *v[1:]]), "non-integer where an integer"),
    "index_offset_float": (index_with(offsets=lambda v: [float(v[0]), *v[1:]]), "non-integer where an integer"),
    "index_offset_bool": (index_with(seq_lens=lambda v: [True, *v[1:]]), "non-integer where an integer"),
    "index_offset_negative": (index_with(offsets=lambda v: [-v[0], *v[1:]]), "index offset -"),
    "index_offset_gap": (index_with(offsets=lambda v: [v[0], v[1] + 1, v[2]]), "(gap or overlap)"),
    "index_offset_overlap": (index_with(offsets=lambda v: [v[0], v[1] - 1, v[2]]), "(gap or overlap)"),
    "index_offsets_swapped": (index_with(offsets=lambda v: [v[1], v[0], v[2]]), "(gap or overlap)"),
    "index_record_len_1TiB": (index_with(record_lens=lambda v: [1 << 40, *v[1:]]), "index record length 1099511627776"),
    "index_record_len_0": (index_with(record_lens=lambda v: [0, *v[1:]]), "index record length 0 outside"),
    "index_xxh3_2^64": (index_with(payload_xxh3=lambda v: [1 << 64, *v[1:]]), "is not a 64-bit value"),
    "index_xxh3_negative": (index_with(payload_xxh3=lambda v: [-1, *v[1:]]), "is not a 64-bit value"),
    "index_seq_len_0": (index_with(seq_lens=lambda v: [0, *v[1:]]), "index seq_len 0"),
    "index_seq_len_2^40": (index_with(seq_lens=lambda v: [1 << 40, *v[1:]]), "index seq_len 1099511627776"),
    "index_trained_over_seq": (index_with(num_trained=lambda v: [1000, *v[1:]]), "num_trained 1000"),
    "index_raw_bytes_wrong": (index_with(raw_bytes=lambda v: [v[0] + 1, *v[1:]]), "the metadata makes it"),
    "index_seq_10^7_consistent": (long_claim, "index claims 10000000 tokens, more than a"),
    # records and frames
    "record_claims_other_sample": (record_header(sample=1), "record belongs to sample 1, not 0"),
    "record_payload_len_off": (record_header(plen_delta=8), "record of 763 bytes, the index says 755"),
    "record_digest_differs": (record_header(digest_xor=1), "checksum mismatch"),
    "frames_3M": (payload0(lambda b: struct.pack("<I", 3_000_000) + b[4:]), "3000000 frames, layout expects 10"),
    "frames_none": (payload0(lambda b: b""), "index record length 28 outside [112,"),
    "frames_table_cut": (payload0(lambda b: b[:20]), "index record length 48 outside [112,"),
    "frames_lengths_overrun": (payload0(lambda b: b[:4] + struct.pack("<Q", 1 << 40) + b[12:]), "frame lengths add up"),
    "frame_claims_100GB": (frame0(frame_header_claiming(BIG)), "frame 0 declares 107374182400 bytes, its tensor needs"),
    "frame_claims_100GB_checksummed": (frame0(frame_header_claiming(BIG, checksum=True)), "frame 0 declares"),
    "frame_not_zstd": (frame0(b"\0" * 16), "frame 0 has no valid zstd frame header"),
    "frame_bomb_undeclared_1MB": (frame0(zstd.ZstdCompressor(write_content_size=False).compress(bytes(1 << 20))),
                                  "frame does not decode"),
    "frame_short_for_seq": (seq_claim_frames, "frame 0 declares 40 bytes, its tensor needs 40000"),
}

# Version 2 (docs/SHARED_PREFIX.md), crafted from a shard of hostile.FAMILY: sample 1 takes 5 rows from sample 0
# (8 tokens; it has 10), sample 2 takes 7 from sample 1, sample 3 takes 3 from sample 0 (it has 14).
EARLIER = "is not an earlier sample of this shard"
SHARED_CASES: dict[str, tuple[Callable[[Parts], bytes], str]] = {
    "ref_parent_missing": (index_with(parents=lambda v: [v[0], 99, *v[2:]]), f"index parent 99 {EARLIER}"),
    "ref_parent_itself": (index_with(parents=lambda v: [v[0], 1, *v[2:]]), f"index parent 1 {EARLIER}"),
    "ref_cycle_1_2": (index_with(parents=lambda v: [v[0], 2, *v[2:]]), f"index parent 2 {EARLIER}"),
    "ref_parent_minus_2": (index_with(parents=lambda v: [v[0], -2, *v[2:]]), f"index parent -2 {EARLIER}"),
    "ref_parent_2^40": (index_with(parents=lambda v: [v[0], 1 << 40, *v[2:]]), f"index parent 1099511627776 {EARLIER}"),
    "ref_into_another_shard": (index_with(parents=lambda v: [v[0], "chunk-00002.hss:0", *v[2:]]),
                               "non-integer where an integer"),
    "ref_prefix_float": (index_with(prefix_lens=lambda v: [v[0], 5.0, *v[2:]]), "non-integer where an integer"),
    "ref_prefix_0": (index_with(prefix_lens=lambda v: [v[0], 0, *v[2:]]), "index prefix length 0 outside [1, 8]"),
    "ref_prefix_negative": (index_with(prefix_lens=lambda v: [v[0], -3, *v[2:]]), "prefix length -3 outside [1, 8]"),
    "ref_prefix_past_parent": (index_with(prefix_lens=lambda v: [*v[:3], 9, *v[4:]]),
                               "index prefix length 9 outside [1, 8] (parent 0 holds 8 tokens, the sample 14"),
    "ref_prefix_2^40": (index_with(prefix_lens=lambda v: [v[0], 1 << 40, *v[2:]]), "prefix length 1099511627776"),
    "ref_prefix_without_parent": (index_with(parents=lambda v: [v[0], -1, *v[2:]]),
                                  "index prefix length 5 without a parent (must be 0)"),
    "ref_prefix_changed_frames_disagree": (index_with(relocate=True, prefix_lens=lambda v: [v[0], 4, *v[2:]]),
                                           "frame 2 declares 80 bytes, its tensor needs 96"),
    "ref_columns_in_version_1": (as_version_1, "index holds ['num_trained', 'offsets', 'parents', 'payload_xxh3', "
                                               "'prefix_lens',"),
    "ref_columns_missing_in_version_2": (lambda p: p.build(index_raw=json.dumps(
        {k: v for k, v in p.index.items() if k not in fmt.REF_COLUMNS}).encode()), "index holds"),
    "ref_ids_differ": (ids_differ, "input_ids differ from sample 0's at token 2, within the 5 prefix tokens"),
    "ref_rebound_digest": (rebound, "checksum mismatch"),
}
CASES.update(SHARED_CASES)


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile")
    good = real_shard(folder / "good.hss")
    good_shared = shared_shard(folder / "good_shared.hss")
    paths = {"good": good, "good_shared": good_shared}
    for name, (build, _) in CASES.items():
        paths[name] = folder / f"{name}.hss"
        paths[name].write_bytes(build(Parts(good_shared if name in SHARED_CASES else good)))
    return paths


def test_the_crafting_itself_round_trips(crafted: dict[str, Path]) -> None:
    """Parts.build without changes gives back the writer's bytes: every case differs only where it says."""
    for good in ("good", "good_shared"):
        assert Parts(crafted[good]).build() == crafted[good].read_bytes()


def test_a_reference_chain_deeper_than_a_reader_walks_is_refused(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain of n one-row samples would cost n^2 record reads in a full pass (an hour for 10,000 in a 3 MB
    shard): the writer refuses a parent MAX_REFERENCE_DEPTH deep, and the reader a shard that holds one."""
    import torch
    from conftest import shard_metadata

    from hsextract.shard import ShardWriter

    d = fmt.MAX_REFERENCE_DEPTH

    def chain(path: Path, n: int) -> Path:
        with ShardWriter(path, shard_metadata(hidden_size=8, aux_layers=[1]), share_prefixes=True) as w:
            for i in range(n):  # sample i: ids 0..i+1, its first i+1 rows from sample i-1
                ids = torch.arange(i + 2)
                hs = [torch.ones(1 if i else 2, 8, dtype=torch.bfloat16)] * 2
                w.add(ids, hs, torch.ones(i + 2, dtype=torch.int64), sample_id=f"s{i}",
                      parent=i - 1 if i else None, prefix_len=i + 1 if i else 0)
        return path

    ok = ShardReader(chain(tmp_path / "ok.hss", d + 1))  # sample d is d deep: the limit
    assert ok[d]["hidden_states"][0].shape == (d + 2, 8)
    with pytest.raises(ShardError) as e:
        chain(tmp_path / "writer.hss", d + 2)
    assert str(e.value) == (f"{tmp_path / 'writer.hss'}: sample {d + 1}: parent {d} is {d} references deep already; "
                            f"at most {d} (a reader walks them): give a shallower parent or none")
    monkeypatch.setattr(fmt, "MAX_REFERENCE_DEPTH", d + 1)  # a writer that did not check
    deep = chain(tmp_path / "deep.hss", d + 2)
    monkeypatch.undo()
    with pytest.raises(CorruptShardError) as e:
        ShardReader(deep)
    assert e.value.sample == d + 1
    assert e.value.what == (f"index references go {d + 1} samples deep (its parent, that one's parent, ...): at most "
                            f"{d}, so that reading a sample stays bounded")


@pytest.mark.parametrize("name", sorted(CASES))
def test_crafted_structure_is_refused_naming_file_and_problem(crafted: dict[str, Path], name: str) -> None:
    path = crafted[name]
    with pytest.raises(CorruptShardError) as e:
        r = ShardReader(path)
        r.check_records()
        r.verify()
    assert type(e.value) is CorruptShardError
    assert str(e.value).startswith(f"{path}: ")
    assert CASES[name][1] in e.value.what


def test_memory_stays_bounded_and_inspect_fails_on_every_case(crafted: dict[str, Path]) -> None:
    """Each case read (and inspected) in a forked child whose address space is capped at 256 MiB above what
    it had: a reader that believed any claim above (100 GB, 512 MiB, 1 TiB, 3M tensors) would fail with
    MemoryError, not CorruptShardError."""
    names = sorted(CASES)
    read = run_limited([(str(crafted[n]), "read") for n in ["good", "good_shared", *names]])
    insp = run_limited([(str(crafted[n]), "inspect") for n in ["good", "good_shared", *names]])
    assert read[0]["ok"] == 3 and insp[0]["ok"]["rc"] == 0
    assert read[1]["ok"] == 6 and insp[1]["ok"]["rc"] == 0
    peaks = {}
    for name, r, i in zip(names, read[2:], insp[2:], strict=True):
        assert r.get("error") == "CorruptShardError", (name, r)
        assert CASES[name][1] in r["message"], (name, r)
        if name in CONTENT_ONLY:
            assert i["ok"]["rc"] == 0, (name, i)
        else:
            assert i["ok"]["rc"] == 2 and str(crafted[name]) in i["ok"]["stderr"], (name, i)
        peaks[name] = (r["peak_kb"], i["peak_kb"])
    assert max(max(p) for p in peaks.values()) < 64 << 10, peaks  # KiB: 64 MiB
    report = os.environ.get("HSX_HOSTILE_REPORT")
    if report:
        Path(report).write_text(json.dumps({"cases": len(names), "good_kb": (read[0]["peak_kb"], insp[0]["peak_kb"]),
                                             "peak_kb_read_inspect": peaks}, indent=1))


def test_a_reader_that_believed_the_claims_would_have_failed_the_limit(crafted: dict[str, Path]) -> None:
    """The limit is real: decompressing the 512 MiB index bomb the way the reader used to is refused."""
    frame = bomb(512 << 20, declare=True)
    (crafted["good"].parent / "bomb.zst").write_bytes(frame)
    probe = ("import resource, sys, zstandard as z; data = open(sys.argv[1], 'rb').read(); "
             "resource.setrlimit(resource.RLIMIT_AS, (400 << 20, 400 << 20)); "
             "z.ZstdDecompressor().decompress(data, max_output_size=1000)")
    out = subprocess.run([sys.executable, "-c", probe, str(crafted["good"].parent / "bomb.zst")],
                         capture_output=True, text=True, check=False)
    assert out.returncode != 0 and "MemoryError" in out.stderr


def header_index_footer_positions(path: Path) -> list[int]:
    r = ShardReader(path)
    size = path.stat().st_size
    first = r.index["offsets"][0]
    records = [o + k for o in r.index["offsets"] for k in range(fmt.RECORD.size)]
    r.close()
    return list(range(first)) + records + list(range(r._index_offset, size))


def test_every_byte_of_header_metadata_record_headers_index_and_footer_is_checked(tmp_path: Path) -> None:
    """Two flips (lowest and highest bit) of every byte outside the payloads: each is an error (this sweep
    found header bytes 10 and 11 accepted before they were checked)."""
    good_path = real_shard(tmp_path / "good.hss")
    good = good_path.read_bytes()
    bad = tmp_path / "bad.hss"
    positions = header_index_footer_positions(good_path)
    assert {10, 11} <= set(positions) and len(positions) > 600
    refused: dict[str, int] = {}
    for pos in positions:
        for bit in (0x01, 0x80):
            data = bytearray(good)
            data[pos] ^= bit
            bad.write_bytes(bytes(data))
            with pytest.raises(ShardError) as e:
                r = ShardReader(bad)
                r.check_records()
                r.verify()
            if pos in (8, 9):  # the version: a clear "other version" message, not "damaged"
                assert type(e.value) is ShardError and "shard format version" in str(e.value)
            elif pos < 8:  # the magic: perhaps no shard at all, so no advice to delete the file without a condition
                assert type(e.value) is ShardError and "not an hsextract shard (bad magic" in str(e.value)
            else:
                assert type(e.value) is CorruptShardError, (pos, e.value)
            refused[type(e.value).__name__] = refused.get(type(e.value).__name__, 0) + 1
    assert sum(refused.values()) == 2 * len(positions)


def test_every_byte_of_a_version_2_index_and_footer_and_its_version_is_checked(tmp_path: Path) -> None:
    """The references live in the index: each flipped bit of it (and of the footer, and of the header's version)
    is an error, never a sample assembled from other rows."""
    good_path = shared_shard(tmp_path / "good.hss")
    good = good_path.read_bytes()
    bad = tmp_path / "bad.hss"
    r = ShardReader(good_path)
    positions = [8, 9, *range(r._index_offset, len(good))]
    r.close()
    for pos in positions:
        for bit in (0x01, 0x80):
            data = bytearray(good)
            data[pos] ^= bit
            bad.write_bytes(bytes(data))
            with pytest.raises(ShardError) as e:
                r = ShardReader(bad)
                r.check_records()
                r.verify()
            if pos in (8, 9):
                assert type(e.value) is ShardError and "reads versions 1 and 2" in str(e.value)
            else:
                assert type(e.value) is CorruptShardError, (pos, e.value)


def test_non_regular_files_are_refused_without_blocking(tmp_path: Path) -> None:
    """A FIFO (no writer: a blocking open would wait forever), a directory, a character device and a
    symlink to a FIFO: each a ShardError naming the path. Run in a child so a regression hangs that child
    (killed by the guard) instead of the test session."""
    fifo = tmp_path / "pipe.hss"
    os.mkfifo(fifo)
    (tmp_path / "dir.hss").mkdir()
    (tmp_path / "link.hss").symlink_to(fifo)
    code = (
        "import sys\nfrom hsextract.shard import ShardReader\nfrom hsextract.errors import ShardError\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n        ShardReader(p)\n    except ShardError as e:\n"
        "        print(type(e).__name__, e)\n"
    )
    paths = [str(fifo), str(tmp_path / "dir.hss"), "/dev/null", str(tmp_path / "link.hss")]
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent / "src"))
    out = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    lines = out.stdout.splitlines()
    assert lines == [f"ShardError {p}: not a regular file; a shard is a regular *.hss file" for p in paths]


def test_inspect_fails_on_a_damaged_record_header_that_opening_does_not_read(tmp_path: Path) -> None:
    from hsextract.cli import main

    path = tmp_path / "a.hss"
    path.write_bytes(record_header(sample=2)(Parts(real_shard(tmp_path / "good.hss"))))
    ShardReader(path)  # opening reads header, index and footer only
    assert main(["inspect", str(path)]) == 2
    assert main(["inspect", str(tmp_path / "good.hss")]) == 0


def test_existing_v1_shards_read_as_before(tmp_path: Path) -> None:
    """Shards in the repository's fixtures (written by earlier writers) still open, check and verify."""
    fixtures = sorted((TESTS / "fixtures").rglob(f"*{fmt.SHARD_SUFFIX}"))
    for p in fixtures:
        r = ShardReader(p)
        r.check_records()
        r.verify()


def test_validate_reports_every_crafted_case_without_crashing(crafted: dict[str, Path], tmp_path: Path) -> None:
    """`validate_shard` turns each case into a failed report (integrity: the shard does not open; checksum: a
    sample does not read) naming the file, never an exception."""
    from conftest import make_sample

    from hsextract.report.validate import failure_line, validate_shard

    ids, hs, mask = make_sample(5)
    ref = {"input_ids": ids, "hidden_states": hs, "loss_mask": mask}
    checks = {}
    for name in sorted(CASES):
        report = validate_shard(crafted[name], ref)
        assert report["passed"] is False, name
        assert failure_line(report).startswith(f"{crafted[name]}: "), name
        checks[report["first_failure"]["check"]] = checks.get(report["first_failure"]["check"], 0) + 1
    assert set(checks) <= {"integrity", "checksum"} and sum(checks.values()) == len(CASES)


def test_an_empty_shard_file_is_a_damaged_shard(tmp_path: Path) -> None:
    """Zero bytes (a crash of a writer that was not this package's, a full disk's copy): cut before its header, so
    damaged, not another kind of file."""
    empty = tmp_path / "chunk-00000.hss"
    empty.write_bytes(b"")
    with pytest.raises(CorruptShardError) as e:
        ShardReader(empty)
    assert str(e.value) == (f"{empty}: shard structure: file truncated at byte 0: inside the 20-byte header. The "
                            "shard is damaged: delete it and rerun its chunk (snakemake reruns a missing shard).")
