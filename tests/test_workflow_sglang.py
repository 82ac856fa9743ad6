"""The workflow with engine: sglang: the Kimi config's plan, and a whole run against tests/fake_sglang.py.

The fake server answers /generate like SGLang (chunked-prefill passes mixing requests) and writes dump
files with the real plugin code; its hidden states are a known function of (token, position, column), so
the shards are checked value for value. The whole run's checkpoint is packaged as Kimi-K2.5 ships
(`tinymodel --packaging kimi-k25`), so the fake presents SGLang's KimiK25ForConditionalGeneration and the
plugin's set-up, pre-norm tap and store hook run on that wrapper. Slow (runs Snakemake).
"""

from __future__ import annotations

import json
import math
import shutil
import socket
from pathlib import Path
from typing import NamedTuple

import pyarrow.parquet as pq
import pytest
import torch
from conftest import listen_port
from fake_sglang import HIDDEN, FakeServer, expected_states, sglang_model_for
from test_workflow import ROOT, job_counts, make_workdir, smk

from hsextract.dataset import find_shards
from hsextract.shard import ShardReader

pytestmark = pytest.mark.slow

AUX = (1, 5, 7)


class WholeRun(NamedTuple):
    workdir: Path
    dump: Path
    server: FakeServer
    dry_run_output: str


def test_kimi_dry_run_builds_the_server_once_and_extracts_every_chunk(tmp_path: Path) -> None:
    wd = make_workdir(tmp_path / "kimi")
    shutil.copytree(ROOT / "tests/fixtures/kimi-k25-config", wd / "kimi-config")
    # the placeholder sources and the hub id are replaced: parse-time checks count records and read the depth
    (wd / "config/local.yaml").write_text(
        "model: kimi-config\nsources:\n  - {path: data/conversations.jsonl, format: messages}\nprompts_per_chunk: 100\n"
    )
    out = smk(wd, "-n", "--resources", "gpu=8", configfiles=("config/kimi.yaml", "config/local.yaml")).stdout
    n = math.ceil(sum(1 for _ in open(wd / "data/conversations.jsonl")) / 100)
    counts = job_counts(out)
    assert counts["build_patched_server"] == 1 and counts["extract"] == n == 3
    assert "make_tiny_model" not in counts and "regenerate_chunk" not in counts
    # every extract job takes the build marker as input
    extract_jobs = out.split("rule extract:")[1:]
    assert len(extract_jobs) == n
    assert all("results/kimi-k25/server/patched.json" in j.split("output:")[0] for j in extract_jobs)

    # an external server: nothing to build
    (wd / "config/ext.yaml").write_text("sglang: {server_url: 'http://10.0.0.5:30000', dump_dir: /shared/dump}\n")
    counts = job_counts(smk(wd, "-n", configfiles=("config/kimi.yaml", "config/local.yaml", "config/ext.yaml")).stdout)
    assert "build_patched_server" not in counts and counts["extract"] == n

    # server_url without dump_dir stops at parse time and says what to set
    (wd / "config/nodump.yaml").write_text("sglang: {server_url: 'http://10.0.0.5:30000'}\n")
    proc = smk(wd, "-n", "--resources", "gpu=8", check=False,
               configfiles=("config/kimi.yaml", "config/local.yaml", "config/nodump.yaml"))
    assert proc.returncode != 0
    assert "sglang.dump_dir is required with sglang.server_url/servers" in proc.stdout + proc.stderr


def reference_sample(path: Path, hidden: int) -> None:
    ids = torch.arange(5, dtype=torch.int64)
    hs = [torch.ones(5, hidden, dtype=torch.bfloat16) for _ in range(len(AUX) + 1)]
    torch.save({"input_ids": ids, "hidden_states": hs, "loss_mask": torch.ones(5, dtype=torch.int64)}, path)


def sg_workdir(tmp_path: Path, sglang_yaml: str, records: int, per_chunk: int, packaging: str = "text",
               share: bool = False) -> Path:
    """A workdir with a tiny model of the fake server's hidden size and a config for engine: sglang;
    packaging kimi-k25: the model packaged as Kimi-K2.5 ships (with its tokenizer packaging); `share`: the
    config's share_prefixes (off: the fake servers these tests start run flat, --disable-radix-cache)."""
    from hsextract.tinymodel.build import make_tiny_model

    wd = make_workdir(tmp_path / "sg")
    # a model of the fake server's hidden size (tokenizer and config are what the workflow reads)
    kimi = {"tokenizer": "kimi", "packaging": "kimi-k25"} if packaging == "kimi-k25" else {}
    make_tiny_model(wd / "resources/tiny16", wd / "data/conversations.jsonl", hidden_size=HIDDEN,
                    q_lora_rank=16, kv_lora_rank=32, intermediate_size=32, moe_intermediate_size=16, **kimi)
    reference_sample(wd / "resources/ref16.pt", HIDDEN)
    (wd / "config/sg.yaml").write_text(
        "run_name: sg-test\nmodel: resources/tiny16\nmake_tiny_model: false\nengine: sglang\n"
        "capture: custom\naux_layers: [1, 5, 7]\naux_layers_convention: hidden_states\n"
        "reference_sample: resources/ref16.pt\n"
        f"sources:\n  - {{path: data/conversations.jsonl, format: messages, max_records: {records}}}\n"
        f"prompts_per_chunk: {per_chunk}\nmax_seq_len: 256\nshare_prefixes: {str(share).lower()}\n" + sglang_yaml
    )
    return wd


def run_whole(tmp: Path) -> WholeRun:
    """The whole run against one fake server (its dry run, then the run); SCENARIOS: in the background from
    the module's first test on, so the other tests of the module overlap it."""
    dump = tmp / "dump"
    dump.mkdir(mode=0o700)  # private, as the client requires of a dump directory
    wd = sg_workdir(tmp, "", records=12, per_chunk=6, packaging="kimi-k25")
    # SGLang serves this checkpoint as KimiK25ForConditionalGeneration: the fake presents that object
    srv = FakeServer(dump, AUX, chunk=48, final_state="pre_norm", model=sglang_model_for(wd / "resources/tiny16"))
    srv.start()
    try:
        with open(wd / "config/sg.yaml", "a") as f:
            f.write(f"sglang: {{server_url: '{srv.url}', dump_dir: '{dump}', concurrency: 4, timeout_s: 30, "
                    "retries: 1}\n")
        dry = smk(wd, "-n", configfiles=("config/sg.yaml",)).stdout
        smk(wd, configfiles=("config/sg.yaml",))
    finally:
        srv.stop()
    return WholeRun(wd, dump, srv, dry)


def test_two_servers_share_the_chunks_and_a_failed_chunk_reruns_alone(tmp_path: Path) -> None:
    """Issue 8: `sglang.servers` spreads chunks across servers (chunk % n); a chunk whose server is down
    fails alone (--keep-going) and a plain rerun, once the server is back, redoes only that chunk."""
    dump = tmp_path / "dump"
    dump.mkdir(mode=0o700)  # private, as the client requires of a dump directory
    a = FakeServer(dump, AUX, chunk=48, final_state="pre_norm").start()
    b = FakeServer(dump, AUX, chunk=48, final_state="pre_norm").start()
    b_port = b.port
    b.stop()  # server B is down for the first run
    b2 = None
    try:
        wd = sg_workdir(tmp_path, f"sglang: {{servers: ['{a.url}', '{b.url}'], dump_dir: '{dump}', "
                                  "concurrency: 2, timeout_s: 20, retries: 1, backoff_s: 0.1}\n",
                        records=12, per_chunk=3)  # 4 chunks: 0, 2 -> A; 1, 3 -> B
        first = smk(wd, "--keep-going", check=False, configfiles=("config/sg.yaml",))
        assert first.returncode != 0
        shards = wd / "results/sg-test/shards"
        done = sorted(p.name for p in shards.glob("chunk-*.hss"))
        rows = [pq.read_metadata(wd / f"results/sg-test/prompts/chunk-{c:05d}.parquet").num_rows for c in range(4)]
        failed = [c for c in range(4) if c % 2 == 1 and rows[c] > 0]  # B's chunks (an empty one needs no server)
        assert failed and done == [f"chunk-{c:05d}.hss" for c in range(4) if c not in failed]
        assert not list(shards.glob(".*tmp"))  # no partial shard
        served_by_a = a.n_requests
        assert served_by_a > 0
        mtimes = {n: (shards / n).stat().st_mtime_ns for n in done}
        b2 = FakeServer(dump, AUX, port=b_port, chunk=48, final_state="pre_norm").start()  # B is back on its address
        plan = job_counts(smk(wd, "-n", configfiles=("config/sg.yaml",)).stdout)
        assert plan["extract"] == len(failed)  # B's failed chunks only
        smk(wd, configfiles=("config/sg.yaml",))
        assert {n: (shards / n).stat().st_mtime_ns for n in done} == mtimes  # untouched
        assert b2.n_requests > 0 and a.n_requests == served_by_a  # the rerun went to B alone
        assert json.loads((wd / "results/sg-test/dataset.json").read_text())["all_valid"] is True
    finally:
        a.stop()
        if b2 is not None:
            b2.stop()


def test_whole_run_against_a_fake_sglang_server(scenario: WholeRun) -> None:
    wd, dump, srv, dry = scenario
    counts = job_counts(dry)
    assert counts["extract"] == 2 and "build_patched_server" not in counts
    # the plugin set the capture up on the wrapper: through its delegating setter, in its text model's decoder
    assert type(srv.model).__name__ == "FakeKimiK25" and srv.passes > 0
    assert srv.model.language_model.model.layers_to_capture == list(AUX)
    run = wd / "results/sg-test"
    assert json.loads((run / "dataset.json").read_text())["all_valid"] is True
    shards = find_shards(run)
    assert len(shards) == 2
    n = 0
    for path in shards:
        r = ShardReader(path)
        assert r.metadata["engine"] == "sglang" and "hsextract plugin" in r.metadata["engine_version"]
        assert r.metadata["final_state"] == "pre_norm"  # the default; the fake server runs that capture
        assert r.metadata["final_norm"]["source"].endswith(":language_model.model.norm.weight")
        for k in range(len(r)):
            s = r[k]
            want = expected_states(s["input_ids"].tolist(), len(AUX) + 1)
            assert all(torch.equal(a, b) for a, b in zip(s["hidden_states"], want, strict=True))
            n += 1
    assert n > 0 and srv.n_requests >= n
    assert not list(dump.glob("*.piece")) and not list(dump.glob("*.done"))  # the client cleaned up


def test_share_prefixes_whole_run_against_a_fake_sglang_server(tmp_path: Path) -> None:
    """share_prefixes with engine: sglang through the workflow, against a fake server with its radix
    cache on: records opening with one long system prompt share it within their chunk; the server computes the
    distinct tokens only, the version-2 shards read back value for value, and the dataset validates."""
    dump = tmp_path / "dump"
    dump.mkdir(mode=0o700)
    wd = sg_workdir(tmp_path, "", records=12, per_chunk=6, share=True)
    system = {"role": "system", "content": " ".join(f"Rule {k}: answer briefly and check the units." for k in range(6))}
    with open(wd / "data/conversations.jsonl", "w") as f:
        for c in range(12):
            f.write(json.dumps({"messages": [system, {"role": "user", "content": f"What is {c} plus {c}?"},
                                             {"role": "assistant", "content": f"It is {2 * c}."}]}) + "\n")
    srv = FakeServer(dump, AUX, chunk=48, final_state="pre_norm", radix=True).start()
    try:
        with open(wd / "config/sg.yaml", "a") as f:
            f.write(f"sglang: {{server_url: '{srv.url}', dump_dir: '{dump}', concurrency: 4, "
                    "timeout_s: 30, retries: 1}\n")
        smk(wd, configfiles=("config/sg.yaml",))
    finally:
        srv.stop()
    run = wd / "results/sg-test"
    assert json.loads((run / "dataset.json").read_text())["all_valid"] is True
    tokens = stored = refs = 0
    for path in find_shards(run):
        r = ShardReader(path)
        refs += sum(p >= 0 for p in r.parents)
        stored += r.stored_tokens
        for k in range(len(r)):
            s = r[k]
            tokens += len(s["input_ids"])
            want = expected_states(s["input_ids"].tolist(), len(AUX) + 1)
            assert all(torch.equal(a, b) for a, b in zip(s["hidden_states"], want, strict=True))
    assert refs == 10  # two chunks of six records: each chunk's first one is the root
    assert srv.prefill_tokens == stored < 0.7 * tokens


def test_a_workflow_started_server_requires_its_key_and_no_file_holds_it(tmp_path: Path) -> None:
    """Issue 36, through the workflow: the extraction jobs start the (fake) server themselves, with the key of
    `sglang.api_key_file` in a 0600 file (SGLang's --config), never on its command line; a request without the
    key is refused; and no byte the run wrote (dataset.json, patched.json, shards, logs, Snakemake's own files)
    nor `snakemake --report`'s report.html (Snakemake reads the config files' text for it) holds the key. A key in a
    config file is refused at parse time, unprinted. `--no-hooks` keeps the server up after the run (onsuccess
    would stop it) to knock on its door."""
    import base64
    import re
    import secrets

    from test_server_door import INLINE_KEY, cmdline, fake_server_python, request

    from hsextract.config.redaction import REDACTED
    from hsextract.sglang import server as hsrv

    key = f"hsx-wf-{secrets.token_hex(16)}"
    key_file = tmp_path / "secret/api-key"  # outside the workdir: every file in it is searched for the key
    key_file.parent.mkdir()
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    wrapper = fake_server_python(tmp_path)
    wd = sg_workdir(tmp_path, f"sglang: {{python: '{wrapper}', port: {listen_port(4)}, api_key_file: '{key_file}', "
                              "concurrency: 4, timeout_s: 30, retries: 1, startup_timeout_s: 120}\n",
                    records=12, per_chunk=6)
    sg = wd / "config/sg.yaml"
    if "aux_layers_convention" not in sg.read_text():  # the ids are hidden_states ids, as the fake's marker says
        sg.write_text(sg.read_text() + "capture: custom\naux_layers_convention: hidden_states\n")
    # this host's servers' state (one folder per host: hsextract.sglang.config.state_dir)
    state = wd / "results/sg-test/server/hosts" / socket.gethostname()
    # the server's environment needs no build here: patched.json as rule build_patched_server writes it
    state.mkdir(parents=True)
    (state.parent.parent / "patched.json").write_text(json.dumps({"python": str(wrapper)}))
    # the key itself in a config file (whose text the report would show): refused before any job, unprinted
    (tmp_path / "inline.yaml").write_text(f"sglang: {{api_key: '{key}'}}\n")
    out = smk(wd, "-n", check=False, configfiles=("config/sg.yaml", str(tmp_path / "inline.yaml")))
    assert out.returncode != 0 and INLINE_KEY in out.stdout + out.stderr and key not in out.stdout + out.stderr
    key_file.chmod(0o640)
    out = smk(wd, "-n", check=False, configfiles=("config/sg.yaml",))
    assert out.returncode != 0 and (f"sglang.api_key_file: {key_file} has mode 0640: other users can read or change "
                                    f"the key; run `chmod 600 {key_file}`") in out.stdout + out.stderr
    key_file.chmod(0o600)
    try:
        plan = job_counts(smk(wd, "-n", configfiles=("config/sg.yaml",)).stdout)
        assert "build_patched_server" not in plan and plan["extract"] == 2
        smk(wd, "--no-hooks", configfiles=("config/sg.yaml",))
        h = hsrv.ServerHandle.from_json((state / "replica-0.json").read_text())
        assert hsrv._alive(h.pid) and key.encode() not in cmdline(h.pid)
        assert cmdline(h.pid).split(b"\0")[-3:-1] == [b"--config", str(state.absolute() / "private/replica-0.yaml")
                                                       .encode()]
        assert request(h.url, "POST", "/generate", None) == 401
        assert request(h.url, "POST", "/generate", key[:-1]) == 401
        assert request(h.url, "POST", "/generate", key) != 401  # the key of the file
    finally:
        hsrv.stop_servers(state, grace_s=5)
    smk(wd, "--report", "report.html", configfiles=("config/sg.yaml",))
    dataset = json.loads((wd / "results/sg-test/dataset.json").read_text())
    assert dataset["all_valid"] is True and dataset["provenance"]["config"]["sglang"]["api_key_file"] == str(key_file)
    assert "api_key" not in dataset["provenance"]["config"]["sglang"]
    log = (state / "replica-0.log").read_text()
    assert f"api_key='{REDACTED}'" in log  # the server printed its settings, key hidden on its way to the log
    # report.html: no key, in its text (each result's params too) nor in the results it embeds (base64), of
    # which dataset.json and its config (the key file's name). Snakemake 9.27's HTML reporter renders no config
    # file, but it reads each one's text for report plugins (ConfigfileRecord): none holds the key either
    html = (wd / "report.html").read_bytes()
    assert b"hsextract run <strong>sg-test</strong>" in html and b'"params": "lock=' in html
    embedded = [base64.b64decode(u) for u in re.findall(rb"base64,([A-Za-z0-9+/=]+)", html)]
    assert [b for b in embedded if b'"api_key_file": ' + json.dumps(str(key_file)).encode() in b]
    assert len(embedded) > 5 and all(key.encode() not in b for b in embedded)
    assert all(key.encode() not in f.read_bytes() for f in (sg, wd / "config/config.yaml"))
    written = [f for f in wd.rglob("*") if f.is_file() and not f.is_symlink()]
    assert wd / "report.html" in written and any(".snakemake" in f.parts for f in written)
    assert len(written) > 30 and not (state / "private/replica-0.yaml").exists()
    assert [f for f in written if key.encode() in f.read_bytes()] == []


def test_two_local_replicas_run_two_extract_jobs_at_once(tmp_path: Path) -> None:
    """`sglang.replicas: 2` of tp 1 on one machine: an extract job asks for one replica's GPU (the dry run's
    resources) and the pool gpu=2 runs two at once, each claiming a replica of its own (the lowest free one; the
    claims: tests/test_replica_claims.py) and saying which. Shown without timing: the test holds both replicas'
    claims when the run starts, so every extract job waits; two jobs saying so at once are two jobs running at
    once. Released, the run finishes on the two (fake) servers it starts. A pool of one GPU runs one job at a time
    and the run says so; under a cluster executor two replicas are refused (tests/test_gpu_pool.py)."""
    import os
    import re
    import subprocess
    import time

    from test_server_door import fake_server_python
    from test_workflow import snakemake_cmd

    from hsextract.sglang import server as hsrv

    port = listen_port(5)
    wrapper = fake_server_python(tmp_path)
    wd = sg_workdir(tmp_path, f"sglang: {{python: '{wrapper}', port: {port}, replicas: 2, concurrency: 4, "
                              "timeout_s: 30, retries: 1, startup_timeout_s: 120}\nextract: {threads: 1}\n",
                    records=12, per_chunk=3)
    state = wd / "results/sg-test/server/hosts" / socket.gethostname()  # this host's servers
    state.mkdir(parents=True)
    (state.parent.parent / "patched.json").write_text(json.dumps({"python": str(wrapper)}))  # as the build writes it
    dry = smk(wd, "-n", "--resources", "gpu=2", configfiles=("config/sg.yaml",))
    jobs = dry.stdout.split("rule extract:")[1:]
    assert len(jobs) == 4 and all(re.search(r"resources: .*\bgpu=1\b", j) for j in jobs)
    assert "GPU pool" not in dry.stderr
    one = smk(wd, "-n", configfiles=("config/sg.yaml",))  # profiles/default's pool: gpu=1
    assert ("GPU pool gpu=1: 1 of the 2 sglang replicas (1 GPU each) extract at once; --resources gpu=2 runs them "
            "all") in one.stderr
    held = [hsrv.claim_replica(state, 2, chunk=-1) for _ in range(2)]
    assert [c.replica for c in held] == [0, 1]
    logs = wd / "logs/sg-test/extract"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    argv = [*snakemake_cmd(), "--resources", "gpu=2", "--cores", "2", "--configfile", "config/sg.yaml"]
    out = tmp_path / "snakemake.out"  # a file, not a pipe: nothing blocks Snakemake while the test waits
    proc = subprocess.Popen(argv, cwd=wd, env=env, stdout=out.open("w"), stderr=subprocess.STDOUT)
    try:
        def waiting() -> list[str]:
            return sorted(f.name for f in logs.glob("chunk-*.log") if "waiting for one" in f.read_text())

        deadline = time.monotonic() + 600  # the event: two jobs' logs say they wait; the bound is for a hang
        while len(waiting()) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(waiting()) == 2, (waiting(), proc.poll(), out.read_text()[-4000:])
        for c in held:
            c.release()
        assert proc.wait(timeout=900) == 0, out.read_text()[-4000:]
    finally:
        proc.kill()
        hsrv.stop_servers(state, grace_s=5)
    used = {}
    for c in range(4):
        log = (logs / f"chunk-{c:05d}.log").read_text()
        said = re.findall(rf"chunk {c}: sglang replica (\d) of 2 at http://127.0.0.1:(\d+)", log)
        assert len(said) == 1, log
        used[c] = int(said[0][0])
        assert int(said[0][1]) == port + used[c]
    for r in set(used.values()):  # each replica a job drove was started by the workflow and served
        assert "starting:" in (state / f"replica-{r}.log").read_text()
    assert json.loads((wd / "results/sg-test/dataset.json").read_text())["all_valid"] is True


SCENARIOS = {"test_whole_run_against_a_fake_sglang_server": run_whole}
