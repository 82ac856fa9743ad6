"""Parse, then trust: checks of every structure read from a shard before anything is sized or indexed by it.

The reader hands each structure here as soon as it has its bytes; nothing read from a file is used to
allocate, slice or index until a function of this module has checked its type, its range and its agreement
with the file's size and with the other structures. Failures are `Malformed`, which the reader turns into a
`CorruptShardError` naming the file (and the sample).

Memory bound: a sample is decoded only to the size its index entry declares, and that size is checked
against the record's stored bytes with zstd's largest possible ratio (`ZSTD_MAX_RATIO`), so no claim in a
file (frame header, index, metadata) makes the reader allocate more than its legitimate decoded size.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import zstandard as zstd

from hsextract.layers import CONVENTIONS, LAYER_OUTPUT
from hsextract.shard import format as fmt

# zstd decodes a block to at most 128 KiB and stores the smallest block (RLE) in 4 bytes: no frame of
# L bytes decodes to more than 32768 * L bytes, whatever its header claims.
ZSTD_MAX_RATIO = 32768
MAX_META_BYTES = 1 << 20  # hsextract's metadata is ~1 KB
# The index is JSON of ids and integers: zstd level 3 shrinks it ~3-10x. 64x plus a floor allows any
# real index and bounds a decompression bomb to a few MB per MB of file.
INDEX_MAX_RATIO = 64
INDEX_MIN_CAP = 1 << 20
MAX_HIDDEN_SIZE = 1 << 20
MAX_HIDDEN_TENSORS = 1024
MAX_SEQ = 1 << 24
U64 = 1 << 64

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int64": 8}
OUT_DTYPES = ("bfloat16", "float16", "float32")
PRECISIONS = ("bf16", "fp8_e4m3")
FINAL_STATES = ("post_norm", "pre_norm")
# what the reader and its callers (validate, stats, manifest, dataset) read from the metadata
READ_KEYS = ("aux_layers", "final_state", "hidden_size", "dtype", "format_version", "precision", "stored_dtype",
             "num_hidden_tensors")


class Malformed(Exception):
    def __init__(self, what: str, sample: int | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.sample = sample


def is_int(v: Any) -> bool:
    return type(v) is int  # JSON true/false are bools, which are ints to isinstance


def load_json(raw: bytes, what: str) -> Any:
    """Strict UTF-8 JSON; nesting too deep for the parser is an error, not a crash."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise Malformed(f"{what} is not UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise Malformed(f"{what} is nested too deeply to be hsextract's") from None
    except ValueError as e:
        raise Malformed(f"{what} is not JSON ({e})") from None


def metadata(raw: bytes, version: int = fmt.FLAT_VERSION) -> dict[str, Any]:
    """The header's metadata, with every key the reader and its callers use checked (`version`: the header's)."""
    meta = load_json(raw, "metadata")
    if not isinstance(meta, dict):
        raise Malformed(f"metadata is a JSON {type(meta).__name__}, not an object")
    missing = [k for k in READ_KEYS if k not in meta]
    if missing:
        raise Malformed(f"metadata lacks {missing}")
    if meta["format_version"] != version or not is_int(meta["format_version"]):
        raise Malformed(f"metadata format_version {meta['format_version']!r}, header says {version}")
    aux = meta["aux_layers"]
    if not (isinstance(aux, list) and len(aux) < MAX_HIDDEN_TENSORS and all(is_int(a) for a in aux)):
        raise Malformed(f"metadata aux_layers must be a list of fewer than {MAX_HIDDEN_TENSORS} integers")
    nh = meta["num_hidden_tensors"]
    if not is_int(nh) or nh != len(aux) + 1:
        raise Malformed(f"metadata num_hidden_tensors {nh!r}, aux_layers make it {len(aux) + 1}")
    h = meta["hidden_size"]
    if not (is_int(h) and 1 <= h <= MAX_HIDDEN_SIZE):
        raise Malformed(f"metadata hidden_size {h!r}: must be an integer in [1, {MAX_HIDDEN_SIZE}]")
    if meta["dtype"] not in OUT_DTYPES:
        raise Malformed(f"metadata dtype {meta['dtype']!r}: one of {list(OUT_DTYPES)}")
    if meta["precision"] not in PRECISIONS:
        raise Malformed(f"metadata precision {meta['precision']!r}: one of {list(PRECISIONS)}")
    stored = "float8_e4m3fn" if meta["precision"] == "fp8_e4m3" else meta["dtype"]
    if meta["stored_dtype"] != stored:
        raise Malformed(f"metadata stored_dtype {meta['stored_dtype']!r}, precision and dtype make it {stored!r}")
    if meta.get("layer_convention", LAYER_OUTPUT) not in CONVENTIONS:  # absent: written before it was recorded
        raise Malformed(f"metadata layer_convention {meta['layer_convention']!r}: one of {list(CONVENTIONS)} or absent")
    if meta["final_state"] not in FINAL_STATES:
        raise Malformed(f"metadata final_state {meta['final_state']!r}: one of {list(FINAL_STATES)}")
    vocab = meta.get("vocab_size")
    if vocab is not None and not (is_int(vocab) and vocab > 0):
        raise Malformed(f"metadata vocab_size {vocab!r}: a positive integer or absent")
    return meta


def frame_count(meta: dict[str, Any]) -> int:
    per_hidden = ITEMSIZE[meta["stored_dtype"]] + (4 if meta["precision"] == "fp8_e4m3" else 0)
    return 2 + meta["num_hidden_tensors"] * per_hidden


def is_hidden(piece: dict[str, Any]) -> bool:
    """A piece with a row per position (hidden states and their scales): version 2 stores only a sample's own
    rows of it; ids and loss mask are stored whole."""
    return piece["name"].startswith("hidden_states.")


def min_record_len(meta: dict[str, Any]) -> int:
    return fmt.RECORD.size + fmt.FRAME_COUNT.size + 8 * frame_count(meta)


def raw_bytes(meta: dict[str, Any], seq: int) -> int:
    """The v1 dict's tensor bytes (index column raw_bytes)."""
    return 16 * seq + meta["num_hidden_tensors"] * seq * meta["hidden_size"] * ITEMSIZE[meta["dtype"]]


def decoded_bytes(meta: dict[str, Any], seq: int, own: int | None = None) -> int:
    """Bytes the record's frames decode to (fp8: one byte per value plus a float32 scale per row); `own`: the
    hidden rows the record holds (seq less the prefix taken from a parent)."""
    per_row = meta["hidden_size"] * ITEMSIZE[meta["stored_dtype"]] + (4 if meta["precision"] == "fp8_e4m3" else 0)
    return 16 * seq + meta["num_hidden_tensors"] * (seq if own is None else own) * per_row


def footer(foot: bytes, header_version: int, size: int, data_start: int) -> tuple[int, int, int, int]:
    """(index_offset, index_len, index_crc, n) of a footer whose magic is present."""
    ix_off, ix_len, ix_crc, n, version, reserved, fcrc, _ = fmt.FOOTER.unpack(foot)
    if fmt.crc32(foot[:28]) != fcrc or version != header_version or reserved != 0:
        raise Malformed("footer checksum mismatch")
    if not data_start <= ix_off or ix_off + ix_len != size - fmt.FOOTER.size:
        raise Malformed(f"footer places the index at bytes [{ix_off}, {ix_off + ix_len}), outside "
                        f"[{data_start}, {size - fmt.FOOTER.size})")
    return ix_off, ix_len, ix_crc, n


def index_bytes(ix_raw: bytes) -> bytes:
    """Decompress the index, never past INDEX_MAX_RATIO times its stored size."""
    cap = INDEX_MIN_CAP + INDEX_MAX_RATIO * len(ix_raw)
    try:
        declared = zstd.frame_content_size(ix_raw)
        if declared > cap:
            raise Malformed(f"index frame declares {declared} bytes, more than {cap} (the limit for {len(ix_raw)} "
                            "stored bytes)")
        return zstd.ZstdDecompressor().decompress(ix_raw, max_output_size=cap)
    except zstd.ZstdError as e:
        raise Malformed(f"index does not decode ({e})") from None


def index(raw: bytes, meta: dict[str, Any], n: int, data_start: int, index_offset: int) -> dict[str, list[Any]]:
    """The index columns, checked: types, ranges, records that tile [data_start, index_offset) exactly,
    raw sizes from the metadata, decoded sizes within zstd's reach of the stored ones; in version 2, every
    reference points to an earlier sample (so none forms a cycle or leaves the shard), takes at most the
    parent's tokens and fewer than its own, and nests at most MAX_REFERENCE_DEPTH deep."""
    columns = fmt.index_columns(meta["format_version"])
    ix = load_json(raw, "index")
    if not isinstance(ix, dict) or sorted(ix) != sorted(columns):
        keys = sorted(ix) if isinstance(ix, dict) else type(ix).__name__
        raise Malformed(f"index holds {keys}, expected the columns {list(columns)}")
    shared = columns != fmt.INDEX_COLUMNS
    for c in columns:
        if not isinstance(ix[c], list) or len(ix[c]) != n:
            raise Malformed(f"index lists disagree with the footer's {n} samples (column {c})")
    min_rec = min_record_len(meta)
    pos = data_start
    depth: list[int] = []  # version 2: how many references deep each sample is
    for i in range(n):
        sid, off, rlen, digest, seq, trained, raw_b = (ix[c][i] for c in fmt.INDEX_COLUMNS)
        if not isinstance(sid, str):
            raise Malformed(f"index sample_ids entry is a {type(sid).__name__}, not a string", i)
        if not all(is_int(v) for v in (off, rlen, digest, seq, trained, raw_b)):
            raise Malformed("index entry holds a non-integer where an integer belongs", i)
        if off != pos:
            raise Malformed(f"index offset {off}, the records before it end at byte {pos} (gap or overlap)", i)
        if not min_rec <= rlen <= index_offset - pos:
            raise Malformed(f"index record length {rlen} outside [{min_rec}, {index_offset - pos}] "
                            "(the bytes left before the index)", i)
        if not 0 <= digest < U64:
            raise Malformed(f"index payload_xxh3 {digest} is not a 64-bit value", i)
        if not (1 <= seq <= MAX_SEQ and 0 <= trained <= seq):
            raise Malformed(f"index seq_len {seq}, num_trained {trained}: need 1 <= seq_len <= {MAX_SEQ} and "
                            "0 <= num_trained <= seq_len", i)
        if raw_b != raw_bytes(meta, seq):
            raise Malformed(f"index raw_bytes {raw_b}, the metadata makes it {raw_bytes(meta, seq)} for "
                            f"{seq} tokens", i)
        own = seq - (reference(ix, i, seq) if shared else 0)
        if shared:
            depth.append(fmt.reference_depth(depth, ix["parents"][i]))
            if depth[i] > fmt.MAX_REFERENCE_DEPTH:
                raise Malformed(f"index references go {depth[i]} samples deep (its parent, that one's parent, ...): "
                                f"at most {fmt.MAX_REFERENCE_DEPTH}, so that reading a sample stays bounded", i)
        if decoded_bytes(meta, seq, own) > ZSTD_MAX_RATIO * rlen:
            raise Malformed(f"index claims {seq} tokens, more than a {rlen}-byte record can hold", i)
        pos += rlen
    if pos != index_offset:
        raise Malformed(f"the index's records end at byte {pos}, the index starts at {index_offset} "
                        "(a record is missing from the index)")
    return ix


def reference(ix: dict[str, list[Any]], i: int, seq: int) -> int:
    """Sample i's prefix length, its reference checked (version 2; earlier entries already checked)."""
    parent, k = ix["parents"][i], ix["prefix_lens"][i]
    if not (is_int(parent) and is_int(k)):
        raise Malformed("index entry holds a non-integer where an integer belongs", i)
    if parent == fmt.NO_PARENT:
        if k != 0:
            raise Malformed(f"index prefix length {k} without a parent (must be 0)", i)
        return 0
    if not 0 <= parent < i:
        raise Malformed(f"index parent {parent} is not an earlier sample of this shard (a reference must point "
                        f"to a sample 0..{i - 1}: never to itself, a later sample or another shard)", i)
    top = min(ix["seq_lens"][parent], seq - 1)
    if not 1 <= k <= top:
        raise Malformed(f"index prefix length {k} outside [1, {top}] (parent {parent} holds "
                        f"{ix['seq_lens'][parent]} tokens, the sample {seq}, of which it must compute one)", i)
    return k


def frame_sizes(pieces: list[dict[str, Any]], seq: int, own: int | None = None) -> list[int]:
    """Decoded size of every frame of a record of `seq` tokens, in payload order; `own`: its hidden rows."""
    rows = [own if own is not None and is_hidden(p) else seq for p in pieces]
    return [n * p["width"] * ITEMSIZE[p["dtype"]] // p["planes"] for p, n in zip(pieces, rows, strict=True)
            for _ in range(p["planes"])]


def frames(payload: memoryview, sizes: list[int], sample: int) -> list[memoryview]:
    """Split a record's payload into its frames: count, lengths and declared sizes checked first."""
    if len(payload) < fmt.FRAME_COUNT.size:
        raise Malformed("payload too short for its frame count", sample)
    (nframes,) = fmt.FRAME_COUNT.unpack_from(payload)
    if nframes != len(sizes):
        raise Malformed(f"{nframes} frames, layout expects {len(sizes)}", sample)
    table_end = fmt.FRAME_COUNT.size + 8 * nframes
    if len(payload) < table_end:
        raise Malformed("payload too short for its frame table", sample)
    lens = struct.unpack_from(f"<{nframes}Q", payload, fmt.FRAME_COUNT.size)
    if sum(lens) != len(payload) - table_end:
        raise Malformed(f"frame lengths add up to {sum(lens)} bytes, the payload holds {len(payload) - table_end}",
                        sample)
    out, pos = [], table_end
    for k, (ln, size) in enumerate(zip(lens, sizes, strict=True)):
        frame = payload[pos:pos + ln]
        pos += ln
        check_frame(frame, k, ln, size, sample)
        out.append(frame)
    return out


FRAME_HEADER_MAX = 18  # zstd: magic 4, descriptor 1, window 1, dictionary id up to 4, content size up to 8


def check_frame(head: bytes | memoryview, k: int, ln: int, size: int, sample: int) -> None:
    """Frame k of `ln` bytes, of which `head` holds at least the first FRAME_HEADER_MAX, must decode to
    `size` bytes: refuse a length that cannot reach it and a header that declares anything else."""
    if size > ZSTD_MAX_RATIO * ln:
        raise Malformed(f"frame {k} of {ln} bytes cannot decode to the {size} bytes its tensor needs", sample)
    try:
        declared = zstd.frame_content_size(head)
    except zstd.ZstdError:
        raise Malformed(f"frame {k} has no valid zstd frame header", sample) from None
    if declared not in (-1, size):
        raise Malformed(f"frame {k} declares {declared} bytes, its tensor needs {size}", sample)
