"""Parallel dump writers: out-of-order staging frees, per-rid thread affinity and ordering, stats sums,
and the writer-thread setting from the environment / server config."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from hsextract.errors import ConfigError, EngineError
from hsextract.sglang import server
from hsextract.sglang_plugin import dumpfiles
from hsextract.sglang_plugin import plugin as plg
from hsextract.sglang_plugin import writer as wmod
from hsextract.sglang_plugin.slicing import PieceSlice
from hsextract.sglang_plugin.staging import StagingRing
from hsextract.sglang_plugin.writer import DumpWriter

NT, H = 4, 8  # tensors per row (aux + final), hidden size
W = NT * H


def states(rid_seed: int, n: int) -> torch.Tensor:
    """[n, W] bf16 rows, exact small integers, distinct per rid and row."""
    t = torch.arange(n)[:, None]
    c = torch.arange(W)[None, :]
    return (((t * 3 + c * 5 + rid_seed * 11) % 97) - 48).to(torch.bfloat16)


def token_ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def submit_piece(w: DumpWriter, rid: str, ids: list[int], ref: torch.Tensor, start: int, end: int) -> None:
    """One piece in a batch of its own, with 2 padding rows in front (the piece is not at row 0)."""
    rows = torch.cat([torch.full((2, W), -99.0, dtype=torch.bfloat16), ref[start:end]])
    w.submit([PieceSlice(rid, len(ids), start, end, 2, ids)], [rows])


def request_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if not p.name.startswith(("stats-", "plugin-")))


# ---- staging ring -----------------------------------------------------------------------------------
def test_out_of_order_frees_reclaim_the_freed_prefix_only() -> None:
    ring = StagingRing(4096, pin=False)
    a, b, c = ring.alloc(1024), ring.alloc(1024), ring.alloc(1024)
    assert (a.start, b.start, c.start) == (0, 1024, 2048)
    ring.free(c)
    ring.free(b)  # b, c done before a: nothing reclaimed yet, a holds the tail
    assert ring.used == 3072
    d = ring.alloc(1024)
    assert d.start == 3072 and ring.used == 4096
    with pytest.raises(TimeoutError):
        ring.alloc(256, timeout_s=0.05)
    ring.free(a)  # the tail advances over a, b and c up to d
    assert ring.used == 1024
    e = ring.alloc(3072)  # the whole front is reusable again (wrap-around)
    assert e.start == 0 and ring.used == 4096
    ring.buf[e.start : e.end].fill_(7)  # memory b and c lived in, written over
    assert int(ring.buf[1024:3072].sum()) == 7 * 2048
    ring.free(d)  # tail moves to e; head stays at e.end
    f = ring.alloc(1024)
    assert f.start == 3072
    for r in (f, e):
        ring.free(r)
    assert ring.used == 0 and ring.peak == 4096 and ring.allocs == 6
    with pytest.raises(RuntimeError, match="is not allocated"):
        ring.free(a)


def test_blocked_alloc_waits_for_the_oldest_region_not_any_region() -> None:
    ring = StagingRing(2048, pin=False)
    a, b = ring.alloc(1024), ring.alloc(1024)
    got: list = []
    t = threading.Thread(target=lambda: got.append(ring.alloc(1024, timeout_s=5)))
    t.start()
    ring.free(b)  # a newer region: does not make room at the head
    time.sleep(0.2)
    assert got == [] and t.is_alive()
    ring.free(a)
    t.join(5)
    assert [r.start for r in got] == [0] and ring.waits == 1 and ring.used == 1024


# ---- parallel writer --------------------------------------------------------------------------------
def test_interleaved_rids_on_four_threads_keep_order_bytes_and_markers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: dict[str, list[tuple[str, int, int]]] = {}  # rid -> (thread, start, end) in write order
    marker_seen_missing: list[str] = []
    real_piece, real_done = dumpfiles.write_piece, dumpfiles.write_done

    def rec_piece(d, rid, start, end, n, blocks):
        time.sleep(0.001)  # a slow disk: queues build up, threads overlap
        written.setdefault(rid, []).append((threading.current_thread().name, start, end))
        return real_piece(d, rid, start, end, n, blocks)

    def rec_done(d, rid, info):  # every listed piece must be on disk before the marker is written
        missing = [pc for pc in info["pieces"] if not (d / dumpfiles.piece_name(rid, *pc)).exists()]
        if missing:
            marker_seen_missing.append(f"{rid} {missing}")
        return real_done(d, rid, info)

    monkeypatch.setattr(wmod.dumpfiles, "write_piece", rec_piece)
    monkeypatch.setattr(wmod.dumpfiles, "write_done", rec_done)
    # rows of 64 bytes; (1280 - 256 alignment slack) // 64 = 16 rows per staged block, so longer pieces
    # split into several jobs; 16 KiB of staging makes submit wait for the writers (backpressure)
    w = DumpWriter(tmp_path, StagingRing(16 << 10, pin=False), threads=4, max_piece_bytes=1280)
    g = torch.Generator().manual_seed(0)
    reqs = {}
    for i in range(40):
        n = int(torch.randint(20, 90, (1,), generator=g))
        cuts = sorted(set(torch.randint(1, n, (3,), generator=g).tolist()))
        bounds = [0, *cuts, n]
        reqs[f"hsx-r{i}"] = (token_ids(i, n), states(i, n), list(itertools.pairwise(bounds)))
    assert len({w._lane(rid).index for rid in reqs}) == 4  # every thread gets rids
    for k in range(max(len(r[2]) for r in reqs.values())):  # piece k of every rid, then piece k+1 ...
        for rid, (ids, ref, pieces) in reqs.items():
            if k < len(pieces):
                submit_piece(w, rid, ids, ref, *pieces[k])
    w.flush()
    assert marker_seen_missing == []
    total_rows_blocks = 0
    for rid, (ids, ref, _pieces) in reqs.items():
        jobs = written[rid]
        assert len({t for t, _, _ in jobs}) == 1, f"{rid} written by several threads"
        assert jobs[0][0] == f"hsextract-dump-writer-{w._lane(rid).index}"
        # written in submission order: contiguous row blocks of at most 16 rows, covering [0, n)
        spans = [(s, e) for _, s, e in jobs]
        assert spans[0][0] == 0 and spans[-1][1] == len(ids)
        assert all(e == s2 for (_, e), (s2, _) in itertools.pairwise(spans)) and all(e - s <= 16 for s, e in spans)
        done = json.loads((tmp_path / dumpfiles.done_name(rid)).read_text())
        assert done["pieces"] == [list(s) for s in spans] and done["n_tokens"] == len(ids)
        assert done["width"] == W and done["dtype"] == "bfloat16"
        total_rows_blocks += len(spans)
        got = dumpfiles.collect(tmp_path, rid, ids, NT, 1.0)
        for j, t in enumerate(got.hidden_states):
            assert torch.equal(t, ref[:, j * H : (j + 1) * H]), f"tensor {j} of {rid}"
    assert len({t for jobs in written.values() for t, _, _ in jobs}) == 4
    assert request_files(tmp_path) == []
    stats = json.loads(next(tmp_path.glob("stats-*.json")).read_text())
    n_rows = sum(len(r[0]) for r in reqs.values())
    assert stats["writer_threads"] == 4
    assert stats["pieces"] == total_rows_blocks == stats["staging_allocs"] == w.stats.pieces
    assert stats["requests_done"] == 40 and stats["requests_failed"] == 0 and stats["write_errors"] == 0
    assert stats["bytes_written"] == n_rows * W * 2 and stats["queued"] == 0
    assert w.ring.used == 0 and 0 < stats["staging_peak"] <= 16 << 10 and stats["staging_waits"] > 0
    assert any(e - s == 16 for jobs in written.values() for _, s, e in jobs)  # pieces were split
    w.close()


def test_retractions_of_many_rids_in_parallel_supersede_as_before(tmp_path: Path) -> None:
    w = DumpWriter(tmp_path, StagingRing(1 << 20, pin=False), threads=4)
    reqs = {f"hsx-t{i}": (token_ids(100 + i, 50), states(100 + i, 50)) for i in range(12)}
    for start, end in [(0, 20), (20, 40), (0, 30), (30, 50)]:  # partial, retracted, re-run with other cuts
        for rid, (ids, ref) in reqs.items():
            submit_piece(w, rid, ids, ref, start, end)
    w.flush()
    expected = sorted(
        n for rid in reqs
        for n in (dumpfiles.done_name(rid), dumpfiles.piece_name(rid, 0, 30), dumpfiles.piece_name(rid, 30, 50))
    )
    assert [p.name for p in request_files(tmp_path)] == expected
    for rid, (ids, ref) in reqs.items():
        got = dumpfiles.collect(tmp_path, rid, ids, NT, 1.0)
        assert got.pieces == 2 and torch.equal(torch.cat(got.hidden_states, dim=1), ref)
    # the same rids as new requests: dumped again, counted over all threads
    for rid, (ids, ref) in reqs.items():
        submit_piece(w, rid, ids, ref, 0, 50)
    w.flush()
    assert w.stats.rids_reused == 12 and w.stats.requests_done == 24 and w.stats.pieces == 12 * 5
    w.close()


def test_fail_marker_goes_after_the_rids_queued_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[str, str, str]] = []  # (thread, rid, what)
    real_piece, real_err = dumpfiles.write_piece, dumpfiles.write_err

    def rec_piece(d, rid, start, end, n, blocks):
        time.sleep(0.05)  # the piece is still being written when fail() is called
        order.append((threading.current_thread().name, rid, f"piece {start}-{end}"))
        return real_piece(d, rid, start, end, n, blocks)

    def rec_err(d, rid, msg):
        order.append((threading.current_thread().name, rid, "err"))
        return real_err(d, rid, msg)

    monkeypatch.setattr(wmod.dumpfiles, "write_piece", rec_piece)
    monkeypatch.setattr(wmod.dumpfiles, "write_err", rec_err)
    w = DumpWriter(tmp_path, StagingRing(1 << 20, pin=False), threads=4)
    ids, ref = token_ids(7, 30), states(7, 30)
    submit_piece(w, "hsx-f", ids, ref, 0, 10)
    w.fail([("hsx-f", 30)], "RuntimeError: staging failed")
    w.flush()
    lane = f"hsextract-dump-writer-{w._lane('hsx-f').index}"
    assert order == [(lane, "hsx-f", "piece 0-10"), (lane, "hsx-f", "err")]
    with pytest.raises(EngineError, match="the server-side dumper reported: RuntimeError: staging failed"):
        dumpfiles.collect(tmp_path, "hsx-f", ids, NT, 1.0)
    assert w.stats.requests_failed == 1
    w.close()


def test_flush_drains_every_thread_and_close_joins_them(tmp_path: Path) -> None:
    w = DumpWriter(tmp_path, StagingRing(1 << 20, pin=False), threads=3, write_delay_s=0.01)
    reqs = {f"hsx-d{i}": (token_ids(i, 16), states(i, 16)) for i in range(18)}
    for rid, (ids, ref) in reqs.items():
        submit_piece(w, rid, ids, ref, 0, 16)
    w.flush()  # no waiting after this: every marker is there
    assert all((tmp_path / dumpfiles.done_name(rid)).exists() for rid in reqs)
    assert json.loads(next(tmp_path.glob("stats-*.json")).read_text())["requests_done"] == 18
    threads = [lane.thread for lane in w._lanes]
    w.close()
    assert len(threads) == 3 and not any(t.is_alive() for t in threads)
    with pytest.raises(ValueError, match="writer threads must be >= 1, got 0"):
        DumpWriter(tmp_path, StagingRing(4096, pin=False), threads=0)


# ---- configuration ------------------------------------------------------------------------------------
def test_writer_threads_from_env(tmp_path: Path) -> None:
    base = {"HSEXTRACT_DUMP_DIR": str(tmp_path), "HSEXTRACT_AUX_HIDDEN_STATES": "1,3,5"}
    assert plg.PluginConfig.from_env(base).writer_threads == 4
    cfg = plg.PluginConfig.from_env(base | {"HSEXTRACT_WRITER_THREADS": "2"})
    assert cfg.writer_threads == 2
    d = plg.Dumper(cfg, pin=False)
    assert d.start().threads == 2 and len(d.writer._lanes) == 2
    d.writer.close()
    for bad in ("0", "-1", "four", ""):
        with pytest.raises(plg.PluginConfigError) as e:
            plg.PluginConfig.from_env(base | {"HSEXTRACT_WRITER_THREADS": bad})
        assert str(e.value) == (
            f"HSEXTRACT_WRITER_THREADS={bad!r}: expected an integer >= 1 (config key writer_threads)"
        )


def test_copy_stream_from_env(tmp_path: Path) -> None:
    base = {"HSEXTRACT_DUMP_DIR": str(tmp_path), "HSEXTRACT_AUX_HIDDEN_STATES": "1,3,5"}
    assert plg.PluginConfig.from_env(base).copy_stream is True
    off = plg.PluginConfig.from_env(base | {"HSEXTRACT_COPY_STREAM": "0"})
    assert off.copy_stream is False
    d = plg.Dumper(off, pin=False)
    assert d.start()._use_copy_stream is False
    d.writer.close()
    with pytest.raises(plg.PluginConfigError) as e:
        plg.PluginConfig.from_env(base | {"HSEXTRACT_COPY_STREAM": "yes"})
    assert str(e.value) == "HSEXTRACT_COPY_STREAM='yes': expected 1 (side stream) or 0"


def test_server_config_passes_writer_threads(tmp_path: Path) -> None:
    cfg = server.ServerConfig(model="m", aux_layers=(1, 2), final_state="pre_norm")
    assert server.build_env(cfg, tmp_path, base={})["HSEXTRACT_WRITER_THREADS"] == "4"
    cfg8 = server.ServerConfig(model="m", aux_layers=(1, 2), writer_threads=8, final_state="pre_norm")
    assert server.build_env(cfg8, tmp_path, base={})["HSEXTRACT_WRITER_THREADS"] == "8"
    assert server.config_hash(cfg, 0) != server.config_hash(cfg8, 0)
    with pytest.raises(ConfigError, match=r"sglang.writer_threads: 0; must be >= 1"):
        server.ServerConfig(model="m", aux_layers=(1, 2), writer_threads=0, final_state="pre_norm")


def test_the_passes_after_a_failed_one_are_dropped_not_dumped_again(tmp_path: Path) -> None:
    """A request over three chunked-prefill passes whose first could not be staged (fail()): its `.err` is the
    answer; the later passes write nothing, count no rid come again and leave no second marker. A new request
    under that rid later (a pass from 0) is dumped."""
    w = DumpWriter(tmp_path, StagingRing(1 << 20, pin=False), threads=2)
    ids, ref = token_ids(9, 30), states(9, 30)
    w.fail([("hsx-m", 30)], "RuntimeError: staging failed")
    submit_piece(w, "hsx-m", ids, ref, 10, 20)
    submit_piece(w, "hsx-m", ids, ref, 20, 30)
    w.flush()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("stats-")) == [
        dumpfiles.err_name("hsx-m")]
    assert (w.stats.requests_failed, w.stats.rids_reused, w.stats.pieces) == (1, 0, 0)
    with pytest.raises(EngineError, match="the server-side dumper reported: RuntimeError: staging failed"):
        dumpfiles.collect(tmp_path, "hsx-m", ids, NT, 1.0)
    for start, end in ((0, 15), (15, 30)):
        submit_piece(w, "hsx-m", ids, ref, start, end)
    w.flush()
    got = dumpfiles.collect(tmp_path, "hsx-m", ids, NT, 5.0)
    assert got.pieces == 2 and torch.equal(torch.cat(got.hidden_states, dim=1), ref)
    assert (w.stats.requests_failed, w.stats.requests_done, w.stats.pieces) == (1, 1, 2)
    w.close()


def test_a_failed_write_drops_the_requests_later_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first pass's piece cannot be written (a full disk, say): its `.err` answers the request, the two passes
    after it are dropped, not written as pieces of a request that can no longer complete."""
    real = dumpfiles.write_piece
    calls = []

    def failing(d, rid, start, end, n, blocks):
        calls.append((start, end))
        if start == 0:
            raise OSError(28, "No space left on device")
        return real(d, rid, start, end, n, blocks)

    monkeypatch.setattr(wmod.dumpfiles, "write_piece", failing)
    w = DumpWriter(tmp_path, StagingRing(1 << 20, pin=False), threads=2)
    ids, ref = token_ids(5, 30), states(5, 30)
    for start, end in ((0, 10), (10, 20), (20, 30)):
        submit_piece(w, "hsx-w", ids, ref, start, end)
    w.flush()
    assert calls == [(0, 10)] and [p.name for p in request_files(tmp_path)] == [dumpfiles.err_name("hsx-w")]
    assert (w.stats.write_errors, w.stats.rids_reused, w.stats.pieces) == (1, 0, 0)
    with pytest.raises(EngineError, match=r"writing piece \[0,10\) failed: \[Errno 28\] No space left on device"):
        dumpfiles.collect(tmp_path, "hsx-w", ids, NT, 1.0)
    w.close()
