"""Hostile dump directories and dump files: planted symlinks, foreign or open directories, FIFOs, markers and
pieces that lie (rows, ranges, dtypes, shapes, checksums). Each is refused with the exact error type."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash

from hsextract.sglang_plugin import dumpcheck
from hsextract.sglang_plugin.dumpcheck import DumpDirError, Refused

RID = "hsx-0-7"


def private(tmp_path: Path, name: str = "dump") -> Path:
    d = tmp_path / name
    d.mkdir(mode=0o700)
    d.chmod(0o700)
    return d


def piece_bytes(rid: str = RID, start: int = 0, end: int = 3, blocks: list | None = None, *, digest_xor: int = 0,
                payload: bytes | None = None, header_over: dict | None = None) -> bytes:
    """A piece file as the plugin writes it; `blocks` are (dtype, [rows, width]) with rows = end - start."""
    blocks = blocks or [("bfloat16", [end - start, 4]), ("bfloat16", [end - start, 4])]
    hdr_blocks, off = [], 0
    for dt, shape in blocks:
        n = shape[0] * shape[1] * dumpcheck.DTYPE_SIZES.get(dt, 2)
        hdr_blocks.append({"dtype": dt, "shape": shape, "offset": off, "nbytes": n})
        off += n
    body = payload if payload is not None else bytes(range(256)) * (off // 256) + bytes(off % 256)
    header = {"format": 1, "rid": rid, "start": start, "end": end, "n_tokens": 3, "blocks": hdr_blocks,
              "payload_xxh3": xxhash.xxh3_64_intdigest(body) ^ digest_xor, **(header_over or {})}
    raw = json.dumps(header).encode()
    return dumpcheck.MAGIC + struct.pack("<I", len(raw)) + raw + body


def as_array(b: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(b), dtype=np.uint8)


# --- the directory --------------------------------------------------------------------------------------
def test_a_private_directory_passes(tmp_path: Path) -> None:
    d, dev, ino = dumpcheck.private_dir(tmp_path, "hsx-x-")
    assert (os.lstat(d).st_mode & 0o777) == 0o700 and os.lstat(d).st_ino == ino and os.lstat(d).st_dev == dev
    dumpcheck.verify_dir(d)


@pytest.mark.parametrize("kind", ["symlink", "world_writable", "group_readable", "other_owner", "file", "missing"])
def test_an_unsafe_directory_is_refused(tmp_path: Path, kind: str) -> None:
    d = private(tmp_path)
    target = d
    if kind == "symlink":
        target = tmp_path / "link"
        target.symlink_to(d)
        want = "is a symlink"
    elif kind == "world_writable":
        d.chmod(0o777)
        want = "has mode 0777; it must be 0700"
    elif kind == "group_readable":
        d.chmod(0o750)
        want = "has mode 0750; it must be 0700"
    elif kind == "other_owner":
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(d, 4242, 4242)
        want = "is owned by uid 4242, not by this user (0)"
    elif kind == "file":
        target = tmp_path / "f"
        target.write_text("")
        want = "is not a directory"
    else:
        target = tmp_path / "nope"
        want = "No such file or directory"
    with pytest.raises(DumpDirError) as e:
        dumpcheck.verify_dir(target)
    assert type(e.value) is DumpDirError and str(e.value).startswith(f"dump directory {target}") and want in str(e.value)


# --- reading files -------------------------------------------------------------------------------------
def test_reads_refuse_fifos_symlinks_folders_and_oversize_files_without_blocking(tmp_path: Path) -> None:
    d = private(tmp_path)
    os.mkfifo(d / "a.piece")  # no writer: a blocking open would wait forever
    (d / "secret").write_bytes(b"x" * 10)
    (d / "b.piece").symlink_to(d / "secret")
    (d / "c.piece").mkdir()
    (d / "d.piece").write_bytes(b"y" * 11)
    cases = {"a.piece": "not a regular file", "b.piece": "cannot be opened (Too many levels of symbolic links)",
             "c.piece": "not a regular file", "d.piece": "11 bytes, more than the 10 it may hold"}
    for name, want in cases.items():
        with pytest.raises(Refused) as e:
            dumpcheck.read_regular(d / name, 10)
        assert str(e.value) == f"{d / name}: {want}"
    assert dumpcheck.read_regular(d / "secret", 10).tobytes() == b"x" * 10


# --- markers -------------------------------------------------------------------------------------------
def marker_bytes(**over: object) -> bytes:
    info = {"format": 1, "rid": RID, "n_tokens": 10, "pieces": [[0, 4], [4, 10]], "ids_sha256": "ab",
            "dtype": "bfloat16", "width": 8, **over}
    return json.dumps(info).encode()


MARKERS = {
    "not_json": (b"{oops", "the .done marker is not JSON"),
    "not_utf8": (b'{"rid": "\xff"}', "the .done marker is not UTF-8"),
    "nested": (b"[" * 100_000 + b"]" * 100_000, "the .done marker is nested too deeply"),
    "list": (b"[1]", "the .done marker is a JSON list, not an object"),
    "other_rid": (marker_bytes(rid="hsx-0-8"), "the .done marker is for 'hsx-0-8'"),
    "n_tokens_str": (marker_bytes(n_tokens="10"), "the server dumped '10' tokens, the prompt has 10"),
    "n_tokens_off": (marker_bytes(n_tokens=11), "the server dumped 11 tokens, the prompt has 10"),
    "pieces_missing": (marker_bytes(pieces=None), "pieces are not a list of [start, end] integer pairs"),
    "pieces_floats": (marker_bytes(pieces=[[0, 4.0], [4, 10]]), "pieces are not a list of [start, end] integer"),
    "pieces_gap": (marker_bytes(pieces=[[0, 4], [5, 10]]), "pieces do not tile the prompt: [5,10) where token 4"),
    "pieces_overlap": (marker_bytes(pieces=[[0, 4], [3, 10]]), "pieces do not tile the prompt: [3,10) where token 4"),
    "pieces_empty_range": (marker_bytes(pieces=[[0, 0], [0, 10]]), "pieces do not tile the prompt: [0,0)"),
    "pieces_short": (marker_bytes(pieces=[[0, 4], [4, 9]]), "pieces cover tokens [0,9) of 10"),
    "pieces_too_many": (marker_bytes(pieces=[[0, 1]] * 11), "pieces are not a list"),
    "no_digest": (marker_bytes(ids_sha256=None), "the .done marker has no ids_sha256"),
    "dtype_unknown": (marker_bytes(dtype="int8"), "the .done marker's dtype 'int8'"),
    "width_zero": (marker_bytes(width=0), "width 0"),
    "width_huge": (marker_bytes(width=1 << 40), "width 1099511627776"),
}


@pytest.mark.parametrize("name", sorted(MARKERS))
def test_lying_markers_are_refused(name: str) -> None:
    raw, want = MARKERS[name]
    with pytest.raises(Refused) as e:
        dumpcheck.marker(raw, RID, 10)
    assert want in str(e.value)


def test_a_true_marker_passes() -> None:
    assert dumpcheck.marker(marker_bytes(), RID, 10)["pieces"] == [[0, 4], [4, 10]]


# --- pieces --------------------------------------------------------------------------------------------
PIECES = {
    "empty": (b"", "not a dump piece (shorter than its header)"),
    "bad_magic": (b"HSXDUMP2" + piece_bytes()[8:], "not a dump piece (bad magic)"),
    "header_len_huge": (dumpcheck.MAGIC + struct.pack("<I", 1 << 31) + b"{}", "header length 2147483648 runs past"),
    "header_not_json": (dumpcheck.MAGIC + struct.pack("<I", 2) + b"{x", "the piece header is not JSON"),
    "header_list": (dumpcheck.MAGIC + struct.pack("<I", 2) + b"[]", "piece header is not a format-1 object"),
    "other_rid": (piece_bytes(rid="hsx-0-8"), "piece [0,3) holds 'hsx-0-8' [0,3)"),
    "other_range": (piece_bytes(header_over={"start": 1}), "piece [0,3) holds 'hsx-0-7' [1,3)"),
    "no_blocks": (piece_bytes(header_over={"blocks": []}), "piece header has no list of blocks"),
    "dtype_unknown": (piece_bytes(blocks=[("int8", [3, 4])]), "block 0: dtype 'int8' is not one of"),
    "dtype_pickle": (piece_bytes(blocks=[("object", [3, 4])]), "block 0: dtype 'object' is not one of"),
    "shape_3d": (piece_bytes(blocks=[("bfloat16", [3, 4, 1])]), "block 0: shape [3, 4, 1] is not [rows, width]"),
    "fewer_rows": (piece_bytes(blocks=[("bfloat16", [2, 4]), ("bfloat16", [2, 4])]),
                   "block 0 has 2 rows, its range [0,3) has 3"),
    "more_rows": (piece_bytes(blocks=[("bfloat16", [3, 4]), ("bfloat16", [4, 4])]),
                  "block 1 has 4 rows, its range [0,3) has 3"),
    "width_zero": (piece_bytes(blocks=[("bfloat16", [3, 0])]), "block 0: width 0 outside"),
    "shape_disagrees_with_bytes": (piece_bytes(header_over={"blocks": [
        {"dtype": "bfloat16", "shape": [3, 8], "offset": 0, "nbytes": 24}]}), "block 0: offset 0 / nbytes 24"),
    "blocks_overlap": (piece_bytes(header_over={"blocks": [
        {"dtype": "bfloat16", "shape": [3, 4], "offset": 0, "nbytes": 24},
        {"dtype": "bfloat16", "shape": [3, 4], "offset": 0, "nbytes": 24}]}), "block 1: offset 0 / nbytes 24"),
    "payload_longer": (piece_bytes() + b"\0", "blocks hold 48 bytes, the payload 49"),
    "payload_shorter": (piece_bytes()[:-1], "blocks hold 48 bytes, the payload 47"),
    "checksum_wrong": (piece_bytes(digest_xor=1), "payload checksum mismatch (xxh3)"),
    "checksum_missing": (piece_bytes(header_over={"payload_xxh3": None}), "payload checksum mismatch (xxh3)"),
}


@pytest.mark.parametrize("name", sorted(PIECES))
def test_lying_pieces_are_refused(name: str) -> None:
    raw, want = PIECES[name]
    with pytest.raises(Refused) as e:
        dumpcheck.piece(as_array(raw), RID, 0, 3)
    assert want in str(e.value)


def test_a_true_piece_passes() -> None:
    _, blocks = dumpcheck.piece(as_array(piece_bytes()), RID, 0, 3)
    base = len(piece_bytes()) - 48
    assert blocks == [("bfloat16", 4, base), ("bfloat16", 4, base + 24)]


@pytest.mark.parametrize("kind", ["symlink", "world_writable"])
def test_the_plugin_refuses_an_unsafe_dump_directory(tmp_path: Path, kind: str) -> None:
    from hsextract.sglang_plugin import plugin

    d = private(tmp_path)
    if kind == "symlink":
        (tmp_path / "link").symlink_to(d)
        d = tmp_path / "link"
    else:
        d.chmod(0o777)
    env = {plugin.ENV_DUMP_DIR: str(d), plugin.ENV_AUX_LAYERS: "1,2", plugin.ENV_FINAL_STATE: "post_norm"}
    with pytest.raises(plugin.PluginConfigError, match=rf"^HSEXTRACT_DUMP_DIR={d}: dump directory {d} "
                                                       rf"(is a symlink|has mode 0777)"):
        plugin.PluginConfig.from_env(env)
