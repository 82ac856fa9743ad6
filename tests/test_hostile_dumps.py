"""Hostile dump directories and dump files: planted symlinks, foreign or open directories, FIFOs, markers and
pieces that lie (rows, ranges, dtypes, shapes, checksums). Each is refused with the exact error type."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import stat
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from hsextract.sglang_plugin import dumpcheck, dumpfiles
from hsextract.sglang_plugin.dumpcheck import DumpDirError, Refused
from hsextract.sglang_plugin.dumpfiles import DumpError

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
    assert type(e.value) is DumpDirError
    assert str(e.value).startswith(f"dump directory {target}") and want in str(e.value)


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
    # shared prefixes: the pieces tile [start, n_tokens), 0 <= start < n_tokens
    "start_negative": (marker_bytes(start=-1, pieces=[[-1, 10]]), "the .done marker's start -1 is outside [0, 9]"),
    "start_at_the_end": (marker_bytes(start=10, pieces=[[10, 10]]), "the .done marker's start 10 is outside [0, 9]"),
    "start_str": (marker_bytes(start="4", pieces=[[4, 10]]), "the .done marker's start '4' is outside [0, 9]"),
    "start_float": (marker_bytes(start=4.0, pieces=[[4, 10]]), "the .done marker's start 4.0 is outside [0, 9]"),
    "start_after_first_piece": (marker_bytes(start=4), "pieces do not tile the prompt: [0,4) where token 4"),
    "start_before_first_piece": (marker_bytes(start=2, pieces=[[4, 10]]), "pieces do not tile the prompt: [4,10) "
                                                                          "where token 2"),
    "start_short": (marker_bytes(start=4, pieces=[[4, 9]]), "pieces cover tokens [4,9) of 10"),
}


@pytest.mark.parametrize("name", sorted(MARKERS))
def test_lying_markers_are_refused(name: str) -> None:
    raw, want = MARKERS[name]
    with pytest.raises(Refused) as e:
        dumpcheck.marker(raw, RID, 10)
    assert want in str(e.value)


def test_a_true_marker_passes() -> None:
    assert dumpcheck.marker(marker_bytes(), RID, 10)["pieces"] == [[0, 4], [4, 10]]
    assert dumpcheck.marker(marker_bytes(), RID, 10)["start"] == 0  # a marker of an older plugin: from 0
    shared = dumpcheck.marker(marker_bytes(start=4, pieces=[[4, 6], [6, 10]]), RID, 10)
    assert (shared["start"], shared["pieces"]) == (4, [[4, 6], [6, 10]])


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


# --- through collect: what the client sees --------------------------------------------------------------

N, W = 6, 8  # tokens, columns (2 tensors of 4)
IDS = list(range(100, 100 + N))


def states() -> torch.Tensor:
    return torch.arange(N * W, dtype=torch.float32).reshape(N, W).to(torch.bfloat16)


def good_dump(d: Path, rid: str = RID, cuts: tuple[int, ...] = (0, 4, N)) -> None:
    s = states()
    for a, b in itertools.pairwise(cuts):
        dumpfiles.write_piece(d, rid, a, b, N, [s[a:b, :4], s[a:b, 4:]])
    dumpfiles.write_done(d, rid, {"n_tokens": N, "pieces": [[a, b] for a, b in itertools.pairwise(cuts)],
                                  "ids_sha256": dumpfiles.ids_digest(IDS), "dtype": "bfloat16", "width": W})


def collect(d: Path) -> list[torch.Tensor]:
    return dumpfiles.collect(d, RID, IDS, 2, timeout_s=30.0).hidden_states


def plant_fifo_piece(d: Path) -> None:
    good_dump(d)
    p = d / dumpfiles.piece_name(RID, 4, N)
    p.unlink()
    os.mkfifo(p)


def plant_symlink_done(d: Path) -> None:
    good_dump(d)
    real = d.parent / "elsewhere.json"
    (d / dumpfiles.done_name(RID)).rename(real)
    (d / dumpfiles.done_name(RID)).symlink_to(real)


def rows_shifted(d: Path) -> None:
    """Two pieces whose rows add up to the prompt but disagree with their ranges ([0,4) holds 3 rows)."""
    s = states()
    good_dump(d)
    for a, b, rows in ((0, 4, s[0:3]), (4, N, s[3:N])):
        p = d / dumpfiles.piece_name(RID, a, b)
        p.unlink()
        header = {"format": 1, "rid": RID, "start": a, "end": b, "n_tokens": N, "blocks": [], "payload_xxh3": 0}
        payload = rows.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        header["blocks"] = [{"dtype": "bfloat16", "shape": [rows.shape[0], W], "offset": 0, "nbytes": len(payload)}]
        header["payload_xxh3"] = xxhash.xxh3_64_intdigest(payload)
        raw = json.dumps(header).encode()
        p.write_bytes(dumpcheck.MAGIC + struct.pack("<I", len(raw)) + raw + payload)


def flip_payload_byte(d: Path) -> None:
    good_dump(d)
    p = d / dumpfiles.piece_name(RID, 0, 4)
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))


def marker_not_json(d: Path) -> None:
    good_dump(d)
    (d / dumpfiles.done_name(RID)).write_bytes(b"\x00not json")


def marker_lists_missing_piece(d: Path) -> None:
    good_dump(d)
    (d / dumpfiles.piece_name(RID, 4, N)).unlink()


def piece_dtype_unknown(d: Path) -> None:
    good_dump(d)
    p = d / dumpfiles.piece_name(RID, 0, 4)
    data = p.read_bytes()
    p.write_bytes(data.replace(b'"bfloat16"', b'"bfloat17"', 1))


def piece_bigger_than_its_range(d: Path) -> None:
    good_dump(d)
    p = d / dumpfiles.piece_name(RID, 0, 4)
    p.write_bytes(p.read_bytes() + bytes(dumpcheck.MAX_HEADER_BYTES + 4 * W * 2))


def pieces_mixed_layout(d: Path) -> None:
    """Piece 2 holds one [rows, 8] block where piece 1 holds two [rows, 4] blocks: refused, not guessed."""
    s = states()
    good_dump(d)
    (d / dumpfiles.piece_name(RID, 4, N)).unlink()
    dumpfiles.write_piece(d, RID, 4, N, N, [s[4:N]])


COLLECT_CASES = {
    "fifo_piece": (plant_fifo_piece, "piece hsx-0-7.0000000004-0000000006.piece: "),  # + "not a regular file"
    "symlink_done": (plant_symlink_done, "cannot be opened (Too many levels of symbolic links)"),
    "rows_shifted": (rows_shifted, "block 0 has 3 rows, its range [0,4) has 4"),
    "payload_flipped": (flip_payload_byte, "payload checksum mismatch (xxh3)"),
    "marker_not_json": (marker_not_json, "the .done marker is not JSON"),
    "missing_piece": (marker_lists_missing_piece, "cannot be opened (No such file or directory)"),
    "dtype_unknown": (piece_dtype_unknown, "dtype 'bfloat17' is not one of"),
    "piece_oversize": (piece_bigger_than_its_range, "more than the"),
    "mixed_layout": (pieces_mixed_layout, "pieces disagree on their blocks' dtypes and widths"),
}


@pytest.mark.parametrize("name", sorted(COLLECT_CASES))
def test_collect_refuses_hostile_dumps_with_a_dump_error_naming_the_request(tmp_path: Path, name: str) -> None:
    d = private(tmp_path)
    build, want = COLLECT_CASES[name]
    build(d)
    with pytest.raises(DumpError) as e:
        collect(d)
    assert type(e.value) is DumpError and str(e.value).startswith(f"request {RID}: ") and want in str(e.value)
    if name == "fifo_piece":
        assert str(e.value).endswith("not a regular file")


def test_collect_assembles_a_true_dump(tmp_path: Path) -> None:
    d = private(tmp_path)
    good_dump(d)
    got = collect(d)
    assert [torch.equal(g, r) for g, r in zip(got, (states()[:, :4], states()[:, 4:]), strict=True)] == [True, True]
    assert sorted(p.name for p in d.iterdir()) == []


def test_a_planted_symlink_at_a_piece_name_is_replaced_not_written_through(tmp_path: Path) -> None:
    d = private(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (d / dumpfiles.piece_name(RID, 0, 4)).symlink_to(victim)
    good_dump(d)
    assert victim.read_text() == "precious" and not (d / dumpfiles.piece_name(RID, 0, 4)).is_symlink()
    assert stat.S_IMODE((d / dumpfiles.piece_name(RID, 0, 4)).stat().st_mode) == 0o600


# --- launcher and client ---------------------------------------------------------------------------------
def test_stop_removes_only_the_directory_it_created(tmp_path: Path) -> None:
    from hsextract.sglang import server as hsrv

    made = hsrv.make_dump_dir("hostile")
    st = os.lstat(made)
    try:
        assert stat.S_IMODE(st.st_mode) == 0o700
        # a handle file naming another hsx-* directory (same name, other inode), an old handle without the
        # inode, and a symlink in its place: none removes anything
        other = tmp_path / made.name
        other.mkdir(mode=0o700)
        for h in (hsrv.ServerHandle(url="http://x:1", dump_dir=other, dump_dir_dev=st.st_dev, dump_dir_ino=st.st_ino),
                  hsrv.ServerHandle(url="http://x:1", dump_dir=made)):
            hsrv._remove_dump_dir(h)
        assert other.is_dir() and made.is_dir()
        link = tmp_path / "hsx-link"
        link.symlink_to(made)
        hsrv._remove_dump_dir(hsrv.ServerHandle(url="http://x:1", dump_dir=link, dump_dir_dev=st.st_dev,
                                                dump_dir_ino=st.st_ino))
        assert made.is_dir() and link.is_symlink()
        hsrv._remove_dump_dir(hsrv.ServerHandle(url="http://x:1", dump_dir=made, dump_dir_dev=st.st_dev,
                                                dump_dir_ino=st.st_ino))
        assert not made.exists()
    finally:
        shutil.rmtree(made, ignore_errors=True)


def test_the_client_refuses_an_unsafe_dump_directory(tmp_path: Path) -> None:
    from hsextract.engines.base import CaptureSpec
    from hsextract.sglang.client import SGLangEngine

    d = private(tmp_path)
    d.chmod(0o777)
    with pytest.raises(DumpDirError, match=rf"^dump directory {d} has mode 0777; it must be 0700"):
        SGLangEngine("http://127.0.0.1:1", CaptureSpec((1,), "post_norm"), d)


def test_api_key_reaches_the_server_in_a_file_and_the_requests_but_no_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import http.client

    from hsextract.engines.base import CaptureSpec
    from hsextract.errors import ConfigError
    from hsextract.sglang import server as hsrv
    from hsextract.sglang.api import TransientError
    from hsextract.sglang.client import SGLangEngine

    cfg = hsrv.ServerConfig(model="m", aux_layers=(1,), api_key="s3cret", final_state="post_norm")
    with pytest.raises(ConfigError, match="reaches the server in a key file"):
        hsrv.build_command(cfg)  # never on the command line (issue 36: ps shows it to every local user)
    cmd = hsrv.build_command(cfg, key_file=tmp_path / "k.yaml")
    assert "s3cret" not in " ".join(cmd) and cmd[cmd.index("--config") + 1] == str(tmp_path / "k.yaml")
    assert hsrv.redact(["x", "--api-key", "s3cret", "--admin-api-key=s3cret"]) == [
        "x", "--api-key", "<redacted>", "--admin-api-key=<redacted>"]
    sent: list[dict] = []

    def request(self, method, url, body=None, headers=None):
        sent.append(dict(headers or {}))
        raise OSError("no server here")

    monkeypatch.setattr(http.client.HTTPConnection, "request", request)
    eng = SGLangEngine("http://127.0.0.1:1", CaptureSpec((1,), "post_norm"), private(tmp_path), api_key="s3cret")
    with pytest.raises(TransientError, match="POST /generate failed: OSError: no server here"):
        eng._generate("hsx-a", [1, 2])
    assert eng.health() == "OSError: no server here"
    # generate carries the key; /health never does (SGLang does not check it there, and a port taken while a
    # server loads would read it)
    assert len(sent) == 2 and sent[0]["Authorization"] == "Bearer s3cret" and "Authorization" not in sent[1]


def test_corrupted_dumps_are_retried_and_every_sample_is_its_own(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the fake server and the real client: the first two pieces written get one payload byte
    flipped (as a planted or damaged file would): their requests fail with a DumpError, are asked again, and
    the shard holds every sample's own states."""
    from conftest import shard_metadata
    from fake_sglang import HIDDEN, FakeServer, expected_states

    from hsextract.engines.base import CaptureSpec, Prompt
    from hsextract.extract.run import ChunkPrompts, extract_chunk
    from hsextract.sglang.client import SGLangEngine
    from hsextract.shard import ShardReader

    aux = (1, 3, 5)
    real = dumpfiles.write_piece
    flipped: list[str] = []
    lock = threading.Lock()  # the server writes pieces on several threads: exactly the first two are damaged

    def write_and_damage(*a, **kw):
        path = real(*a, **kw)
        with lock:
            if len(flipped) >= 2:
                return path
            flipped.append(path.name)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))
        return path

    monkeypatch.setattr(dumpfiles, "write_piece", write_and_damage)
    srv = FakeServer(private(tmp_path), aux).start()
    try:
        g = torch.Generator().manual_seed(5)
        ps = [Prompt(i, f"s{i:03d}", torch.randint(0, 5000, (int(n),), generator=g).tolist())
              for i, n in enumerate(torch.randint(4, 40, (6,), generator=g))]
        cp = ChunkPrompts([p.sample_id for p in ps], [p.input_ids for p in ps], [[1] * len(p.input_ids) for p in ps])
        eng = SGLangEngine(srv.url, CaptureSpec(aux_layers=aux, final_state="post_norm"), srv.dumper.cfg.dump_dir,
                           timeout_s=10.0, backoff_s=0.01, retries=3, concurrency=2)
        extract_chunk(cp, tmp_path / "c.hss", eng,
                      shard_metadata(aux_layers=list(aux), hidden_size=HIDDEN, engine="sglang"), progress=False)
        assert len(flipped) == 2 and srv.n_requests >= len(ps) + 2
        r = ShardReader(tmp_path / "c.hss")
        for k, p in enumerate(ps):
            assert all(torch.equal(a, b) for a, b in zip(r[k]["hidden_states"], expected_states(p.input_ids, 4),
                                                         strict=True))
    finally:
        srv.stop()
