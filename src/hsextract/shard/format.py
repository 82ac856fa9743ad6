"""Byte layout of a shard, format versions 1 and 2 (docs/FORMAT.md has the table).

    file    := header record* index footer
    header  := "HSXSHARD" u16 version u16 0 u32 meta_len u32 crc32(meta) meta(JSON, UTF-8)
    record  := "HSXR" u32 sample u64 payload_len u64 xxh3_64(payload) u32 crc32(record header[0:24]) payload
    payload := u32 n_frames, n_frames x u64 frame_len, frames (zstd, written without a content checksum: the
               record's XXH3-64 covers them; frames of earlier writers that carry one have it checked)
    index   := zstd(JSON, columnar: sample_ids, offsets, record_lens, payload_xxh3, seq_lens, num_trained, raw_bytes)
    footer  := u64 index_offset u64 index_len u32 crc32(index) u32 n_samples u16 version u16 0
               u32 crc32(footer[0:28]) "HSXSEND\\0"

All integers little endian. Payloads (nearly all the bytes) are hashed with XXH3-64, which runs at ~7 GB/s
where zlib's crc32 runs at ~1.8 GB/s here (it was 20% of the read time); the small structures use crc32.
Every byte of the file is covered by a checksum or must hold an exact value (magics, versions, reserved
zeros): a flipped byte is an error, never data. `parse.py` checks every structure before the reader trusts
it. Records carry their sample number, so a record served for the wrong
sample is caught too, and a truncated file can be scanned to name the first damaged sample.

Version 2 (docs/SHARED_PREFIX.md) differs only where a sample has a reference: the index has two more columns,
`parents` (-1, or an earlier sample of the shard) and `prefix_lens` (k: the leading rows taken from the parent),
the record's hidden-state frames hold the sample's own rows k..seq-1 (ids and loss mask stay whole), and its
payload digest is seeded with the reference, so a record is bound to the reference its index entry states. A
shard without any reference is written as version 1, byte for byte.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import xxhash

FLAT_VERSION = 1  # every sample stores all its rows
FORMAT_VERSION = 2  # the newest: samples may take a prefix of rows from an earlier sample
READ_VERSIONS = (FLAT_VERSION, FORMAT_VERSION)
SHARD_SUFFIX = ".hss"

HEADER_MAGIC = b"HSXSHARD"
HEADER = struct.Struct("<8sHHII")  # magic, version, reserved, meta_len, meta_crc
RECORD_MAGIC = b"HSXR"
RECORD = struct.Struct("<4sIQQI")  # magic, sample, payload_len, payload_xxh3, header_crc
RECORD_CHECKED = 24  # record header bytes covered by its crc32
FOOTER_MAGIC = b"HSXSEND\0"
FOOTER = struct.Struct("<QQIIHHI8s")  # index_offset, index_len, index_crc, n, version, 0, crc, magic
FRAME_COUNT = struct.Struct("<I")

INDEX_COLUMNS = ("sample_ids", "offsets", "record_lens", "payload_xxh3", "seq_lens", "num_trained", "raw_bytes")
REF_COLUMNS = ("parents", "prefix_lens")  # version 2 only
NO_PARENT = -1
# a sample's references (its parent, the parent's parent, ...) go at most this deep: reading it walks them and
# reads a record per level that supplies rows, so a crafted chain of n samples would cost n^2 record reads in a
# full pass (an hour for 10,000 one-row samples in a 3 MB shard). Real data nests one level per turn of a
# conversation (prepare starts a new chain past it: prefix_share.find_parents)
MAX_REFERENCE_DEPTH = 256


def reference_depth(depths: list[int], parent: int) -> int:
    """How many references deep a sample with this parent is, `depths` holding those of the samples before it."""
    return 0 if parent == NO_PARENT else depths[parent] + 1


def index_columns(version: int) -> tuple[str, ...]:
    return INDEX_COLUMNS + REF_COLUMNS if version >= 2 else INDEX_COLUMNS


def reference_seed(parent: int, prefix_len: int) -> int:
    """The xxh3 seed of a record's payload: 0 without a reference (version 1's digest), else parent + 1 in the high
    32 bits and the prefix length (< 2^24) in the low ones."""
    return 0 if parent < 0 else ((parent + 1) << 32) | prefix_len


def crc32(data: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def pack_header(metadata: dict[str, Any]) -> bytes:
    """Header and metadata; the version is the metadata's `format_version`."""
    meta = json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()
    return HEADER.pack(HEADER_MAGIC, metadata["format_version"], 0, len(meta), crc32(meta)) + meta


def payload_hash(data: bytes | bytearray | memoryview, seed: int = 0) -> int:
    return xxhash.xxh3_64_intdigest(data, seed)


def pack_record_header(sample: int, payload_len: int, payload_xxh3: int) -> bytes:
    head = struct.pack("<4sIQQ", RECORD_MAGIC, sample, payload_len, payload_xxh3)
    return head + struct.pack("<I", crc32(head))


def pack_frame_table(frame_lens: list[int]) -> bytes:
    return FRAME_COUNT.pack(len(frame_lens)) + struct.pack(f"<{len(frame_lens)}Q", *frame_lens)


def pack_footer(index_offset: int, index: bytes, n_samples: int, version: int = FLAT_VERSION) -> bytes:
    head = struct.pack("<QQIIHH", index_offset, len(index), crc32(index), n_samples, version, 0)
    return head + struct.pack("<I", crc32(head)) + FOOTER_MAGIC


def piece_layout(metadata: dict[str, Any]) -> list[dict[str, Any]]:
    """The tensors every record holds, in payload order, derived from the metadata alone."""
    pieces: list[dict[str, Any]] = [
        {"name": "input_ids", "dtype": "int64", "planes": 1, "width": 1},
        {"name": "loss_mask", "dtype": "int64", "planes": 1, "width": 1},
    ]
    stored = metadata["stored_dtype"]
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}[stored]
    for k in range(metadata["num_hidden_tensors"]):
        pieces.append({"name": f"hidden_states.{k}", "dtype": stored, "planes": itemsize,
                       "width": metadata["hidden_size"]})
        if metadata["precision"] == "fp8_e4m3":
            pieces.append({"name": f"hidden_states.{k}.scale", "dtype": "float32", "planes": 4, "width": 1})
    return pieces


def unit_layout(metadata: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """piece_layout grouped by the tensor of the sample each group makes: ids, mask, then one group per hidden
    state (its values and, under fp8, their per-token scales). The writer encodes, the reader decodes a group
    as one task."""
    pieces = piece_layout(metadata)
    step = 2 if metadata["precision"] == "fp8_e4m3" else 1
    return [pieces[:1], pieces[1:2], *(pieces[k:k + step] for k in range(2, len(pieces), step))]
