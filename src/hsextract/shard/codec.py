"""Tensor codecs: floats are split into byte planes before zstd, integers go to zstd whole.

Why planes: in bf16 the high byte (sign + 7 exponent bits) has an order-0 entropy near 3 bits,
the low byte (last exponent bit + mantissa) near 8. Interleaved, zstd sees noise and gains ~20%;
split, the high plane compresses to ~0.38 and the low plane is stored as zstd raw blocks.
Activations are close to i.i.d. symbols, so long matches almost never pay: the plane
compressor keeps the level's strategy but uses a tiny hash table and min_match 7, which is
~2x faster than stock parameters at the same or better ratio (bench/codec.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch
import zstandard as zstd

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = {"bfloat16", "float16", "float32", "float8_e4m3fn"}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not storable; use one of {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class Codec:
    """zstd settings of a shard; recorded in its metadata so a reader needs nothing else.

    Tensor frames carry no zstd content checksum: the record's XXH3-64 over the stored bytes, checked
    on every read, already catches any change to them, and hashing the decoded content again cost ~15%
    of the encode time (bench/codec.py). Frames written with a checksum (older shards) still read.
    """

    level: int = 3
    threads: int = 1

    def plane_compressor(self) -> zstd.ZstdCompressor:
        """For the top byte plane (sign + exponent): entropy coding is the gain, matches are rare.

        Levels up to 3 use the `fast` strategy: same ratio as `dfast` here (0.3348 vs 0.3346 on the
        real-forward plane of bench/codec.py) at ~1.8x the speed.
        """
        extra = {"strategy": zstd.STRATEGY_FAST} if self.level <= 3 else {}
        params = zstd.ZstdCompressionParameters.from_level(
            self.level, window_log=17, hash_log=6, chain_log=6, min_match=7, **extra,
        )
        return zstd.ZstdCompressor(compression_params=params)

    def low_plane_compressor(self) -> zstd.ZstdCompressor:
        """For the lower byte planes (mantissa bits, ~8 bits of entropy per byte): level -1.

        Nothing compresses there (level 3 and -1 alike on bench/codec.py's real plane), but level 3 still hunts
        matches: -1 encodes and decodes several times faster, since the frame is then mostly raw blocks. Still a
        plain zstd frame: the reader is unchanged.
        """
        params = zstd.ZstdCompressionParameters.from_level(
            -1, window_log=17, hash_log=6, chain_log=6, min_match=7,
        )
        return zstd.ZstdCompressor(compression_params=params)

    def whole_compressor(self) -> zstd.ZstdCompressor:
        return zstd.ZstdCompressor(level=self.level)


def to_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat uint8 array (no copy when already contiguous on the CPU)."""
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).reshape(-1).numpy()


def split_planes(raw: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """Byte k of every element, for k = 0..itemsize-1 (little endian: plane 0 is the lowest byte)."""
    if itemsize == 1:
        return [raw]
    if itemsize == 2 and sys.byteorder == "little":
        # mask and shift 16-bit words into preallocated planes: one sequential pass each, faster than two strided
        # byte gathers (bench/codec.py's encode spent a fifth of its time here)
        words = raw.view(np.uint16)
        lo, hi = np.empty(words.size, np.uint8), np.empty(words.size, np.uint8)
        np.bitwise_and(words, 0xFF, out=lo, casting="unsafe")
        np.right_shift(words, 8, out=hi, casting="unsafe")
        return [lo, hi]
    v = raw.reshape(-1, itemsize)
    return [np.ascontiguousarray(v[:, k]) for k in range(itemsize)]


JOIN_BLOCK = 1 << 17  # elements per block of join_planes (256 KB of output)


def join_planes(planes: list[bytes], itemsize: int, nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of split_planes into `out` (nbytes uint8), by default a fresh array (not zero-filled first)."""
    out = np.empty(nbytes, dtype=np.uint8) if out is None else out
    if itemsize == 1:
        out[:] = np.frombuffer(planes[0], dtype=np.uint8)
    elif itemsize == 2 and sys.byteorder == "little":
        # (high << 8) | low on 16-bit words: sequential passes, faster than two strided byte scatters; in blocks
        # that stay in the core's cache between the two passes
        words = out.view(np.uint16)
        lo, hi = np.frombuffer(planes[0], dtype=np.uint8), np.frombuffer(planes[1], dtype=np.uint8)
        for a in range(0, words.size, JOIN_BLOCK):
            w = words[a:a + JOIN_BLOCK]
            np.left_shift(hi[a:a + JOIN_BLOCK], 8, out=w, dtype=np.uint16)
            w |= lo[a:a + JOIN_BLOCK]
    else:
        v = out.reshape(-1, itemsize)
        for k, p in enumerate(planes):
            v[:, k] = np.frombuffer(p, dtype=np.uint8)
    return out


# float32 value of every float8_e4m3fn bit pattern (exact, NaN included): on the CPU a table lookup is faster than
# torch's per-element conversion, which made fp8 reads slower than bf16 ones
_FP8_AS_F32 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) scaled float8_e4m3fn: x ≈ q * scale[:, None]. All-zero rows get scale 1. A row's scale is
    its finite values' (a NaN or inf there left the rest of the row on another scale, or NaN); a NaN or inf is
    stored as NaN (e4m3fn has no inf: validation still counts it where it was); no scale is below float32's
    smallest normal (a smaller one rounded to 0, and 0/0 gave NaN)."""
    xf = x.to(torch.float32, copy=True)  # divided in place below (fresh tensors of this size fault in slowly)
    a = xf.abs()
    amax = a.amax(dim=-1)
    odd = not bool(torch.isfinite(amax).all())
    if odd:
        amax = a.nan_to_num_(nan=0.0, posinf=0.0).amax(dim=-1)
    del a
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0).clamp_min_(torch.finfo(torch.float32).tiny)
    xf.div_(scale[:, None])
    bad = ~torch.isfinite(xf) if odd else None
    xf.clamp_(-FP8_MAX, FP8_MAX)
    if bad is not None:
        xf.masked_fill_(bad, float("nan"))
    return xf.to(torch.float8_e4m3fn), scale.to(torch.float32)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """(q as float32 * scale[:, None]) rounded to dtype, into `out` (q's shape, dtype) if given."""
    f = torch.from_numpy(_FP8_AS_F32[q.contiguous().view(torch.uint8).numpy()])
    f.mul_(scale[:, None])
    return f.to(dtype) if out is None else out.copy_(f)
