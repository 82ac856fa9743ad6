"""The sglang engine client against tests/fake_sglang.py: batching, chunking, retries, failures, ordering."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # fake_sglang, imported next, lives here
from conftest import listen_port, shard_metadata
from fake_sglang import HIDDEN, FakeServer, expected_states

from hsextract.engines.base import CaptureSpec, Prompt
from hsextract.errors import ConfigError, EngineError
from hsextract.extract.run import ChunkPrompts, extract_chunk
from hsextract.prepare.prefix_share import find_parents
from hsextract.sglang import server as hsrv
from hsextract.sglang.api import RequestRefused
from hsextract.sglang.client import RID_PREFIX, SGLangEngine
from hsextract.shard import ShardReader

AUX = (1, 3, 5)
SPEC = CaptureSpec(aux_layers=AUX, final_state="post_norm")


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 200) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [Prompt(i, f"s{i:03d}", torch.randint(0, 5000, (L,), generator=g).tolist()) for i, L in enumerate(lens)]


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest):
    kw = getattr(request, "param", {})
    srv = FakeServer(tmp_path, AUX, **kw).start()
    yield srv
    srv.stop()


def engine(srv: FakeServer, **kw) -> SGLangEngine:
    kw.setdefault("timeout_s", 5.0)
    kw.setdefault("backoff_s", 0.01)
    return SGLangEngine(srv.url, SPEC, srv.dumper.cfg.dump_dir, **kw)


def check(results, ps) -> None:
    assert [r.index for r in results] == [p.index for p in ps]
    for r, p in zip(results, ps, strict=True):
        assert r.sample_id == p.sample_id
        ref = expected_states(p.input_ids, len(AUX) + 1)
        assert len(r.hidden_states) == len(AUX) + 1
        for i, (got, want) in enumerate(zip(r.hidden_states, ref, strict=True)):
            assert got.dtype == torch.bfloat16 and got.shape == (len(p.input_ids), HIDDEN)
            assert torch.equal(got, want), f"{p.sample_id} tensor {i}"


@pytest.mark.parametrize("server", [{}, {"builtin": True}], indirect=True, ids=["plugin", "builtin"])
def test_many_concurrent_samples_chunked_and_batched(server: FakeServer) -> None:
    ps = prompts(60, seed=1)
    ticks = []
    eng = engine(server, concurrency=16, progress=ticks.append)
    got = list(eng.extract(ps))
    check(got, ps)
    assert len(ticks) == 60
    assert server.max_batch > 1  # requests really shared passes
    assert server.passes < sum(len(p.input_ids) for p in ps) // 64 + 60
    assert sorted(x.name for x in server.dumper.cfg.dump_dir.iterdir()
                  if not x.name.startswith(("plugin-", "stats-"))) == []
    assert eng.version().startswith("sglang None + hsextract plugin 2 (capture ")


@pytest.mark.parametrize("server", [{"write_delay_s": 0.05, "gather": 4}], indirect=True)
def test_concurrency_bounds_requests_in_flight_not_dump_collection(server: FakeServer) -> None:
    """`concurrency` requests at the server at most, although every dump lags its answer by 50 ms; and reached:
    the first pass waits for 4 requests (`gather`), so that a loaded machine reaches it too (CI saw 3 without)."""
    ps = prompts(40, seed=4)
    check(list(engine(server, concurrency=4).extract(ps)), ps)
    assert server.max_inflight == 4


def test_the_window_holds_a_bounded_number_of_rows() -> None:
    """Sent or collected and not yet handed on: at most `window` prompts and `max_rows` rows (HELD_BYTES: long
    samples of a large model are GBs each), the first unyielded prompt always admitted."""
    from hsextract.sglang.client import _Admission

    items = [Prompt(index=k, sample_id=f"s{k}", input_ids=[1] * n) for k, n in enumerate((100, 100, 60, 300, 10))]
    plan = _Admission(items, False, 8, max_rows=250)
    assert list(plan.admit(0)) == [0, 1]  # 100 + 100; the next 60 would make 260
    plan.yielded()
    assert list(plan.admit(1)) == [2]  # 100 + 60; then 300 is over
    plan.yielded()
    plan.yielded()
    assert list(plan.admit(0)) == [3]  # the head, over the bound alone
    assert list(plan.admit(1)) == []
    plan.yielded()
    assert list(plan.admit(0)) == [4]
    assert list(_Admission(items, False, 3).admit(0)) == [0, 1, 2]  # no bound: the window's count


@pytest.mark.parametrize("server", [{"gather": 1}], indirect=True)
def test_a_small_row_bound_sends_one_prompt_at_a_time(server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """HELD_BYTES below one prompt's rows: one request at a time, every sample still right and in order."""
    from hsextract.sglang import client

    monkeypatch.setattr(client, "HELD_BYTES", 1)
    ps = prompts(12, seed=5)
    check(list(engine(server, concurrency=8).extract(ps)), ps)
    assert server.max_inflight == 1


def test_one_engine_extracts_twice_with_fresh_rids(server: FakeServer) -> None:
    """A warm-up extract, then another over the same prompts, on one engine: every call sends fresh rids
    (repeated rids would make the second call wait for dumps that never come)."""
    ps = prompts(12, seed=11)
    eng = engine(server, concurrency=6, timeout_s=3.0, retries=0)
    check(list(eng.extract(ps[:6])), ps[:6])
    check(list(eng.extract(ps)), ps)
    assert len(server.rids) == 18 and len(set(server.rids)) == 18
    assert {r.rsplit("-x", 1)[1].split("-")[0] for r in server.rids} == {"0", "1"}
    server.dumper.writer.flush()
    assert server.dumper.writer.stats.rids_reused == 0


@pytest.mark.parametrize("server", [{"fail_first": 3}], indirect=True)
def test_http_errors_are_retried_then_succeed(server: FakeServer) -> None:
    ps = prompts(8, seed=2)
    check(list(engine(server, concurrency=4, retries=3).extract(ps)), ps)
    assert server.n_requests == 8 + 3


@pytest.mark.parametrize("server", [{"abort_first": 2}], indirect=True)
def test_a_request_aborted_with_200_is_retried_at_once(server: FakeServer) -> None:
    """SGLang answers 200 with finish_reason abort for a request aborted without a status (/abort_request): no dump
    will come, so the attempt fails at once instead of waiting timeout_s for one."""
    ps = prompts(5, seed=3)
    check(list(engine(server, concurrency=1, timeout_s=600.0, retries=2).extract(ps)), ps)
    assert server.n_requests == 5 + 2
    server.abort_first, server.n_requests = 100, 0
    with pytest.raises(EngineError) as e:
        list(engine(server, concurrency=1, timeout_s=600.0, retries=0).extract(ps[:1]))
    assert str(e.value) == (
        f"sample 's000' (index 0): failed once although the server at {server.url} is healthy; last error: the "
        f"server aborted request {server.rids[-1]}: Abort before prefill. The chunk fails, no shard is written.")


@pytest.mark.parametrize("server", [{"skip_dump_first": 2}], indirect=True)
def test_missing_dump_is_retried_after_the_collect_timeout(server: FakeServer) -> None:
    ps = prompts(5, seed=3)
    check(list(engine(server, concurrency=5, timeout_s=0.5, retries=2).extract(ps)), ps)
    assert server.n_requests == 5 + 2


@pytest.mark.parametrize("server", [{"hang_first": 1}], indirect=True)
def test_hanging_request_times_out_and_is_retried(server: FakeServer) -> None:
    ps = prompts(3, seed=4)
    check(list(engine(server, concurrency=3, timeout_s=0.7, retries=1).extract(ps)), ps)  # no hang: it timed out


@pytest.mark.parametrize("server", [{"fail_first": 100}], indirect=True)
def test_repeated_failures_fail_the_chunk_with_the_reason(server: FakeServer) -> None:
    ps = prompts(4, seed=5)
    with pytest.raises(EngineError) as e:
        list(engine(server, concurrency=1, retries=2).extract(ps))
    assert str(e.value) == (
        f"sample 's000' (index 0): failed 3 times although the server at {server.url} is healthy; last error: "
        'POST /generate returned HTTP 500: {"error": "injected failure"}. The chunk fails, no shard is written.'
    )


def wait_for(done, limit_s: float = 120.0) -> None:
    """Until done() holds: a condition of the fake's own threads, polled (no event of theirs says it)."""
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, "the fake server never got there"
        time.sleep(0.01)


def rid_files(srv: FakeServer) -> list[str]:
    return sorted(p.name for p in srv.dumper.cfg.dump_dir.iterdir() if p.name.startswith(RID_PREFIX))


@pytest.mark.parametrize("server", [{"write_delay_s": 0.02}], indirect=True)
def test_a_failed_chunk_leaves_no_dump_of_its_requests(server: FakeServer) -> None:
    """Sample 7 refused (HTTP 400, as a prompt over the context length): the chunk fails and its other requests
    are given up, but the server still computes and dumps them. The server's dump dir is RAM; once the job is
    done with the engine, none of its requests' files are left there."""
    eng = engine(server, concurrency=8, retries=3)
    send = eng.api.generate

    def generate(payload: dict) -> dict:
        if "-i7-" in payload["rid"]:
            raise RequestRefused("POST /generate was refused with HTTP 400: input too long", 400, "")
        return send(payload)

    eng.api.generate = generate
    with pytest.raises(EngineError, match="sample 's007' .*input too long"):
        list(eng.extract(prompts(16, seed=9)))
    sent = server.n_requests
    wait_for(lambda: server.finished == sent)  # the server finishes what it was sent, the chunk failed or not
    server.dumper.writer.flush()
    eng.close()
    assert rid_files(server) == []


def test_an_earlier_attempt_of_the_chunk_leaves_nothing_behind(server: FakeServer) -> None:
    """A retried job of chunk 3 removes what an earlier attempt of chunk 3 left (late dumps), and nothing of
    another chunk's, nor of another project's chunk 3 of the same run_name (another working folder) on the
    same server."""
    dump = server.dumper.cfg.dump_dir
    eng = engine(server, chunk=3)
    mine = eng._chunk_rids
    assert re.fullmatch(rf"{RID_PREFIX}run\.[0-9a-f]{{8}}-c00003-", mine)
    old = [dump / f"{mine}0badf00d-x0-i{k}-a0.piece" for k in range(3)]
    other_chunk = dump / f"{mine.replace('-c00003-', '-c00004-')}0badf00d-x0-i0-a0.piece"
    other_project = dump / f"{RID_PREFIX}run.00000000-c00003-0badf00d-x0-i0-a0.piece"
    for f in [*old, other_chunk, other_project]:
        f.write_bytes(b"late")
    ps = prompts(4, seed=10)
    check(list(eng.extract(ps)), ps)
    eng.close()
    assert rid_files(server) == sorted([other_chunk.name, other_project.name])


@pytest.mark.parametrize("server", [{"die_after": 5}], indirect=True)
def test_dead_server_fails_fast_and_says_so(server: FakeServer) -> None:
    ps = prompts(20, seed=6)
    got = []
    with pytest.raises(EngineError, match=r"the SGLang server at http://127\.0\.0\.1:\d+ is down \(health check: "
                       r"Connection(Refused|Reset)Error.*no shard is written; rerun to restart the server"):
        for r in engine(server, concurrency=2, timeout_s=30, retries=5, backoff_s=1.0).extract(ps):
            got.append(r)
    check(got, ps[: len(got)])  # what came out before the failure is right and in order
    assert len(got) <= 5


@pytest.mark.parametrize("server", [{"wrong_prompt_tokens": True}], indirect=True)
def test_prompt_token_count_mismatch_is_fatal(server: FakeServer) -> None:
    ps = prompts(2, seed=7)
    with pytest.raises(EngineError, match=r"sample 's000' \(index 0\): the server counted \d+ prompt tokens, the "
                       r"prompt has \d+"):
        list(engine(server).extract(ps))


def test_no_plugin_marker_is_a_clear_error(tmp_path: Path) -> None:
    srv = FakeServer(tmp_path, AUX, marker=False).start()
    try:
        with pytest.raises(EngineError, match=f"no hsextract plugin marker in {tmp_path}"):
            list(engine(srv).extract(prompts(1)))
    finally:
        srv.stop()


def test_aux_layer_mismatch_with_running_server(server: FakeServer) -> None:
    spec = CaptureSpec(aux_layers=(2, 4, 6), final_state="post_norm")
    eng = SGLangEngine(server.url, spec, server.dumper.cfg.dump_dir)
    with pytest.raises(EngineError, match=r"captures aux layers \[1, 3, 5\] \(hidden_states ids\), this run asks for "
                                          r"hidden_states\[2, 4, 6\] = outputs of decoder layers 1, 3, 5; restart"):
        list(eng.extract(prompts(1)))


@pytest.mark.parametrize("final_state", ["pre_norm", "both"])
def test_final_state_of_the_server_is_what_the_run_gets(tmp_path: Path, final_state: str) -> None:
    """A pre_norm server gives len(aux)+1 tensors, a "both" server +2; a server with another final state is
    refused (its data would silently carry the other convention)."""
    srv = FakeServer(tmp_path, AUX, final_state=final_state).start()
    try:
        spec = CaptureSpec(AUX, final_state)
        got = list(SGLangEngine(srv.url, spec, tmp_path).extract(prompts(3)))
        for c, p in zip(got, prompts(3), strict=True):
            assert len(c.hidden_states) == spec.num_tensors == len(AUX) + (2 if final_state == "both" else 1)
            want = expected_states(p.input_ids, spec.num_tensors)
            assert all(torch.equal(a, b) for a, b in zip(c.hidden_states, want, strict=True))
        with pytest.raises(EngineError) as e:
            list(SGLangEngine(srv.url, CaptureSpec(AUX, "post_norm"), tmp_path).extract(prompts(1)))
        assert str(e.value).endswith(f"captures final_state {final_state}, this run asks for post_norm; restart "
                                     "the server with this run's final_state")
    finally:
        srv.stop()


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^final_state: 'normed'; use pre_norm or post_norm$"):
        SGLangEngine("http://127.0.0.1:1", CaptureSpec(AUX, "normed"), tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^capture: mtp \(no aux layers\) needs sglang.capture: plugin"):
        hsrv.ServerConfig(model="/m", aux_layers=(), capture="builtin", final_state="pre_norm")
    with pytest.raises(ConfigError, match=r"^final_state both needs sglang.capture: plugin"):
        hsrv.ServerConfig(model="/m", aux_layers=(1,), capture="builtin", final_state="both")
    assert hsrv.ServerConfig(model="/m", aux_layers=(), final_state="pre_norm").aux_layers == ()
    assert hsrv.build_env(hsrv.ServerConfig(model="/m", aux_layers=(), final_state="pre_norm"), Path("/d"),
                          base={})["HSEXTRACT_AUX_HIDDEN_STATES"] == ""
    with pytest.raises(ConfigError, match="dump_dir is required"):
        SGLangEngine("http://127.0.0.1:1", SPEC)
    with pytest.raises(ConfigError, match="expected http://host:port"):
        SGLangEngine("127.0.0.1:1", SPEC, tmp_path)


# ---- server lifecycle (fake server as a real subprocess) --------------------------------------------
REPO = Path(__file__).resolve().parents[1]


def fake_cfg(tmp_path: Path, port: int, **kw) -> hsrv.ServerConfig:
    kw.setdefault("env", {"PYTHONPATH": f"{REPO / 'src'}:{REPO / 'tests'}"})
    kw.setdefault("final_state", "post_norm")
    return hsrv.ServerConfig(model=str(tmp_path / "model"), aux_layers=AUX, module="fake_sglang", port=port,
                             run_name="t/1", startup_timeout_s=60, stop_grace_s=5, **kw)


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def test_server_start_reuse_restart_and_stop(tmp_path: Path) -> None:
    state = tmp_path / "server"
    cfg = fake_cfg(tmp_path, listen_port(2), replicas=2, gpus=(4, 5), chunked_prefill_size=32)
    h = hsrv.ensure_server(state, cfg, replica=1)
    try:
        assert h.url == f"http://127.0.0.1:{cfg.port + 1}"
        assert h.dump_dir.name.startswith("hsx-t_1-") and (h.dump_dir.stat().st_mode & 0o777) == 0o700
        assert str(h.dump_dir).startswith("/dev/shm/") or not Path("/dev/shm").is_dir()
        env = environ_of(h.pid)
        assert env["CUDA_VISIBLE_DEVICES"] == "5" and env["SGLANG_PLUGINS"] == "hsextract"
        assert env["HSEXTRACT_AUX_HIDDEN_STATES"] == "1,3,5" and env["HSEXTRACT_DUMP_DIR"] == str(h.dump_dir)
        assert os.getpgid(h.pid) == h.pid  # its own process group
        assert "--disable-radix-cache" in h.command and h.command[h.command.index("--chunked-prefill-size") + 1] == "32"
        # reuse: same process
        assert hsrv.ensure_server(state, cfg, replica=1).pid == h.pid
        ps = prompts(10, seed=9)
        check(list(SGLangEngine(h, SPEC, timeout_s=5, concurrency=4).extract(ps)), ps)
        # a killed server is replaced on the next call, with a fresh dump dir
        os.kill(h.pid, signal.SIGKILL)
        h2 = hsrv.ensure_server(state, cfg, replica=1)
        assert h2.pid != h.pid and h2.dump_dir != h.dump_dir and not h.dump_dir.exists()
    finally:
        killed = hsrv.stop_servers(state, grace_s=5)
    assert killed == [h2.pid]
    assert not h2.dump_dir.exists() and list(state.glob("replica-*.json")) == []
    assert not hsrv._alive(h2.pid)


def test_stale_server_from_a_crashed_run_is_killed(tmp_path: Path) -> None:
    """An orphan (e.g. after kill -9 of Snakemake) is found through its pidfile and killed with its group."""
    import subprocess

    state = tmp_path / "server"
    state.mkdir()
    dump = hsrv.make_dump_dir("stale")
    env = dict(os.environ, HSEXTRACT_DUMP_DIR=str(dump))
    orphan = subprocess.Popen([sys.executable, "-c", "import subprocess,sys,time; "
                               "subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); "
                               "print('ready', flush=True); time.sleep(60)"],
                              env=env, start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert orphan.stdout.readline() == "ready\n"  # its child started, its environment set up (read from /proc)
    st = os.lstat(dump)  # as the launcher records it: stop removes that very directory only
    h = hsrv.ServerHandle(url="http://127.0.0.1:1", dump_dir=dump, pid=orphan.pid, dump_dir_dev=st.st_dev,
                          dump_dir_ino=st.st_ino)
    (state / "replica-0.json").write_text(h.to_json())
    assert hsrv.stop_servers(state, grace_s=5) == [orphan.pid]
    assert orphan.wait(5) is not None and not hsrv._group_alive(orphan.pid)
    assert not dump.exists()
    # a pidfile whose pid now belongs to someone else is not killed
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        (state / "replica-0.json").write_text(
            hsrv.ServerHandle("http://x:1", Path("/dev/shm/hsx-gone"), other.pid).to_json())
        assert hsrv.stop_servers(state) == [] and other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_server_that_dies_during_startup_reports_its_log(tmp_path: Path) -> None:
    cfg = fake_cfg(tmp_path, listen_port(2), launch_args=("--die-after", "x"))  # argparse error: exit 2
    with pytest.raises(EngineError, match=r"(?s)exited with code 2 during start-up.*--die-after: invalid int value"):
        hsrv.ensure_server(tmp_path / "server", cfg)
    assert list((tmp_path / "server").glob("replica-*.json")) == []


def test_server_without_plugin_is_refused(tmp_path: Path) -> None:
    cfg = fake_cfg(tmp_path, listen_port(2), env={"PYTHONPATH": f"{REPO / 'src'}:{REPO / 'tests'}",
                                               "HSEXTRACT_DUMP_DIR": ""})
    with pytest.raises(EngineError, match="healthy but the hsextract plugin is not active"):
        hsrv.ensure_server(tmp_path / "server", cfg)
    # the refused server is gone (it used to be left running: its environment lacked the dump dir)
    assert procs_mentioning(str(tmp_path)) == []


def procs_mentioning(s: str) -> list[int]:
    out = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if s.encode() in p.read_bytes():
                out.append(int(p.parent.name))
        except OSError:
            pass
    return out


def test_prefill_cuda_graphs_off_by_default_and_on_from_the_config(tmp_path: Path) -> None:
    from hsextract.config.settings import from_config
    from hsextract.sglang.config import server_config_from

    base = {"model": "/m", "capture": "custom", "aux_layers": [1, 3], "aux_layers_convention": "hidden_states",
            "run_name": "r", "final_state": "post_norm"}
    tail = ["--skip-tokenizer-init", "--enable-return-hidden-states"]
    off = server_config_from(from_config(base).extract, python="/py")
    assert off.prefill_cuda_graph is False
    assert hsrv.build_command(off)[-3:] == [*tail, "--disable-prefill-cuda-graph"]
    on = server_config_from(from_config(base | {"sglang": {"prefill_cuda_graph": True}}).extract, python="/py")
    assert hsrv.build_command(on)[-2:] == tail  # graphs captured in FULL mode, as before
    assert hsrv.config_hash(off, 0) != hsrv.config_hash(on, 0)  # a running server of the other kind is not reused


def test_launch_command_for_builtin_capture(tmp_path: Path) -> None:
    cfg = hsrv.ServerConfig(model="/m", aux_layers=(2, 30, 58), python="/env/bin/python", tp=8,
                            capture="builtin", launch_args=("--mem-fraction-static", "0.8"), final_state="post_norm")
    assert hsrv.build_command(cfg) == [
        "/env/bin/python", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1", "--port",
        "30000", "--tp", "8", "--disable-radix-cache", "--skip-tokenizer-init", "--enable-return-aux-hidden-states",
        # DFLASH names layers by their output: hidden_states[2, 30, 58] are the outputs of 1, 29, 57
        "--speculative-algorithm", "DFLASH", "--return-aux-hidden-state-layer-ids", "1", "29", "57",
        "--disable-prefill-cuda-graph", "--mem-fraction-static", "0.8"]
    with pytest.raises(ConfigError, match="2 replicas x tp 8 use 16: list exactly those"):
        hsrv.ServerConfig(model="/m", aux_layers=(1,), tp=8, replicas=2, gpus=tuple(range(8)), final_state="pre_norm")
    three = hsrv.ServerConfig(model="/m", aux_layers=(1,), tp=2, replicas=3, final_state="pre_norm")
    assert hsrv.gpu_set(three, 2) == [4, 5]


def test_trust_remote_code_reaches_the_server_command() -> None:
    from hsextract.config.settings import from_config
    from hsextract.sglang.config import server_config_from

    def server(**kw):
        config = {"model": "/m", "capture": "custom", "aux_layers": [1, 3], "aux_layers_convention": "hidden_states",
                  "run_name": "r", **kw}
        return server_config_from(from_config(config).extract, python="/py")

    assert "--trust-remote-code" not in hsrv.build_command(server())
    trusted = server(trust_remote_code=True)
    assert hsrv.build_command(trusted)[-2:] == ["--disable-prefill-cuda-graph", "--trust-remote-code"]
    # in launch_args: the launcher's own flag, refused with the key to set (issue 36)
    with pytest.raises(ConfigError, match=r"^sglang.launch_args\[0\]: --trust-remote-code is set by the launcher "
                                          r"itself; set `trust_remote_code: true`$"):
        server(trust_remote_code=True, sglang={"launch_args": ["--trust-remote-code"]})
    # a running server started without it is not reused
    assert hsrv.config_hash(trusted, 0) != hsrv.config_hash(server(), 0)
    # config/kimi.yaml: from the key, not from launch_args
    import yaml

    kimi = yaml.safe_load((Path(__file__).resolve().parents[1] / "config/kimi.yaml").read_text())
    assert kimi["trust_remote_code"] is True and "--trust-remote-code" not in kimi["sglang"]["launch_args"]


def test_final_state_is_always_chosen() -> None:
    """pre_norm (speculators) or post_norm (SpecForge): neither the client's spec nor the server has a default."""
    with pytest.raises(TypeError, match="final_state"):
        CaptureSpec(aux_layers=AUX)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="final_state"):
        hsrv.ServerConfig(model="/m", aux_layers=AUX)  # type: ignore[call-arg]


# ---- shared prefixes (docs/SHARED_PREFIX.md section 5): radix cache on, parents first ---------------------------
def family_chunk(seed: int = 21) -> ChunkPrompts:
    """Three families in interleaved chunk order: a (root) -> b -> c, a -> d; e -> f, e sharing its first 5 tokens
    (a template opening, below any reference) with a; g alone."""
    g = torch.Generator().manual_seed(seed)

    def new(n: int) -> list[int]:
        return torch.randint(0, 5000, (n,), generator=g).tolist()

    a = new(150)
    b = a[:100] + new(80)
    c = b[:170] + new(50)
    d = a[:120] + new(30)
    e = a[:5] + new(85)
    f = e[:80] + new(40)
    gg = new(60)
    ids = [a, e, b, gg, f, d, c]
    refs = [(-1, 0), (-1, 0), (0, 100), (-1, 0), (1, 80), (0, 120), (2, 170)]
    return ChunkPrompts([f"s{k}" for k in range(len(ids))], ids, [[1] * len(x) for x in ids],
                        [p for p, _ in refs], [k for _, k in refs])


def run_chunk(srv: FakeServer, chunk: ChunkPrompts, path: Path, share: bool, **kw) -> dict:
    kw = {"concurrency": 4, "retries": 1, "backoff_s": 0.01, "timeout_s": 10.0, **kw}
    eng = SGLangEngine(srv.url, SPEC, srv.dumper.cfg.dump_dir, share_prefixes=share, **kw)
    meta = shard_metadata(engine="sglang", aux_layers=list(AUX), hidden_size=HIDDEN, final_state="post_norm")
    return extract_chunk(chunk if share else ChunkPrompts(chunk.sample_ids, chunk.input_ids, chunk.loss_masks),
                         path, eng, meta, progress=False)


def wrong_samples(path: Path, chunk: ChunkPrompts) -> list[str]:
    """The samples of a shard whose assembled rows are not the fake model's states at their positions."""
    r = ShardReader(path)
    bad = []
    for i, ids in enumerate(chunk.input_ids):
        s = r[i]
        want = expected_states(ids, len(AUX) + 1)
        if s["input_ids"].tolist() != ids or not all(torch.equal(x, y) for x, y in zip(s["hidden_states"], want,
                                                                                          strict=True)):
            bad.append(r.sample_ids[i])
    return bad


def test_shared_prefixes_compute_each_prefix_once_and_read_back_as_the_flat_run(tmp_path: Path) -> None:
    """The same chunk through a flat server and through one with its radix cache on: the shared shard stores and
    the server computes the distinct tokens only (prefill counted pass by pass), every sample reads back byte-equal
    to the flat run's, children are sent after their parents, and each family has its own cache key (e's 5 tokens
    in common with a are not a hit)."""
    chunk = family_chunk()
    refs = list(zip(chunk.parents or [], chunk.prefix_lens or [], strict=True))
    (tmp_path / "f").mkdir(mode=0o700)
    (tmp_path / "s").mkdir(mode=0o700)
    flat_srv = FakeServer(tmp_path / "f", AUX).start()
    shared_srv = FakeServer(tmp_path / "s", AUX, radix=True).start()
    try:
        flat = run_chunk(flat_srv, chunk, tmp_path / "flat.hss", share=False)
        shared = run_chunk(shared_srv, chunk, tmp_path / "shared.hss", share=True)
    finally:
        flat_srv.stop()
        shared_srv.stop()
    tokens = sum(map(len, chunk.input_ids))
    distinct = tokens - sum(k for _, k in refs)
    assert flat_srv.prefill_tokens == flat["computed_tokens"] == flat["tokens"] == tokens == 970
    assert shared_srv.prefill_tokens == shared["computed_tokens"] == distinct == 970 - 470
    fr, sr = ShardReader(tmp_path / "flat.hss"), ShardReader(tmp_path / "shared.hss")
    assert (fr.metadata["format_version"], sr.metadata["format_version"]) == (1, 2)
    assert (sr.parents, sr.prefix_lens) == ([p for p, _ in refs], [k for _, k in refs])
    assert sr.stored_tokens == distinct
    for i in range(len(chunk.input_ids)):
        a, b = fr[i], sr[i]
        assert a.keys() == b.keys()
        for key in ("input_ids", "loss_mask"):
            assert torch.equal(a[key], b[key])
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a["hidden_states"], b["hidden_states"],
                                                                          strict=True))
    assert wrong_samples(tmp_path / "shared.hss", chunk) == []
    sent = [r.rsplit("-i", 1)[1].split("-")[0] for r in shared_srv.rids]
    assert sorted(sent) == [str(i) for i in range(7)]  # one request each: no fallback
    for i, (p, _) in enumerate(refs):
        if p >= 0:
            assert sent.index(str(p)) < sent.index(str(i)), f"sample {i} was sent before its parent {p}"
    fam = {str(i): sent_key for i, sent_key in zip(sent, shared_srv.extra_keys, strict=True)}
    assert fam["0"] == fam["2"] == fam["5"] == fam["6"] != fam["1"] == fam["4"] != fam["3"] != fam["0"]
    assert all(k.endswith(f"-f{root}") for k, root in ((fam["0"], 0), (fam["1"], 1), (fam["3"], 3)))
    assert flat_srv.extra_keys == [None] * 7  # a flat run's requests carry no cache key
    assert sorted(x.name for x in (tmp_path / "s").iterdir() if not x.name.startswith(("plugin-", "stats-"))) == []


def test_a_misplaced_row_fails_the_comparison(tmp_path: Path) -> None:
    """The check above can fail: a server that emits the rows after a cache hit as if they started at position 0
    (one pass per prompt, so only the hits are misplaced) gives exactly the children wrong rows."""
    chunk = family_chunk()
    srv = FakeServer(tmp_path, AUX, radix=True, misplace_rows=True, chunk=4096).start()
    try:
        run_chunk(srv, chunk, tmp_path / "shared.hss", share=True)
    finally:
        srv.stop()
    assert wrong_samples(tmp_path / "shared.hss", chunk) == ["s2", "s4", "s5", "s6"]


def test_a_retry_that_hits_its_own_partial_pass_is_computed_again_under_a_fresh_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """b (prefix 20 of a) is aborted after its first pass [20, 52): its retry hits that pass (52 > 20), so it is
    sent again under a fresh cache key and computed whole (the retry's rows from 52 are dropped), stored as a root;
    its child c then takes its 120 rows from b under b's new key. Rows byte-equal to the fake model's; prefill
    counted, the aborted pass included."""
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, 5000, (100,), generator=g).tolist()
    b = a[:20] + torch.randint(0, 5000, (130,), generator=g).tolist()
    c = b[:120] + torch.randint(0, 5000, (40,), generator=g).tolist()
    chunk = ChunkPrompts(["a", "b", "c"], [a, b, c], [[1] * len(x) for x in (a, b, c)], [-1, 0, 1], [0, 20, 120])
    srv = FakeServer(tmp_path, AUX, radix=True, chunk=32, abort_after_first_pass=("-i1-a0",)).start()
    try:
        out = run_chunk(srv, chunk, tmp_path / "shared.hss", share=True)
    finally:
        srv.stop()
    r = ShardReader(tmp_path / "shared.hss")
    assert (r.parents, r.prefix_lens) == ([-1, -1, 1], [0, 0, 120])
    assert wrong_samples(tmp_path / "shared.hss", chunk) == []
    assert out["computed_tokens"] == 100 + 150 + 40
    assert (out["planned_computed_tokens"], out["lost_prefixes"], out["shortened_prefixes"]) == (100 + 130 + 40, 1, 0)
    assert capsys.readouterr().err.endswith(
        "WARNING: shared.hss: of 2 samples that share a prefix, 1 were computed whole and 0 from inside their prefix "
        "(290 tokens computed and stored where prepare planned 270): the server's radix cache no longer held the "
        "whole prefix when the sample ran (evicted for other requests, or cut to its page size): a larger "
        "--mem-fraction-static, or fewer requests in flight, keeps more\n")
    assert srv.prefill_tokens == 100 + 32 + (150 - 52) + 150 + 40  # a, b's aborted pass, its retry from 52, b, c
    tails = [x.rsplit("-i", 1)[1] for x in srv.rids]
    assert tails == ["0-a0", "1-a0", "1-a1", "1-a1-full", "2-a0"]
    keys = srv.extra_keys
    assert keys[0] == keys[1] == keys[2] != keys[3] == keys[4] == srv.rids[3]


def test_the_server_mode_must_match_the_run(tmp_path: Path) -> None:
    """A flat run on a server whose radix cache is on (it would skip rows) and a shared run on a flat server (it
    would compute every row) are both refused before any request."""
    (tmp_path / "f").mkdir(mode=0o700)
    (tmp_path / "s").mkdir(mode=0o700)
    flat_srv = FakeServer(tmp_path / "f", AUX).start()
    shared_srv = FakeServer(tmp_path / "s", AUX, radix=True).start()
    try:
        with pytest.raises(EngineError) as e:
            list(engine(shared_srv).extract(prompts(2)))
        assert str(e.value) == (f"the server at {shared_srv.url} runs with shared prefixes on (HSEXTRACT_SHARED_PREFIX"
                                "=1), this run needs them off (share_prefixes: false; a server started with "
                                "--disable-radix-cache); restart the server with this run's settings")
        with pytest.raises(EngineError) as e:
            list(engine(flat_srv, share_prefixes=True).extract(prompts(2)))
        assert str(e.value) == (f"the server at {flat_srv.url} runs with shared prefixes off, this run needs them on "
                                "(share_prefixes: true; a server started with HSEXTRACT_SHARED_PREFIX=1 and without "
                                "--disable-radix-cache); restart the server with this run's settings")
        assert flat_srv.n_requests == shared_srv.n_requests == 0
    finally:
        flat_srv.stop()
        shared_srv.stop()


def test_families_interleave_to_fill_the_slots(tmp_path: Path) -> None:
    """Eight 5-turn conversations opening with one 70-token declaration, each one's turns together in chunk order,
    references from prepare's find_parents: a conversation's first turn has the chunk's first sample as parent
    (it shares the declaration with every earlier sample alike; ties go to the shallower), whose rows it needs.
    The client sends each prompt once that source is captured and fills the slots from every family's
    frontier, so 4 requests reach the server at once (the pass after the first sample's waits for 4; sending in
    chunk order within a reorder window of 2 x concurrency would offer at most 3)."""
    g = torch.Generator().manual_seed(9)
    decl = torch.randint(0, 5000, (70,), generator=g).tolist()
    ids, records = [], []
    for c in range(8):
        turn = decl + torch.randint(0, 5000, (10,), generator=g).tolist()
        for _ in range(5):
            ids.append(turn)
            records.append(c)
            turn = turn + torch.randint(0, 5000, (30,), generator=g).tolist()
    refs = find_parents(ids, records)
    assert refs[5] == refs[10] == (0, 70) and refs[1] == (0, 80)  # first turns hang from the chunk's first sample
    chunk = ChunkPrompts([f"s{k:02d}" for k in range(40)], ids, [[1] * len(x) for x in ids], [p for p, _ in refs],
                         [k for _, k in refs])
    srv = FakeServer(tmp_path, AUX, radix=True, gather=4, gather_after=1).start()
    try:
        out = run_chunk(srv, chunk, tmp_path / "shared.hss", share=True, concurrency=4)
    finally:
        srv.stop()
    assert srv.max_inflight == 4
    assert out["computed_tokens"] == srv.prefill_tokens == 70 + 8 * (10 + 4 * 30) == sum(map(len, ids)) - sum(
        k for _, k in refs)
    assert wrong_samples(tmp_path / "shared.hss", chunk) == []
    r = ShardReader(tmp_path / "shared.hss")
    assert (r.parents, r.prefix_lens) == ([p for p, _ in refs], [k for _, k in refs])
