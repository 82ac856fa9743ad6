"""Per-request dump files: the hand-over between the SGLang plugin (writer) and the client (collector).

One prompt arrives as one or more *pieces* (chunked prefill, or a large extend split to fit the staging
buffer). Each piece is one file; a `.done` marker lists the pieces once the last one is in, an `.err`
marker says why a request cannot be completed. Every file is written through `atomic` (a fresh
O_EXCL|O_NOFOLLOW temporary name, renamed), so a reader never sees a partial file and a planted name is
never followed. Reading trusts nothing (`dumpcheck`): only regular files, opened without blocking and never
past the size their range allows; markers and headers checked before use; any problem is a DumpError
naming the request, which the client retries like any other dump error.

Piece file, format 1 (little endian):

    offset  size  field
    0       8     magic b"HSXDUMP1"
    8       4     u32 header length L
    12      L     header, UTF-8 JSON: {"format": 1, "rid", "start", "end", "n_tokens",
                  "blocks": [{"dtype", "shape": [rows, width], "offset", "nbytes"}], "payload_xxh3"}
    12+L    ...   payload: the blocks' raw bytes; "offset" counts from the payload start; "payload_xxh3"
                  is XXH3-64 (seed 0) of the whole payload, as the shards use

The blocks of one piece, concatenated along columns, give [rows, num_tensors * hidden] in layer order
(aux layers, then the final state). No pickle: tensors are raw bytes, the header is JSON.

`.done` marker, JSON: {"format", "rid", "n_tokens", "start", "pieces": [[start, end], ...], "ids_sha256", "dtype",
"width"}: the pieces tile [start, n_tokens); start is 0 unless the server runs with its radix cache on
(HSEXTRACT_SHARED_PREFIX, docs/SHARED_PREFIX.md), where it is the request's prefix-cache hit (absent in markers
of older plugins: 0). Plus diagnostics a reader may ignore: "staged_at" and "written_at" (wall clock when the last
piece was staged in the forward hook and when the marker was written) and "lane" (the writer thread).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hsextract.atomic import write_bytes_atomic
from hsextract.errors import EngineError
from hsextract.sglang_plugin import dumpcheck
from hsextract.sglang_plugin.dumpcheck import FORMAT, MAGIC

PIECE_SUFFIX = ".piece"
DONE_SUFFIX = ".done"
ERR_SUFFIX = ".err"
PLUGIN_MARKER_PREFIX = "plugin-"
_RID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


class DumpTimeout(EngineError):
    """The server answered but no `.done` marker appeared in time."""


class DumpError(EngineError):
    """A dump marker or piece says the request cannot be assembled (plugin-side `.err`, bad bytes)."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dump files hold bfloat16, float16 or float32, not {dtype}")


def is_safe_rid(rid: str) -> bool:
    """Rids become file names: letters, digits, '_', '.', '-' only, no leading dot."""
    return bool(_RID_RE.match(rid))


def piece_name(rid: str, start: int, end: int) -> str:
    return f"{rid}.{start:010d}-{end:010d}{PIECE_SUFFIX}"


def done_name(rid: str) -> str:
    return rid + DONE_SUFFIX


def err_name(rid: str) -> str:
    return rid + ERR_SUFFIX


def ids_digest(ids: Sequence[int] | np.ndarray) -> str:
    """sha256 of the token ids as little-endian int64: the client checks the server saw its exact ids."""
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class RawBlock:
    """One block of a piece as raw bytes (a view of the staging ring): the plugin's writer threads hand
    these to `write_piece` and touch no tensor, so each piece costs them only the few GIL round trips of
    `write_bytes_atomic`; the GIL is held by SGLang's spinning scheduler most of the time."""

    dtype: str
    shape: tuple[int, int]
    data: memoryview  # uint8, rows * width * itemsize bytes


def _write(path: Path, chunks: Sequence[bytes | memoryview]) -> None:
    # os-level calls, few GIL round trips per file; no fsync: a dump lives for seconds and a crash retries it
    write_bytes_atomic(path, chunks, durable=False, mode=0o600)


def write_piece(
    dump_dir: Path, rid: str, start: int, end: int, n_tokens: int, blocks: Sequence[torch.Tensor | RawBlock]
) -> Path:
    """Write one piece. `blocks` are CPU tensors [end-start, width_j] (bytes taken as they are) or RawBlocks."""
    header_blocks, payload, off = [], [], 0
    for b in blocks:
        if isinstance(b, torch.Tensor):
            if b.dim() != 2:
                raise ValueError(f"piece {rid} [{start},{end}): block of shape {tuple(b.shape)} is not 2-D")
            b = RawBlock(dtype_name(b.dtype), (b.shape[0], b.shape[1]),
                         memoryview(b.contiguous().view(torch.uint8).reshape(-1).numpy()))
        if b.shape[0] != end - start:
            raise ValueError(f"piece {rid} [{start},{end}): block of shape {tuple(b.shape)} has the wrong rows")
        n = len(b.data)
        header_blocks.append({"dtype": b.dtype, "shape": list(b.shape), "offset": off, "nbytes": n})
        payload.append(b.data)
        off += n
    header = json.dumps(
        {"format": FORMAT, "rid": rid, "start": start, "end": end, "n_tokens": n_tokens, "blocks": header_blocks,
         "payload_xxh3": dumpcheck.payload_digest(payload)}
    ).encode()
    path = Path(dump_dir) / piece_name(rid, start, end)
    _write(path, [MAGIC, struct.pack("<I", len(header)), header, *payload])
    return path


_PIECE_RE = re.compile(r"^(.+)\.(\d{10})-(\d{10})" + re.escape(PIECE_SUFFIX) + "$")


def read_piece(path: Path, max_bytes: int | None = None) -> tuple[dict, list[torch.Tensor]]:
    """Read and check one piece file against the rid and range its name states (dumpcheck.piece), reading no
    more than `max_bytes` (None: the file's own size, for tools); raises DumpError naming the request."""
    path = Path(path)
    m = _PIECE_RE.match(path.name)
    if not m:
        raise DumpError(f"{path}: not a piece file name (<rid>.<start>-<end>{PIECE_SUFFIX})")
    rid, start, end = m.group(1), int(m.group(2)), int(m.group(3))
    try:
        data = dumpcheck.read_regular(path, (1 << 62) if max_bytes is None else max_bytes)
        header, blocks = dumpcheck.piece(data, rid, start, end)
    except dumpcheck.Refused as e:
        raise DumpError(f"request {rid}: piece {path.name}: {e}") from None
    rows = end - start
    tensors = [torch.frombuffer(data, dtype=torch.uint8, count=rows * width * dumpcheck.DTYPE_SIZES[dt], offset=lo)
               .view(_DTYPES[dt]).view(rows, width) for dt, width, lo in blocks]
    return header, tensors


def write_done(dump_dir: Path, rid: str, info: dict) -> Path:
    path = Path(dump_dir) / done_name(rid)
    _write(path, [json.dumps({"format": FORMAT, "rid": rid, **info}).encode()])
    return path


def write_err(dump_dir: Path, rid: str, message: str) -> Path:
    path = Path(dump_dir) / err_name(rid)
    _write(path, [json.dumps({"format": FORMAT, "rid": rid, "error": message}).encode()])
    return path


def _unlink(paths: Iterable[Path]) -> int:
    n = 0
    for p in paths:
        try:
            p.unlink()
            n += 1
        except FileNotFoundError:  # a concurrent remover's
            pass
    return n


def remove_rid(dump_dir: Path, rid: str) -> int:
    """Delete every file of `rid` (pieces, markers); returns how many were removed."""
    return _unlink(Path(dump_dir).glob(f"{glob_escape(rid)}.*"))


def remove_prefixed(dump_dir: Path, prefix: str, keep: str | None = None) -> int:
    """Delete every file whose name starts with `prefix` (but not with `keep`); returns how many were removed."""
    return _unlink(p for p in Path(dump_dir).glob(f"{glob_escape(prefix)}*")
                   if keep is None or not p.name.startswith(keep))


def glob_escape(s: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", s)


STATS_KEYS = ("requests_done", "requests_failed", "pieces", "rids_reused", "duplicates_skipped", "write_errors",
              "last_error", "queued", "staging_waits", "staging_peak", "staging_capacity")


def read_writer_stats(dump_dir: Path) -> dict[int, dict]:
    """The plugin's `stats-<pid>.json` files, by scheduler pid (one per writer rank); unreadable ones skipped."""
    out = {}
    for f in sorted(Path(dump_dir).glob("stats-*.json")):
        try:
            out[int(f.stem.split("-", 1)[1])] = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return out


def writer_stats_summary(dump_dir: Path) -> str:
    """One line from the plugin's `stats-<pid>.json` files: what the server-side writer has done."""
    stats = read_writer_stats(dump_dir)
    if not stats:
        return "the plugin's writer has written no stats file (it never received a piece)"
    parts = []
    for pid, st in stats.items():
        kv = ", ".join(f"{k}={st[k]}" for k in STATS_KEYS if st.get(k) not in (None, 0))
        age = time.time() - st.get("time", time.time())
        parts.append(f"stats-{pid}.json ({age:.0f} s old): {kv or 'all zero'}")
    return "writer stats: " + "; ".join(parts)


@dataclass(frozen=True)
class Collected:
    rid: str
    hidden_states: list[torch.Tensor]  # num_tensors x [n_tokens - start, hidden]: the rows of positions start..
    pieces: int
    marker: dict  # the `.done` marker's contents (pieces, digests, the writer's timestamps)
    start: int = 0  # the first row's position (> 0 only after a prefix-cache hit, with allow_start)


def collect(
    dump_dir: Path,
    rid: str,
    input_ids: Sequence[int],
    num_tensors: int,
    timeout_s: float,
    *,
    poll_s: float = 0.002,
    should_stop: Callable[[], bool] | None = None,
    remove: bool = True,
    allow_start: bool = False,
) -> Collected:
    """Wait for `rid`'s `.done` (or `.err`), check it is this prompt, assemble the pieces, delete the files.

    `allow_start`: the rows may begin after position 0 (a prefix-cache hit of a server in shared-prefix mode);
    without it such a dump is a DumpError. Raises DumpTimeout after `timeout_s`, DumpError for a plugin-side
    error or inconsistent files.
    """
    dump_dir = Path(dump_dir)
    done, err = dump_dir / done_name(rid), dump_dir / err_name(rid)
    deadline = time.monotonic() + timeout_s
    sleep = poll_s
    while not done.exists():
        if err.exists():
            try:
                msg = dumpcheck.err_message(dumpcheck.read_regular(err, dumpcheck.MAX_MARKER_BYTES).tobytes())
            except dumpcheck.Refused as e:
                msg = f"(unreadable .err marker: {e})"
            if remove:
                remove_rid(dump_dir, rid)
            raise DumpError(f"request {rid}: the server-side dumper reported: {msg}")
        if time.monotonic() > deadline:
            pieces = len(list(dump_dir.glob(f"{glob_escape(rid)}.*{PIECE_SUFFIX}")))
            raise DumpTimeout(
                f"request {rid}: no dump marker {done} after {timeout_s:g} s although the server answered "
                f"({pieces} piece files of it are there); {writer_stats_summary(dump_dir)} (is the server "
                f"running with SGLANG_PLUGINS=hsextract and HSEXTRACT_DUMP_DIR={dump_dir}?)"
            )
        if should_stop is not None and should_stop():
            raise EngineError(f"request {rid}: collection cancelled")
        time.sleep(sleep)
        sleep = min(sleep * 1.5, 0.01)  # the dump is due right after the HTTP answer: poll closely
    n = len(input_ids)
    try:
        info = dumpcheck.marker(dumpcheck.read_regular(done, dumpcheck.MAX_MARKER_BYTES).tobytes(), rid, n)
    except dumpcheck.Refused as e:
        raise DumpError(f"request {rid}: {e}") from None
    if info["ids_sha256"] != ids_digest(input_ids):
        raise DumpError(f"request {rid}: the token ids the server saw differ from the prompt's (sha256 mismatch)")
    if info["start"] and not allow_start:
        raise DumpError(f"request {rid}: the server computed tokens [{info['start']},{n}) only (a prefix-cache hit): "
                        "a run without share_prefixes needs a server with --disable-radix-cache")
    blocks_per_piece: list[list[torch.Tensor]] = []
    for start, end in info["pieces"]:
        limit = dumpcheck.max_piece_bytes(end - start, info["width"], info["dtype"])
        _, tensors = read_piece(dump_dir / piece_name(rid, start, end), limit)
        blocks_per_piece.append(tensors)
    hidden = _assemble(rid, blocks_per_piece, num_tensors)
    if remove:
        for start, end in info["pieces"]:
            (dump_dir / piece_name(rid, start, end)).unlink(missing_ok=True)
        done.unlink(missing_ok=True)
    return Collected(rid=rid, hidden_states=hidden, pieces=len(info["pieces"]), marker=info, start=info["start"])


def _assemble(rid: str, blocks_per_piece: list[list[torch.Tensor]], num_tensors: int) -> list[torch.Tensor]:
    """num_tensors contiguous [n_tokens, H] tensors from the pieces' blocks, copying as little as possible.

    The plugin writes one block per tensor: a one-piece dump's blocks are used as read (no copy), pieces
    of a chunked prompt are joined along rows. Other block layouts (e.g. one [rows, K*H] block, as older
    plugins wrote) are split by columns."""
    widths = {t.shape[1] for blocks in blocks_per_piece for t in blocks}
    layouts = {tuple((t.dtype, t.shape[1]) for t in blocks) for blocks in blocks_per_piece}
    if len(layouts) != 1:
        raise DumpError(f"request {rid}: pieces disagree on their blocks' dtypes and widths "
                        f"({sorted(map(str, layouts))})")
    if len(widths) == 1 and all(len(blocks) == num_tensors for blocks in blocks_per_piece):  # block per tensor
        if len(blocks_per_piece) == 1:
            return list(blocks_per_piece[0])
        return [torch.cat([blocks[i] for blocks in blocks_per_piece], dim=0) for i in range(num_tensors)]
    if len(blocks_per_piece) == 1 and len(blocks_per_piece[0]) == 1:
        rows = blocks_per_piece[0][0]
    else:
        rows = torch.cat([torch.cat(blocks, dim=1) for blocks in blocks_per_piece], dim=0)
    total = rows.shape[1]
    if total % num_tensors:
        raise DumpError(f"request {rid}: {total} columns do not split into {num_tensors} tensors")
    h = total // num_tensors
    return [rows[:, i * h : (i + 1) * h].contiguous() for i in range(num_tensors)]
