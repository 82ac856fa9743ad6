"""Checks of the dump directory and of dump files, before the plugin or the client trusts them.

The dump directory is a hand-over point between two processes: whoever else can write there could plant
files (a symlink where a piece will be written, a marker that lies, a FIFO that blocks a read). So:

- the directory is ours or refused: a real directory (not a symlink), owned by this user, mode 0700;
- a file is read only if it is a regular file (opened O_NONBLOCK|O_NOFOLLOW, checked with fstat, never
  more than the size it may legitimately have);
- a marker or piece is parsed, then checked (types, closed sets of dtypes, ranges that tile the prompt, row
  counts equal to the declared ranges, payload xxh3) before any of it is used.

`Refused` carries what is wrong; `dumpfiles` turns it into a DumpError naming the request.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from hsextract.errors import EngineError

MAGIC = b"HSXDUMP1"
FORMAT = 1
HEAD = struct.Struct("<8sI")
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}
MAX_MARKER_BYTES = 1 << 20
MAX_HEADER_BYTES = 1 << 16
MAX_BLOCKS = 1024
MAX_WIDTH = 1 << 24
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class Refused(Exception):
    """A dump file that must not be used, and why."""


class DumpDirError(EngineError):
    """The dump directory is not private to this user: it may hold planted files."""


def verify_dir(path: str | os.PathLike[str]) -> os.stat_result:
    """lstat `path`: a directory, not a symlink, owned by this user, no access for group or others."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise DumpDirError(f"dump directory {path}: {e.strerror}; the server launcher creates it") from None
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700"
    if problem:
        raise DumpDirError(f"dump directory {path} {problem}: another user could plant files there. Use the "
                           "private directory the server launcher creates (mode 0700).")
    return st


def read_regular(path: str | os.PathLike[str], max_bytes: int) -> np.ndarray:
    """The bytes of `path` (uint8 array) if it is a regular file of at most `max_bytes`; never blocks on a
    FIFO, never follows a symlink."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        raise Refused(f"{path}: cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{path}: not a regular file")
        if st.st_size > max_bytes:
            raise Refused(f"{path}: {st.st_size} bytes, more than the {max_bytes} it may hold")
        # uninitialised and unbuffered: several times faster than reading into a zero-filled buffer
        data = np.empty(st.st_size, dtype=np.uint8)
        view, got = memoryview(data), 0
        while got < st.st_size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise Refused(f"{path}: read {got} of {st.st_size} bytes (the file shrank)")
            got += n
        return data
    finally:
        os.close(fd)


def load_json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise Refused(f"{what} is not UTF-8") from None
    except RecursionError:
        raise Refused(f"{what} is nested too deeply") from None
    except ValueError as e:
        raise Refused(f"{what} is not JSON ({e})") from None


def is_int(v: Any) -> bool:
    return type(v) is int


def marker(raw: bytes, rid: str, n_tokens: int) -> dict[str, Any]:
    """A `.done` marker, checked: this rid, this prompt length, a start 0 <= start < n_tokens (0 when absent: a
    marker of a plugin before shared prefixes), pieces that tile [start, n_tokens) exactly."""
    info = load_json(raw, "the .done marker")
    if not isinstance(info, dict):
        raise Refused(f"the .done marker is a JSON {type(info).__name__}, not an object")
    if info.get("format") != FORMAT or info.get("rid") != rid:
        raise Refused(f"the .done marker is for {info.get('rid')!r}, format {info.get('format')!r}")
    if not is_int(info.get("n_tokens")) or info["n_tokens"] != n_tokens:
        raise Refused(f"the server dumped {info.get('n_tokens')!r} tokens, the prompt has {n_tokens}; a rid was "
                      "reused or the server tokenized differently")
    start = info.setdefault("start", 0)
    if not is_int(start) or not 0 <= start < n_tokens:
        raise Refused(f"the .done marker's start {start!r} is outside [0, {n_tokens - 1}] (the first computed row of "
                      f"a {n_tokens}-token prompt)")
    pieces = info.get("pieces")
    if not (isinstance(pieces, list) and 0 < len(pieces) <= n_tokens
            and all(isinstance(p, list) and len(p) == 2 and all(is_int(x) for x in p) for p in pieces)):
        raise Refused(f"the .done marker's pieces are not a list of [start, end] integer pairs: {str(pieces)[:200]}")
    pos = start
    for a, b in pieces:
        if a != pos or b <= a:
            raise Refused(f"pieces do not tile the prompt: [{a},{b}) where token {pos} comes next")
        pos = b
    if pos != n_tokens:
        raise Refused(f"pieces cover tokens [{start},{pos}) of {n_tokens}")
    if not isinstance(info.get("ids_sha256"), str):
        raise Refused("the .done marker has no ids_sha256")
    if info.get("dtype") not in DTYPE_SIZES or not (is_int(info.get("width")) and 0 < info["width"] <= MAX_WIDTH):
        raise Refused(f"the .done marker's dtype {info.get('dtype')!r} / width {info.get('width')!r}: dtype one of "
                      f"{sorted(DTYPE_SIZES)}, width a positive integer")
    return info


def max_piece_bytes(rows: int, width: int, dtype: str) -> int:
    return HEAD.size + MAX_HEADER_BYTES + rows * width * DTYPE_SIZES[dtype]


def piece(data: np.ndarray, rid: str, start: int, end: int) -> tuple[dict[str, Any], list[tuple[str, int, int]]]:
    """A piece file's header, checked against its bytes: (header, [(dtype, width, offset)] per block).

    Rows of every block equal end - start; block sizes follow from dtype and shape; the blocks tile the
    payload exactly; the payload's xxh3 is the header's."""
    if len(data) < HEAD.size:
        raise Refused("not a dump piece (shorter than its header)")
    magic, hlen = HEAD.unpack_from(data)
    if magic != MAGIC:
        raise Refused("not a dump piece (bad magic)")
    if hlen > MAX_HEADER_BYTES or HEAD.size + hlen > len(data):
        raise Refused(f"header length {hlen} runs past the file or the {MAX_HEADER_BYTES}-byte limit")
    header = load_json(data[HEAD.size:HEAD.size + hlen].tobytes(), "the piece header")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise Refused(f"piece header is not a format-{FORMAT} object")
    if header.get("rid") != rid or header.get("start") != start or header.get("end") != end:
        raise Refused(f"piece [{start},{end}) holds {header.get('rid')!r} "
                      f"[{header.get('start')!r},{header.get('end')!r})")
    blocks = header.get("blocks")
    if not (isinstance(blocks, list) and 0 < len(blocks) <= MAX_BLOCKS):
        raise Refused("piece header has no list of blocks")
    rows, base, off, out = end - start, HEAD.size + hlen, 0, []
    for k, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("dtype") not in DTYPE_SIZES:
            raise Refused(f"block {k}: dtype {b.get('dtype') if isinstance(b, dict) else b!r} is not one of "
                          f"{sorted(DTYPE_SIZES)}")
        shape = b.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2 and all(is_int(x) for x in shape)):
            raise Refused(f"block {k}: shape {shape!r} is not [rows, width]")
        if shape[0] != rows:
            raise Refused(f"block {k} has {shape[0]} rows, its range [{start},{end}) has {rows}")
        if not 0 < shape[1] <= MAX_WIDTH:
            raise Refused(f"block {k}: width {shape[1]} outside [1, {MAX_WIDTH}]")
        nbytes = rows * shape[1] * DTYPE_SIZES[b["dtype"]]
        if b.get("offset") != off or b.get("nbytes") != nbytes:
            raise Refused(f"block {k}: offset {b.get('offset')!r} / nbytes {b.get('nbytes')!r}, its shape and the "
                          f"blocks before it make them {off} / {nbytes}")
        out.append((b["dtype"], shape[1], base + off))
        off += nbytes
    if base + off != len(data):
        raise Refused(f"blocks hold {off} bytes, the payload {len(data) - base}")
    digest = header.get("payload_xxh3")
    if not is_int(digest) or digest != xxhash.xxh3_64_intdigest(data[base:]):
        raise Refused("payload checksum mismatch (xxh3)")
    return header, out


def payload_digest(chunks: list[memoryview] | list[bytes]) -> int:
    h = xxhash.xxh3_64()
    for c in chunks:
        h.update(c)
    return h.intdigest()


def err_message(raw: bytes) -> str:
    info = load_json(raw, "the .err marker")
    msg = info.get("error") if isinstance(info, dict) else None
    return msg if isinstance(msg, str) else "?"


def private_dir(base: str | os.PathLike[str], prefix: str) -> tuple[Path, int, int]:
    """A new directory under `base` (mode 0700, random name), verified: (path, st_dev, st_ino)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    st = verify_dir(path)
    return path, st.st_dev, st.st_ino
