"""Helpers of the hostile-input tests: craft shards with valid checksums around invalid structure, and run a
reader under an address-space limit in a forked child, reporting the error and the memory it took.

Checksums are computed for every crafted part, so each case reaches the structure check it aims at instead
of stopping at a checksum: the shards are what an attacker (not a bit flip) would write.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import zstandard as zstd
from conftest import make_sample, shard_metadata

from hsextract.shard import ShardReader, ShardWriter
from hsextract.shard import format as fmt

TESTS = Path(__file__).resolve().parent


def real_shard(path: Path, n: int = 3, seq: int = 5, **writer_kw: Any) -> Path:
    with ShardWriter(path, shard_metadata(), **writer_kw) as w:
        for k in range(n):
            w.add(*make_sample(seq + k, seed=k), sample_id=f"s{k}")
    return path


# (parent, prefix length) of each sample of `family`: a tree whose walks take rows from one, two or three records
FAMILY = [(-1, 0), (0, 5), (1, 7), (0, 3), (2, 6), (-1, 0)]


def family(hidden: int = 16, n: int = 4, seed: int = 0) -> list[tuple[Any, list[Any], Any]]:
    """Samples whose ids (and rows: the same prefix has the same states) agree with their FAMILY parent's over the
    prefix, each then going on with ids and rows of its own; full rows, as a flat shard stores them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out: list[tuple[Any, list[Any], Any]] = []
    for k, (parent, prefix) in enumerate(FAMILY):
        seq = 8 + 2 * k
        ids = torch.randint(0, 1000, (seq,), generator=g)
        hs = [(torch.randn(seq, hidden, generator=g) * (j + 1)).to(torch.bfloat16) for j in range(n)]
        if parent >= 0:
            ids[:prefix] = out[parent][0][:prefix]
            for h, ph in zip(hs, out[parent][1], strict=True):
                h[:prefix] = ph[:prefix]
        mask = (torch.rand(seq, generator=g) > 0.5).long()
        mask[-1] = 1
        out.append((ids, hs, mask))
    return out


def shared_shard(path: Path, samples: list[tuple[Any, list[Any], Any]] | None = None, **writer_kw: Any) -> Path:
    """A version-2 shard of `family()` (or `samples` of that shape): each sample with its FAMILY reference."""
    samples = family() if samples is None else samples
    with ShardWriter(path, shard_metadata(), share_prefixes=True, **writer_kw) as w:
        for k, ((ids, hs, mask), (parent, prefix)) in enumerate(zip(samples, FAMILY, strict=True)):
            w.add(ids, [h[prefix:] for h in hs], mask, sample_id=f"s{k}",
                  parent=None if parent < 0 else parent, prefix_len=prefix)
    return path


class Parts:
    """A shard taken apart: metadata, record payloads and index, reassembled with fresh checksums."""

    def __init__(self, path: Path) -> None:
        r = ShardReader(path)
        self.meta: Any = dict(r.metadata)
        self.version = r.metadata["format_version"]  # header and footer say it
        data = path.read_bytes()
        self.payloads = [data[o + fmt.RECORD.size:o + ln] for o, ln in zip(r.index["offsets"], r.index["record_lens"],
                                                                           strict=True)]
        self.index: Any = {c: list(v) for c, v in r.index.items()}
        r.close()

    def seed(self, k: int) -> int:
        """Record k's digest seed: its reference as the index states it (0 where there is none, or no valid one)."""
        try:
            parent, prefix = self.index["parents"][k], self.index["prefix_lens"][k]
            ok = type(parent) is int and type(prefix) is int
            return fmt.reference_seed(parent, prefix) & ((1 << 64) - 1) if ok else 0
        except (KeyError, IndexError, TypeError):
            return 0

    def meta_bytes(self) -> bytes:
        return self.meta if isinstance(self.meta, bytes) else json.dumps(self.meta, sort_keys=True,
                                                                          separators=(",", ":")).encode()

    def build(self, *, meta_raw: bytes | None = None, index_raw: bytes | None = None, index_frame: bytes | None = None,
              relocate: bool = True, reserved: int = 0, footer_reserved: int = 0, n: int | None = None,
              records: list[bytes] | None = None, meta_len: int | None = None) -> bytes:
        """The shard's bytes. relocate: rewrite offsets, record_lens, payload_xxh3 to match the records."""
        meta = meta_raw if meta_raw is not None else self.meta_bytes()
        head = fmt.HEADER.pack(fmt.HEADER_MAGIC, self.version, reserved,
                               len(meta) if meta_len is None else meta_len, fmt.crc32(meta)) + meta
        body = bytearray()
        offsets, lens, digests = [], [], []
        for k, payload in enumerate(self.payloads):
            offsets.append(len(head) + len(body))
            digest = fmt.payload_hash(payload, self.seed(k))
            rec = fmt.pack_record_header(k, len(payload), digest) + payload
            lens.append(len(rec))
            digests.append(digest)
            body += rec
        if records is not None:  # raw record bytes instead (records already packed)
            body = bytearray(b"".join(records))
        ix = self.index
        if relocate and isinstance(ix, dict) and records is None:
            ix = dict(ix, offsets=offsets, record_lens=lens, payload_xxh3=digests)
        if index_frame is None:
            raw = index_raw if index_raw is not None else json.dumps(ix, separators=(",", ":")).encode()
            index_frame = zstd.ZstdCompressor(level=3, write_checksum=True).compress(raw)
        ix_off = len(head) + len(body)
        count = len(self.payloads) if n is None else n
        foot = struct.pack("<QQIIHH", ix_off, len(index_frame), fmt.crc32(index_frame), count, self.version,
                           footer_reserved)
        foot += struct.pack("<I", fmt.crc32(foot)) + fmt.FOOTER_MAGIC
        return bytes(head) + bytes(body) + index_frame + foot


def frame_header_claiming(size: int, content: int = 1, checksum: bool = False) -> bytes:
    """A zstd frame that declares `size` bytes of content and holds `content` bytes (one RLE block)."""
    fhd = 0b11100000 | (0b100 if checksum else 0)  # 8-byte content size, single segment
    block = 1 | (1 << 1) | (content << 3)  # last block, RLE, `content` bytes
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + struct.pack("<Q", size) + struct.pack("<I", block)[:3] + b"\0"


def bomb(size: int, declare: bool) -> bytes:
    """A real zstd frame of `size` zero bytes (compresses ~30000:1), its size declared in the header or not."""
    cctx = zstd.ZstdCompressor(level=1, write_content_size=declare)
    chunk = bytes(1 << 20)
    out = cctx.compressobj(size=size if declare else -1)
    parts = [out.compress(chunk) for _ in range(size >> 20)]
    return b"".join(parts) + out.flush()


RUNNER = textwrap.dedent(
    """
    import contextlib, io, json, os, resource, sys
    import torch  # noqa: F401 - loaded before the limit, as a real consumer has it
    from hsextract.cli import main as cli_main
    import hsextract.shard.inspect  # noqa: F401 - loaded before the fork: the figures are the case's own
    from hsextract.shard import ShardReader

    def vm_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    def rss_kb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

    def case(path, how):
        if how == "inspect":
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
                rc = cli_main(["inspect", path])
            return {"rc": rc, "stderr": err.getvalue()}
        r = ShardReader(path)
        r.check_records()
        for i in range(len(r)):
            r[i]
        return len(r)

    headroom = int(sys.argv[1])
    for line in sys.stdin:
        path, how = json.loads(line)
        rd, wr = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rd)
            start = rss_kb()
            limit = vm_bytes() + headroom
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            try:
                out = {"ok": case(path, how)}
            except BaseException as e:
                out = {"error": type(e).__name__, "message": str(e)[:2000]}
            out["peak_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start
            os.write(wr, json.dumps(out).encode())
            os._exit(0)
        os.close(wr)
        data = b""
        while chunk := os.read(rd, 65536):
            data += chunk
        os.close(rd)
        os.waitpid(pid, 0)
        print(data.decode() if data else json.dumps({"error": "child died"}), flush=True)
    """
)


def run_limited(cases: list[tuple[str, str]], headroom: int = 256 << 20) -> list[dict[str, Any]]:
    """Open (and read, or `inspect`) each shard in a forked child limited to its address space + headroom.

    Returns per case {"error": type name, "message", "peak_kb": resident growth} or {"ok": ...}.
    """
    env = dict(os.environ, PYTHONPATH=f"{TESTS.parent / 'src'}{os.pathsep}{TESTS}")
    stdin = "".join(json.dumps([str(p), how]) + "\n" for p, how in cases)
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(headroom)], input=stdin, capture_output=True, text=True,
                          env=env, check=True)
    return [json.loads(line) for line in proc.stdout.splitlines()]


def peak_rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
