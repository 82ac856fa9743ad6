"""The plugin's slicing, staging, writing and collecting, on CPU with synthetic SGLang-shaped batches."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from hsextract.errors import EngineError
from hsextract.sglang_plugin import dumpfiles
from hsextract.sglang_plugin import plugin as plg
from hsextract.sglang_plugin.slicing import slice_extend_batch
from hsextract.sglang_plugin.staging import StagingRing

K, H = 3, 8  # aux layers, hidden size
AUX = (1, 3, 5)


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]


@dataclass
class Mode:
    extend: bool = True

    def is_extend(self) -> bool:
        return self.extend


@dataclass
class Batch:
    reqs: list
    prefix_lens: list
    extend_lens: list
    forward_mode: Mode = field(default_factory=Mode)


@dataclass
class LogitsOut:
    hidden_states: torch.Tensor | None
    last_hidden_states: torch.Tensor | None = None


def full_states(ids: list[int], width: int = (K + 1) * H) -> torch.Tensor:
    """What the model would produce for this prompt: [n, (K+1)*H], exact small integers in bf16."""
    n = len(ids)
    x = torch.tensor(ids)[:, None]
    t = torch.arange(n)[:, None]
    c = torch.arange(width)[None, :]
    return (((x * 7 + t * 3 + c * 5) % 97) - 48).to(torch.bfloat16)


def run_pass(dumper: plg.Dumper, parts: list, pad: int = 0, builtin: bool = False) -> None:
    """One EXTEND pass. parts: (req, prefix_len, extend_len); rows past the prompt are decode rows."""
    rows = []
    for req, pre, ext in parts:
        ref = full_states(req.origin_input_ids)
        got = ref[pre : pre + ext]
        if got.shape[0] < ext:  # decode rows: garbage that must not be dumped
            got = torch.cat([got, torch.full((ext - got.shape[0], ref.shape[1]), 99.0, dtype=torch.bfloat16)])
        rows.append(got)
    rows.append(torch.full((pad, (K + 1) * H), -99.0, dtype=torch.bfloat16))
    hs = torch.cat(rows)
    batch = Batch([p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts])
    lo = LogitsOut(hs[:, : K * H].contiguous(), hs[:, K * H :].contiguous()) if builtin else LogitsOut(hs)
    dumper.on_extend(batch, lo)


def make_dumper(tmp_path: Path, staging_bytes: int = 1 << 20, delay: float = 0.0,
                shared_prefix: bool = False) -> plg.Dumper:
    cfg = plg.PluginConfig(dump_dir=tmp_path, aux_layers=AUX, staging_bytes=staging_bytes,
                           shared_prefix=shared_prefix)
    d = plg.Dumper(cfg, pin=False, write_delay_s=delay)
    d._is_writer_rank = True
    return d


def collect(tmp_path: Path, req: Req, timeout: float = 5.0) -> list[torch.Tensor]:
    return dumpfiles.collect(tmp_path, req.rid, req.origin_input_ids, K + 1, timeout).hidden_states


def assert_matches(got: list[torch.Tensor], req: Req) -> None:
    ref = full_states(req.origin_input_ids)
    assert len(got) == K + 1
    for i, t in enumerate(got):
        assert t.dtype == torch.bfloat16 and t.shape == (len(req.origin_input_ids), H)
        assert torch.equal(t, ref[:, i * H : (i + 1) * H]), f"tensor {i} of {req.rid}"


def dump_files(d: Path) -> list[Path]:
    """Request files only (not the plugin's stats-/plugin- files)."""
    return sorted(p for p in d.iterdir() if not p.name.startswith(("stats-", "plugin-")))


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


# ---- slicing --------------------------------------------------------------------------------------
def test_slicing_offsets_skips_decode_rows_and_padding() -> None:
    a, b, c = Req("hsx-a", ids(10, 1)), Req("hsx-b", ids(5, 2)), Req("hsx-c", ids(4, 3))
    # b is a prefix-cache/chunk continuation at 3; c is a decode row (prefix = its prompt length)
    pieces = slice_extend_batch([a, b, c], [0, 3, 4], [10, 2, 1], num_rows=20)
    assert [(p.rid, p.start, p.end, p.row, p.n_tokens) for p in pieces] == [
        ("hsx-a", 0, 10, 0, 10),
        ("hsx-b", 3, 5, 10, 5),
    ]
    with pytest.raises(ValueError, match="extend lens sum to 13 rows but the captured tensor has 12"):
        slice_extend_batch([a, b, c], [0, 3, 4], [10, 2, 1], num_rows=12)


def test_slicing_clips_rows_past_the_prompt_and_filters_rids() -> None:
    a = Req("hsx-a", ids(6, 1))
    warm = Req("0123456789abcdef0123456789abcdef", ids(3, 2))
    health = Req("HEALTH_CHECK_abc", [5])
    pieces = slice_extend_batch(
        [warm, a, health], [0, 4, 0], [3, 4, 1], 8, accept=lambda r: r.startswith("hsx-")
    )
    assert [(p.rid, p.start, p.end, p.row) for p in pieces] == [("hsx-a", 4, 6, 3)]


# ---- end to end through the writer ----------------------------------------------------------------
@pytest.mark.parametrize("builtin", [False, True])
def test_several_requests_in_one_batch_with_padding(tmp_path: Path, builtin: bool) -> None:
    d = make_dumper(tmp_path)
    reqs = [Req(f"hsx-r{i}", ids(n, i)) for i, n in enumerate([7, 1, 13, 4])]
    run_pass(d, [(r, 0, len(r.origin_input_ids)) for r in reqs], pad=5, builtin=builtin)
    d.writer.flush()
    for r in reqs:
        assert_matches(collect(tmp_path, r), r)
    assert dump_files(tmp_path) == []  # collect deleted everything


def test_one_request_over_three_chunked_passes_mixed_with_others(tmp_path: Path) -> None:
    d = make_dumper(tmp_path)
    long = Req("hsx-long", ids(300, 9))
    short1, short2 = Req("hsx-s1", ids(20, 10)), Req("hsx-s2", ids(30, 11))
    decode = Req("hsx-dec", ids(5, 12))
    run_pass(d, [(short1, 0, 20), (long, 0, 108)])
    d.writer.flush()
    assert not (tmp_path / dumpfiles.done_name("hsx-long")).exists()
    run_pass(d, [(long, 108, 128), (decode, 5, 1)], pad=3)  # MIXED: a decode row appended
    run_pass(d, [(long, 236, 64), (short2, 0, 30)])
    d.writer.flush()
    got = dumpfiles.collect(tmp_path, long.rid, long.origin_input_ids, K + 1, 5.0)
    assert got.pieces == 3
    assert_matches(got.hidden_states, long)
    assert_matches(collect(tmp_path, short1), short1)
    assert_matches(collect(tmp_path, short2), short2)
    assert not list(tmp_path.glob("hsx-dec*"))


def test_retracted_request_rerun_is_idempotent(tmp_path: Path) -> None:
    d = make_dumper(tmp_path)
    r = Req("hsx-retr", ids(50, 5))
    # partially prefilled in two chunks, retracted, re-run from 0 with other chunk boundaries
    run_pass(d, [(r, 0, 20)])
    run_pass(d, [(r, 20, 20)])
    run_pass(d, [(r, 0, 30)])
    run_pass(d, [(r, 30, 20)])
    d.writer.flush()
    names = [p.name for p in dump_files(tmp_path)]
    assert names == sorted(
        [dumpfiles.done_name(r.rid), dumpfiles.piece_name(r.rid, 0, 30), dumpfiles.piece_name(r.rid, 30, 50)]
    )
    before = {p.name: p.read_bytes() for p in dump_files(tmp_path)}
    # the same request object run again after its prompt was dumped (retraction after prefill): skipped
    run_pass(d, [(r, 0, 50)])
    d.writer.flush()
    assert {p.name: p.read_bytes() for p in dump_files(tmp_path)} == before
    assert d.duplicates_skipped == 1 and d.writer.stats.rids_reused == 0
    assert json.loads(next(tmp_path.glob("stats-*.json")).read_text())["duplicates_skipped"] == 1
    assert_matches(collect(tmp_path, r), r)


def test_a_rid_sent_again_as_a_new_request_is_dumped_again(tmp_path: Path) -> None:
    """A client that reuses the rids of completed requests (a warm-up, then a run on one engine): dropping
    them as duplicates would leave it waiting for `.done` markers that never come; they are dumped again."""
    d = make_dumper(tmp_path)
    first = [Req(f"hsx-w-i{i}-a0", ids(40, i)) for i in range(4)]
    run_pass(d, [(r, 0, 40) for r in first])
    d.writer.flush()
    for r in first:
        assert_matches(collect(tmp_path, r), r)
    again = [Req(r.rid, ids(40, 100 + i)) for i, r in enumerate(first)]  # new request objects, same rids
    run_pass(d, [(r, 0, 40) for r in again])
    d.writer.flush()
    for r in again:
        assert_matches(collect(tmp_path, r, timeout=2.0), r)
    assert d.writer.stats.rids_reused == 4 and d.duplicates_skipped == 0
    assert dump_files(tmp_path) == []


def test_timeout_message_carries_the_writer_stats(tmp_path: Path) -> None:
    d = make_dumper(tmp_path)
    r = Req("hsx-s", ids(10, 1))
    run_pass(d, [(r, 0, 4)])  # first piece only: the request never completes
    d.writer.flush()
    with pytest.raises(dumpfiles.DumpTimeout) as e:
        dumpfiles.collect(tmp_path, r.rid, r.origin_input_ids, K + 1, 0.05)
    msg = str(e.value)
    assert "(1 piece files of it are there)" in msg
    assert re.search(r"writer stats: stats-\d+\.json \(\d+ s old\): "
                     r"pieces=1, staging_peak=\d+, staging_capacity=1048576", msg), msg
    with pytest.raises(dumpfiles.DumpTimeout, match="the plugin's writer has written no stats file"):
        dumpfiles.collect(tmp_path / "x", "hsx-none", [1], K + 1, 0.01)


def test_staging_allocated_at_start_and_failure_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.005)  # CPython's default
    set_to: list[float] = []
    monkeypatch.setattr(sys, "setswitchinterval", set_to.append)
    d = make_dumper(tmp_path)
    w = d.start()
    assert d.start() is w and w.ring.buf.numel() == 1 << 20
    assert set_to == [0.0005]  # the writer threads get the GIL back from the spinning scheduler quickly
    huge = plg.Dumper(plg.PluginConfig(tmp_path, AUX, staging_bytes=1 << 50), pin=False)
    with pytest.raises(plg.PluginConfigError, match=r"cannot allocate 1073741824 MiB of staging memory .*"
                       r"lower HSEXTRACT_STAGING_MB \(config key staging_mb\)"):
        huge.start()


def test_prefix_cache_hit_gives_a_clear_error(tmp_path: Path) -> None:
    d = make_dumper(tmp_path)
    r = Req("hsx-cached", ids(40, 6))
    run_pass(d, [(r, 16, 24)])  # the first 16 rows came from the radix cache: never computed
    d.writer.flush()
    with pytest.raises(EngineError, match=r"tokens \[0,16\) were never computed .*--disable-radix-cache"):
        collect(tmp_path, r)
    assert dump_files(tmp_path) == []


def test_shared_prefix_mode_dumps_from_the_cache_hit_and_says_where(tmp_path: Path) -> None:
    """HSEXTRACT_SHARED_PREFIX=1 (radix cache on): a chain that starts at the cache hit m is complete, its marker
    records start m, and the client gets the rows [m, n) at their positions, chunked or not; the same chain in flat
    mode stays the error above, and a flat client refuses a marker with start > 0. A gap after the start is an
    error in both modes."""
    d = make_dumper(tmp_path, shared_prefix=True)
    one, two, gap = Req("hsx-hit1", ids(40, 6)), Req("hsx-hit2", ids(90, 7)), Req("hsx-gap", ids(60, 8))
    run_pass(d, [(one, 16, 24), (two, 30, 20)])
    run_pass(d, [(two, 50, 40), (gap, 10, 20)])
    run_pass(d, [(gap, 40, 20)])  # rows [30, 40) never computed
    d.writer.flush()
    assert json.loads((tmp_path / dumpfiles.done_name(two.rid)).read_text())["start"] == 30
    for r, m in ((one, 16), (two, 30)):
        got = dumpfiles.collect(tmp_path, r.rid, r.origin_input_ids, K + 1, 5.0, allow_start=True)
        ref = full_states(r.origin_input_ids)
        assert got.start == m and len(got.hidden_states) == K + 1
        for i, t in enumerate(got.hidden_states):
            assert torch.equal(t, ref[m:, i * H:(i + 1) * H]), f"tensor {i} of {r.rid}"
    with pytest.raises(EngineError, match=r"^request hsx-gap: the server-side dumper reported: rows for tokens "
                                          r"\[30,40\) were never computed; pieces \[\(10, 30\), \(40, 60\)\]$"):
        collect(tmp_path, gap)
    (tmp_path / "flat").mkdir()
    flat = make_dumper(tmp_path / "flat")
    r = Req("hsx-flat", ids(40, 9))
    run_pass(flat, [(r, 16, 24)])
    run_pass(d, [(Req("hsx-m", r.origin_input_ids), 16, 24)])
    flat.writer.flush()
    d.writer.flush()
    with pytest.raises(EngineError, match=r"tokens \[0,16\) were never computed .*--disable-radix-cache"):
        collect(tmp_path / "flat", r)
    with pytest.raises(dumpfiles.DumpError) as e:
        dumpfiles.collect(tmp_path, "hsx-m", r.origin_input_ids, K + 1, 5.0)
    assert str(e.value) == ("request hsx-m: the server computed tokens [16,40) only (a prefix-cache hit): a run "
                            "without share_prefixes needs a server with --disable-radix-cache")
    assert dump_files(tmp_path / "flat") == []


def test_missing_capture_becomes_err_marker_not_crash(tmp_path: Path) -> None:
    d = make_dumper(tmp_path)
    r = Req("hsx-nocap", ids(4, 7))
    d.on_extend(Batch([r], [0], [4]), LogitsOut(None))
    d.on_extend(Batch([Req("hsx-narrow", ids(4, 8))], [0], [4]), LogitsOut(torch.zeros(4, K * H + 1)))
    d.writer.flush()
    with pytest.raises(EngineError, match="carries no captured hidden states"):
        collect(tmp_path, r)
    with pytest.raises(EngineError, match=r"captured width 25 is not 3\+1 tensors"):
        dumpfiles.collect(tmp_path, "hsx-narrow", ids(4, 8), K + 1, 1.0)


def test_64k_prompt_streams_through_a_small_staging_cap(tmp_path: Path) -> None:
    cap = 256 << 10  # 256 KiB of staging for a 64k-token prompt of 4 MiB
    d = make_dumper(tmp_path, staging_bytes=cap, delay=0.0005)
    r = Req("hsx-64k", ids(65536, 3))
    assert 65536 * (K + 1) * H * 2 > 10 * cap
    run_pass(d, [(r, 0, 32768)])
    run_pass(d, [(r, 32768, 32768)])
    d.writer.flush()
    ring = d.writer.ring
    assert ring.capacity == cap and ring.buf.numel() == cap  # the only staging allocation
    assert 0 < ring.peak <= cap
    assert ring.waits > 0  # the hook was held back by the writer: backpressure
    stats = json.loads(next(tmp_path.glob("stats-*.json")).read_text())
    assert stats["staging_peak"] == ring.peak and stats["staging_waits"] == ring.waits
    assert stats["bytes_written"] == 65536 * (K + 1) * H * 2 and stats["requests_done"] == 1
    got = dumpfiles.collect(tmp_path, r.rid, r.origin_input_ids, K + 1, 5.0)
    assert got.pieces >= 16
    assert_matches(got.hidden_states, r)


def test_staging_ring_wraps_and_reclaims_behind_the_oldest_live_region() -> None:
    ring = StagingRing(4096, pin=False)
    a, b, c = ring.alloc(1500), ring.alloc(1500), ring.alloc(900)
    assert (a.start, b.start, c.start) == (0, 1536, 3072)
    ring.free(a)
    d = ring.alloc(1000)  # wraps to the freed front
    assert d.start == 0
    ring.free(c)  # out of order: marked, but b (older) still holds the tail
    assert ring.used == 1536 + 1024 + 1024
    with pytest.raises(TimeoutError):
        ring.alloc(1024, timeout_s=0.05)
    with pytest.raises(RuntimeError, match="is not allocated"):
        ring.free(c)
    for r in (b, d):
        ring.free(r)
    assert ring.used == 0 and ring.peak <= 4096


def _child_writer(dump_dir: str, seqs: list[list[int]]) -> None:
    d = make_dumper(Path(dump_dir))
    reqs = [Req(f"hsx-p{i}", s) for i, s in enumerate(seqs)]
    time.sleep(0.3)  # the parent is already waiting
    run_pass(d, [(r, 0, len(r.origin_input_ids)) for r in reqs])
    d.writer.flush()


def test_writer_and_collector_in_different_processes(tmp_path: Path) -> None:
    seqs = [ids(33, 1), ids(2, 2), ids(70, 3)]
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_child_writer, args=(str(tmp_path), seqs))
    p.start()
    try:
        for i, s in enumerate(seqs):
            assert_matches(collect(tmp_path, Req(f"hsx-p{i}", s), timeout=60), Req(f"hsx-p{i}", s))
    finally:
        p.join(60)
    assert p.exitcode == 0


def test_collector_timeout_message(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(dumpfiles.DumpTimeout) as e:
        dumpfiles.collect(tmp_path, "hsx-never", [1, 2, 3], K + 1, 0.2)
    assert time.monotonic() - t0 >= 0.2
    assert str(e.value) == (
        f"request hsx-never: no dump marker {tmp_path}/hsx-never.done after 0.2 s although the server "
        f"answered (0 piece files of it are there); the plugin's writer has written no stats file (it never "
        f"received a piece) (is the server running with SGLANG_PLUGINS=hsextract and "
        f"HSEXTRACT_DUMP_DIR={tmp_path}?)"
    )


def test_collector_rejects_other_token_ids(tmp_path: Path) -> None:
    d = make_dumper(tmp_path)
    r = Req("hsx-x", ids(12, 1))
    run_pass(d, [(r, 0, 12)])
    d.writer.flush()
    with pytest.raises(EngineError, match="sha256 mismatch"):
        dumpfiles.collect(tmp_path, r.rid, ids(12, 2), K + 1, 1.0, remove=False)
    with pytest.raises(EngineError, match="the server dumped 12 tokens, the prompt has 11"):
        dumpfiles.collect(tmp_path, r.rid, ids(11, 1), K + 1, 1.0, remove=False)


def test_raw_blocks_and_partial_writev_give_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer threads hand RawBlocks (views of the staging ring); os.writev may write only part of
    what it is given (e.g. past 2 GiB on Linux): the file must still hold every byte once, in order."""
    a = torch.randn(5, 7).to(torch.bfloat16)
    b = torch.randn(5, 3).to(torch.bfloat16)
    ref = dumpfiles.write_piece(tmp_path, "hsx-t", 0, 5, 5, [a, b]).read_bytes()
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: real(fd, [bytes(memoryview(bufs[0])[:13])]))
    raw = [dumpfiles.RawBlock("bfloat16", (5, t.shape[1]), memoryview(t.view(torch.uint8).reshape(-1).numpy()))
           for t in (a, b)]
    got = dumpfiles.write_piece(tmp_path, "hsx-t", 0, 5, 5, raw).read_bytes()
    assert got == ref
    _, (a2, b2) = dumpfiles.read_piece(tmp_path / dumpfiles.piece_name("hsx-t", 0, 5))
    assert torch.equal(a2, a) and torch.equal(b2, b)


def test_piece_file_layout_is_magic_json_raw(tmp_path: Path) -> None:
    t = torch.arange(6, dtype=torch.float32).view(3, 2)
    p = dumpfiles.write_piece(tmp_path, "hsx-f", 4, 7, 9, [t])
    raw = p.read_bytes()
    hlen = int.from_bytes(raw[8:12], "little")
    assert raw[:8] == b"HSXDUMP1"
    assert raw[12 + hlen :] == t.numpy().tobytes()
    header, (back,) = dumpfiles.read_piece(p)
    assert header["blocks"] == [{"dtype": "float32", "shape": [3, 2], "offset": 0, "nbytes": 24}]
    assert torch.equal(back, t)
    assert [x.name for x in dump_files(tmp_path)] == ["hsx-f.0000000004-0000000007.piece"]


@pytest.mark.parametrize("builtin", [False, True])
def test_one_block_per_tensor_and_a_one_piece_dump_is_not_copied(tmp_path: Path, builtin: bool) -> None:
    """The plugin writes K+1 blocks of width H per piece; the collector hands a one-piece dump's blocks
    out as read: K+1 contiguous tensors over the one buffer the file was read into."""
    d = make_dumper(tmp_path)
    r = Req("hsx-one", ids(9, 3))
    run_pass(d, [(r, 0, 9)], pad=2, builtin=builtin)
    d.writer.flush()
    (piece,) = tmp_path.glob("hsx-one.*.piece")
    header, _ = dumpfiles.read_piece(piece)
    assert [b["shape"] for b in header["blocks"]] == [[9, H]] * (K + 1)
    got = collect(tmp_path, r)
    assert_matches(got, r)
    assert all(t.is_contiguous() for t in got)
    # views into the one buffer the piece was read into, back to back as in the file: no copies
    ptrs = [t.data_ptr() for t in got]
    assert [b - a for a, b in zip(ptrs, ptrs[1:], strict=False)] == [9 * H * 2] * K


def test_collector_reads_the_older_one_wide_block_layout(tmp_path: Path) -> None:
    """Older plugins wrote one [rows, (K+1)*H] block per piece; such dumps still assemble."""
    r = Req("hsx-old", ids(12, 4))
    rows = full_states(r.origin_input_ids)
    dumpfiles.write_piece(tmp_path, r.rid, 0, 5, 12, [rows[:5]])
    dumpfiles.write_piece(tmp_path, r.rid, 5, 12, 12, [rows[5:]])
    dumpfiles.write_done(tmp_path, r.rid, {"n_tokens": 12, "pieces": [[0, 5], [5, 12]],
                                            "ids_sha256": dumpfiles.ids_digest(r.origin_input_ids),
                                            "dtype": "bfloat16", "width": rows.shape[1]})  # bound the reads
    got = collect(tmp_path, r)
    assert_matches(got, r)
    assert all(t.is_contiguous() for t in got)


# ---- capture set-up and hooks ---------------------------------------------------------------------
class FusedAddRMSNorm(torch.nn.Module):
    """SGLang's RMSNorm with a residual (fused_add_rmsnorm): writes the sum into `residual` and the normed
    state into `x`, in place, and returns both; without a residual it normalizes out of place."""

    def __init__(self, hidden: int = H, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, hidden).to(torch.bfloat16))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)

    def forward(self, x, residual=None, post_residual_addition=None):
        if residual is None:
            return self._norm(x)
        if post_residual_addition is not None:
            residual = residual + post_residual_addition
        residual.add_(x)
        x.copy_(self._norm(residual))
        return x, residual


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers_to_capture: list[int] = []
        self.norm = FusedAddRMSNorm()


class FakeLlama(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()
        self.config = types.SimpleNamespace(hidden_size=H)

    def set_eagle3_layers_to_capture(self, layer_ids: list[int]) -> None:
        self.model.layers_to_capture = [v + 1 for v in layer_ids]


class FakeDeepseekOld(FakeLlama):
    """DeepSeek's 0.5.16/0.5.23 quirk: ids taken raw unless the first is 1; no dflash setter."""

    def set_eagle3_layers_to_capture(self, layer_ids: list[int]) -> None:
        self.model.layers_to_capture = [v + 1 for v in layer_ids] if layer_ids[0] == 1 else list(layer_ids)


class FakeDeepseek(FakeDeepseekOld):
    def set_dflash_layers_to_capture(self, layer_ids: list[int]) -> None:
        self.model.layers_to_capture = [v + 1 for v in layer_ids]


def _dumper_for(tmp_path: Path, aux: tuple[int, ...], final_state: str = "pre_norm") -> plg.Dumper:
    d = plg.Dumper(plg.PluginConfig(tmp_path, aux, final_state), pin=False)
    d._is_writer_rank = True
    return d


def test_setup_captures_the_hidden_states_ids_and_writes_marker(tmp_path: Path) -> None:
    d = _dumper_for(tmp_path, (2, 30, 58))
    m = FakeDeepseek()
    d.setup_model(m, types.SimpleNamespace())
    assert d.mode == "plugin" and d.hidden_size == H
    assert d.verify_model(m) == [2, 30, 58]  # SGLang's "before layer i" index is the hidden_states id
    marker = d.write_marker([2, 30, 58])
    assert marker.name.startswith("plugin-")
    text = marker.read_text()
    assert '"layers_to_capture": [2, 30, 58]' in text and '"layer_convention": "hidden_states"' in text


def test_deepseek_quirk_is_refused(tmp_path: Path) -> None:
    # no dflash setter: set_eagle3 with the ids of a +1 class ([0, 4, 6]), which DeepSeek's rule takes raw
    d = _dumper_for(tmp_path, (1, 5, 7))
    m = FakeDeepseekOld()
    d.setup_model(m, types.SimpleNamespace())
    with pytest.raises(plg.PluginConfigError) as e:
        d.verify_model(m)
    assert str(e.value) == (
        "hsextract: FakeDeepseekOld captures layers [0, 4, 6], but aux_layers (hidden_states ids) [1, 5, 7] need "
        "[1, 5, 7] (SGLang's index = the hidden_states id). Refusing to dump the wrong layers."
    )
    # builtin mode (server launched with EAGLE3 ids one below, as for a +1 class): same check, with the launch hint
    d2 = _dumper_for(tmp_path, (3, 30, 58), "post_norm")
    m2 = FakeDeepseekOld()
    d2.setup_model(m2, types.SimpleNamespace(enable_return_aux_hidden_states=True))
    m2.set_eagle3_layers_to_capture([2, 29, 57])
    with pytest.raises(plg.PluginConfigError, match="DFLASH --return-aux-hidden-state-layer-ids 2 29 57"):
        d2.verify_model(m2)


def test_plugin_config_from_env(tmp_path: Path) -> None:
    assert plg.PluginConfig.from_env({}) is None
    cfg = plg.PluginConfig.from_env({"HSEXTRACT_DUMP_DIR": str(tmp_path), "HSEXTRACT_AUX_HIDDEN_STATES": "2, 30,58"})
    assert cfg.aux_layers == (2, 30, 58) and cfg.expected_capture == [2, 30, 58]
    with pytest.raises(plg.PluginConfigError, match="No such file or directory; the server launcher creates it"):
        plg.PluginConfig.from_env({"HSEXTRACT_DUMP_DIR": str(tmp_path / "nope"), "HSEXTRACT_AUX_HIDDEN_STATES": "1"})
    assert cfg.final_state == "pre_norm"
    with pytest.raises(plg.PluginConfigError, match=r"^HSEXTRACT_AUX_HIDDEN_STATES is not set: give the aux layer ids"):
        plg.PluginConfig.from_env({"HSEXTRACT_DUMP_DIR": str(tmp_path)})
    mtp = plg.PluginConfig.from_env({"HSEXTRACT_DUMP_DIR": str(tmp_path), "HSEXTRACT_AUX_HIDDEN_STATES": ""})
    assert mtp.aux_layers == () and mtp.expected_capture == []
    eight = plg.PluginConfig.from_env(
        {"HSEXTRACT_DUMP_DIR": str(tmp_path), "HSEXTRACT_AUX_HIDDEN_STATES": "0,1,2,3,4,5,6,7"})
    assert len(eight.aux_layers) == 8
    for bad in ("0,1,2,3,4,5,6,7,8", "1,1", "-1"):
        with pytest.raises(plg.PluginConfigError, match="need 0 to 8 distinct non-negative layer ids"):
            plg.PluginConfig.from_env({"HSEXTRACT_DUMP_DIR": str(tmp_path), "HSEXTRACT_AUX_HIDDEN_STATES": bad})
    post = plg.PluginConfig.from_env({"HSEXTRACT_DUMP_DIR": str(tmp_path), "HSEXTRACT_AUX_HIDDEN_STATES": "1",
                                      "HSEXTRACT_FINAL_STATE": "post_norm"})
    assert post.final_state == "post_norm"
    with pytest.raises(plg.PluginConfigError, match=r"HSEXTRACT_FINAL_STATE='normed': use pre_norm or post_norm"):
        plg.PluginConfig.from_env({"HSEXTRACT_DUMP_DIR": str(tmp_path), "HSEXTRACT_AUX_HIDDEN_STATES": "1",
                                   "HSEXTRACT_FINAL_STATE": "normed"})
    assert cfg.shared_prefix is False
    env = {"HSEXTRACT_DUMP_DIR": str(tmp_path), "HSEXTRACT_AUX_HIDDEN_STATES": "1"}
    assert plg.PluginConfig.from_env({**env, "HSEXTRACT_SHARED_PREFIX": "1"}).shared_prefix is True
    assert plg.PluginConfig.from_env({**env, "HSEXTRACT_SHARED_PREFIX": "0"}).shared_prefix is False
    with pytest.raises(plg.PluginConfigError, match=r"^HSEXTRACT_SHARED_PREFIX='yes': expected 1 \(radix cache on"):
        plg.PluginConfig.from_env({**env, "HSEXTRACT_SHARED_PREFIX": "yes"})


class _CHM:
    NULL, FULL = "NULL", "FULL"


def test_hooks_force_full_capture_and_append_final_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fbi = types.ModuleType("sglang.srt.model_executor.forward_batch_info")
    fbi.CaptureHiddenMode = _CHM
    monkeypatch.setitem(sys.modules, "sglang.srt.model_executor.forward_batch_info", fbi)
    d = _dumper_for(tmp_path, AUX, "post_norm")
    d.mode = "plugin"
    monkeypatch.setattr(plg, "_DUMPER", d)

    # LogitsProcessor._get_hidden_states_to_store: aux [T, K*H] + final [T, H] -> [T, (K+1)*H]
    def store(self, hidden_states, hidden_states_before_norm, aux_hidden_states, pruned_states,
              pruned_states_before_norm, aux_pruned_states, sample_indices, logits_metadata):
        return torch.cat(aux_hidden_states, dim=-1) if aux_hidden_states is not None else hidden_states

    full = types.SimpleNamespace(capture_hidden_mode=types.SimpleNamespace(is_full=lambda: True))
    aux = [torch.full((4, H), float(i)) for i in range(K)]
    final = torch.full((4, H), 9.0)
    out = plg._around_store(store, None, final, None, aux, None, None, None, None, full)
    assert out.shape == (4, (K + 1) * H) and torch.equal(out[:, K * H :], final)
    assert plg._around_store(store, None, final, None, None, None, None, None, None, full) is final

    # TpModelWorker.forward_batch_generation: FULL forced on EXTEND only, then the batch is dumped
    r = Req("hsx-hook", ids(6, 4))
    seen = {}

    def fwd(worker, batch, *a, capture_hidden_mode=None, **k):
        seen[batch.forward_mode.extend] = capture_hidden_mode
        return types.SimpleNamespace(logits_output=LogitsOut(full_states(r.origin_input_ids)))

    plg._around_forward(fwd, None, Batch([r], [0], [6]))
    plg._around_forward(fwd, None, Batch([r], [6], [1], Mode(False)))
    assert seen == {True: "FULL", False: None}
    d.writer.flush()
    assert_matches(collect(tmp_path, r), r)


# ---- the final state: pre-norm through the final norm's forward pre-hook ---------------------------------
def sgl_store(self, hidden_states, hidden_states_before_norm, aux_hidden_states, pruned_states,
              pruned_states_before_norm, aux_pruned_states, sample_indices, logits_metadata):
    """SGLang 0.5.16's LogitsProcessor._get_hidden_states_to_store, FULL/NULL branches."""
    if not logits_metadata.capture_hidden_mode.is_full():
        return None
    return torch.cat(aux_hidden_states, dim=-1) if aux_hidden_states is not None else hidden_states


def _meta(full: bool = True) -> types.SimpleNamespace:
    return types.SimpleNamespace(capture_hidden_mode=types.SimpleNamespace(is_full=lambda: full))


class _SGLDecoder(_Inner):
    """DeepseekV2Model.forward's shape: aux = hidden + residual entering layer i (i in layers_to_capture), then
    the final norm called as SGLang calls it."""

    num_layers = 10

    def forward(self, n: int, seed: int, residual_none: bool, extra: bool, skip_norm: bool) -> dict:
        g = torch.Generator().manual_seed(seed)

        def rnd() -> torch.Tensor:
            return (torch.randn(n, H, generator=g) * 3).to(torch.bfloat16)

        hidden, residual, aux = rnd(), rnd(), []
        for i in range(self.num_layers):
            if i in self.layers_to_capture:
                aux.append(hidden + residual)
            hidden, residual = rnd(), rnd()  # the layer's output pair
        add = rnd() if extra else None
        if residual_none:
            pre = hidden.clone()
        else:
            pre = hidden + (residual + add if add is not None else residual)
        if skip_norm:  # an idle batch: the model skips its norm
            normed = hidden
        elif residual_none:
            normed = self.norm(hidden)
        elif add is not None:
            normed, _ = self.norm(hidden, residual, post_residual_addition=add)
        else:
            normed, _ = self.norm(hidden, residual)
        return {"pre": pre, "post": normed, "aux": aux}


class FakeSGLModel(FakeDeepseek):
    """The CausalLM: the decoder's forward, then the logits processor's store (through the plugin's hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _SGLDecoder()

    def forward_rows(self, n: int, seed: int, *, residual_none: bool = False, extra: bool = False,
                     skip_norm: bool = False, full: bool = True) -> dict:
        r = self.model(n, seed, residual_none, extra, skip_norm)
        r["out"] = plg._around_store(sgl_store, None, r["post"], None, r["aux"] or None, None, None, None, None,
                                     _meta(full))
        return r


def _setup(tmp_path: Path, aux: tuple[int, ...], final_state: str, monkeypatch: pytest.MonkeyPatch,
           builtin: bool = False) -> tuple[plg.Dumper, FakeSGLModel]:
    d = _dumper_for(tmp_path, aux, final_state)
    m = FakeSGLModel()
    monkeypatch.setattr(plg, "_install_hook", lambda target, hook: None)  # builtin: no SGLang here
    d.setup_model(m, types.SimpleNamespace(enable_return_aux_hidden_states=builtin))
    monkeypatch.setattr(plg, "_DUMPER", d)
    return d, m


@pytest.mark.parametrize("aux", [(1,), (1, 3, 5), (0, 1, 2, 3, 4), (0, 1, 2, 3, 4, 5, 6, 7)],
                         ids=["1", "3", "5", "8"])
def test_pre_norm_is_the_final_norms_input_sum_for_1_to_8_aux_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aux: tuple[int, ...]
) -> None:
    d, m = _setup(tmp_path, aux, "pre_norm", monkeypatch)
    assert m.model.layers_to_capture == list(aux) and d.verify_model(m) == list(aux)  # hidden_states ids
    assert d.norm_module == "FusedAddRMSNorm"
    r = m.forward_rows(11, seed=len(aux))
    k = len(aux)
    assert r["out"].shape == (11, (k + 1) * H)
    assert torch.equal(r["out"][:, k * H:], r["pre"])  # hidden + residual, read before the in-place norm
    assert not torch.equal(r["out"][:, k * H:], r["post"])
    for j in range(k):
        assert torch.equal(r["out"][:, j * H:(j + 1) * H], r["aux"][j])
    assert not torch.equal(r["pre"], r["post"])
    # through the dump files, as the client reads them: k + 1 tensors
    req = Req("hsx-pre", list(range(11)))
    d.on_extend(Batch([req], [0], [11]), LogitsOut(r["out"]))
    d.writer.flush()
    got = dumpfiles.collect(tmp_path, req.rid, req.origin_input_ids, k + 1, 5.0).hidden_states
    assert len(got) == k + 1 and torch.equal(got[-1], r["pre"])
    assert all(torch.equal(got[j], r["aux"][j]) for j in range(k))


def test_post_norm_is_the_norms_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d, m = _setup(tmp_path, AUX, "post_norm", monkeypatch)
    assert d.tap is None and d.norm_module is None and m.model.norm._forward_pre_hooks == {}
    r = m.forward_rows(7, seed=1)
    assert torch.equal(r["out"][:, K * H:], r["post"]) and not torch.equal(r["out"][:, K * H:], r["pre"])


@pytest.mark.parametrize("final_state", ["pre_norm", "post_norm"])
def test_mtp_final_state_alone_without_capture_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      final_state: str) -> None:
    d, m = _setup(tmp_path, (), final_state, monkeypatch)
    assert m.model.layers_to_capture == [] and d.verify_model(m) == []  # no setter call: no aux capture
    r = m.forward_rows(5, seed=2)
    assert torch.equal(r["out"], r["pre"] if final_state == "pre_norm" else r["post"])
    req = Req("hsx-mtp", [1, 2, 3, 4, 5])
    d.on_extend(Batch([req], [0], [5]), LogitsOut(r["out"]))
    d.writer.flush()
    got = dumpfiles.collect(tmp_path, req.rid, req.origin_input_ids, 1, 5.0).hidden_states
    assert len(got) == 1 and torch.equal(got[0], r["out"])


def test_mtp_needs_the_plugin_capture_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(plg.PluginConfigError, match=r"the final state alone \(no aux layers, capture: mtp\) needs"):
        _setup(tmp_path, (), "pre_norm", monkeypatch, builtin=True)


def test_pre_norm_without_residual_and_with_post_residual_addition(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _, m = _setup(tmp_path, AUX, "pre_norm", monkeypatch)
    r = m.forward_rows(6, seed=3, residual_none=True)  # DeepSeek after a gather: norm(hidden) alone
    assert torch.equal(r["out"][:, K * H:], r["pre"])
    r = m.forward_rows(6, seed=4, extra=True)  # residual + post_residual_addition first, as SGLang adds
    assert torch.equal(r["out"][:, K * H:], r["pre"])


def test_a_forward_without_the_norm_never_gets_a_stale_pre_norm_state(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    d, m = _setup(tmp_path, AUX, "pre_norm", monkeypatch)
    m.forward_rows(6, seed=5, full=False)  # a decode forward (capture NULL): its pre-norm state is dropped
    assert d.tap.value is None
    m.model.norm(*(torch.ones(6, H, dtype=torch.bfloat16) for _ in range(2)))  # a norm without a store after it
    r = m.forward_rows(6, seed=6, skip_norm=True)  # the next forward skips the norm: the decoder's hook clears
    assert r["out"].shape == (6, K * H)  # left without a final state: the dump fails loudly
    req = Req("hsx-stale", list(range(6)))
    d.on_extend(Batch([req], [0], [6]), LogitsOut(r["out"]))
    d.writer.flush()
    with pytest.raises(EngineError, match="is not 3\\+1 tensors"):
        dumpfiles.collect(tmp_path, req.rid, req.origin_input_ids, K + 1, 5.0)


def test_builtin_mode_pre_norm_replaces_last_hidden_states(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    installed = []
    d = _dumper_for(tmp_path, AUX, "pre_norm")
    m = FakeSGLModel()
    monkeypatch.setattr(plg, "_install_hook", lambda target, hook: installed.append((target, hook)))
    d.setup_model(m, types.SimpleNamespace(enable_return_aux_hidden_states=True))
    monkeypatch.setattr(plg, "_DUMPER", d)
    assert installed == [(plg.TARGET_LAST_STORE, plg._around_last_store)]
    m.set_dflash_layers_to_capture(list(AUX))  # what --return-aux-hidden-state-layer-ids does (DFLASH: +1)
    hidden, residual = (torch.randn(4, H).to(torch.bfloat16) for _ in range(2))
    pre = hidden + residual
    normed, _ = m.model.norm(hidden, residual)
    last = plg._around_last_store(lambda self, hs, aux, meta: hs, None, normed, [normed], _meta())
    assert torch.equal(last, pre)
    # no pre-norm state for this forward: no final state at all (an `.err` dump), never the post-norm one
    assert plg._around_last_store(lambda self, hs, aux, meta: hs, None, normed, [normed], _meta()) is None


def test_model_without_final_norm_refuses_pre_norm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = FakeDeepseek()
    del m.model.norm
    d = _dumper_for(tmp_path, AUX, "pre_norm")
    with pytest.raises(plg.PluginConfigError, match=r"FakeDeepseek has no final norm module .* use final_state: "
                                                    r"post_norm$"):
        d.setup_model(m, types.SimpleNamespace())


@pytest.mark.parametrize("aux", [AUX, ()], ids=["aux", "mtp"])
def test_both_final_states_of_one_forward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          aux: tuple[int, ...]) -> None:
    """final_state both (the fidelity benchmark's diagnostic): [aux..., pre, post] of the same forward."""
    d, m = _setup(tmp_path, aux, "both", monkeypatch)
    r = m.forward_rows(9, seed=8)
    k = len(aux)
    assert r["out"].shape == (9, (k + 2) * H)
    assert torch.equal(r["out"][:, k * H:(k + 1) * H], r["pre"]) and torch.equal(r["out"][:, (k + 1) * H:], r["post"])
    req = Req("hsx-both", list(range(9)))
    d.on_extend(Batch([req], [0], [9]), LogitsOut(r["out"]))
    d.writer.flush()
    got = dumpfiles.collect(tmp_path, req.rid, req.origin_input_ids, k + 2, 5.0).hidden_states
    assert torch.equal(got[-2], r["pre"]) and torch.equal(got[-1], r["post"])
    with pytest.raises(plg.PluginConfigError, match="final_state both needs the plugin capture source"):
        _setup(tmp_path, AUX, "both", monkeypatch, builtin=True)
