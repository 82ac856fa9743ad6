"""The workflow with engine: sglang: the Kimi config's plan, and a whole run against tests/fake_sglang.py.

The fake server answers /generate like SGLang (chunked-prefill passes mixing requests) and writes dump
files with the real plugin code; its hidden states are a known function of (token, position, column), so
the shards are checked value for value. Slow (runs Snakemake).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from fake_sglang import HIDDEN, FakeServer, expected_states
from hsextract.dataset import find_shards
from hsextract.shard import ShardReader
from test_workflow import ROOT, job_counts, make_workdir, smk

pytestmark = pytest.mark.slow

AUX = (1, 5, 7)


def test_kimi_dry_run_builds_the_server_once_and_extracts_every_chunk(tmp_path: Path) -> None:
    wd = make_workdir(tmp_path / "kimi")
    shutil.copytree(ROOT / "tests/fixtures/kimi-k25-config", wd / "kimi-config")
    # the placeholder sources and the hub id are replaced: parse-time checks count records and read the depth
    (wd / "config/local.yaml").write_text(
        "model: kimi-config\nsources:\n  - {path: data/conversations.jsonl, format: messages}\nprompts_per_chunk: 100\n"
    )
    out = smk(wd, "-n", configfiles=("config/kimi.yaml", "config/local.yaml")).stdout
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
    proc = smk(wd, "-n", check=False, configfiles=("config/kimi.yaml", "config/local.yaml", "config/nodump.yaml"))
    assert proc.returncode != 0
    assert "sglang.dump_dir is required with sglang.server_url/servers" in proc.stdout + proc.stderr


def reference_sample(path: Path, hidden: int) -> None:
    ids = torch.arange(5, dtype=torch.int64)
    hs = [torch.ones(5, hidden, dtype=torch.bfloat16) for _ in range(len(AUX) + 1)]
    torch.save({"input_ids": ids, "hidden_states": hs, "loss_mask": torch.ones(5, dtype=torch.int64)}, path)


def test_whole_run_against_a_fake_sglang_server(tmp_path: Path) -> None:
    from hsextract.tinymodel import make_tiny_model

    wd = make_workdir(tmp_path / "sg")
    # a model of the fake server's hidden size (tokenizer and config are what the workflow reads)
    make_tiny_model(wd / "resources/tiny16", wd / "data/conversations.jsonl", hidden_size=HIDDEN,
                    q_lora_rank=16, kv_lora_rank=32, intermediate_size=32, moe_intermediate_size=16)
    reference_sample(wd / "resources/ref16.pt", HIDDEN)
    dump = tmp_path / "dump"
    dump.mkdir()
    srv = FakeServer(dump, AUX, chunk=48).start()
    try:
        (wd / "config/sg.yaml").write_text(
            "run_name: sg-test\nmodel: resources/tiny16\nmake_tiny_model: false\nengine: sglang\n"
            "aux_layers: [1, 5, 7]\nreference_sample: resources/ref16.pt\n"
            "sources:\n  - {path: data/conversations.jsonl, format: messages, max_records: 12}\n"
            "prompts_per_chunk: 6\nmax_seq_len: 256\n"
            f"sglang: {{server_url: '{srv.url}', dump_dir: '{dump}', concurrency: 4, timeout_s: 30, retries: 1}}\n"
        )
        counts = job_counts(smk(wd, "-n", configfiles=("config/sg.yaml",)).stdout)
        assert counts["extract"] == 2 and "build_patched_server" not in counts
        smk(wd, configfiles=("config/sg.yaml",))
    finally:
        srv.stop()
    run = wd / "results/sg-test"
    assert json.loads((run / "dataset.json").read_text())["all_valid"] is True
    shards = find_shards(run)
    assert len(shards) == 2
    n = 0
    for path in shards:
        r = ShardReader(path)
        assert r.metadata["engine"] == "sglang" and "hsextract plugin" in r.metadata["engine_version"]
        for k in range(len(r)):
            s = r[k]
            want = expected_states(s["input_ids"].tolist(), len(AUX) + 1)
            assert all(torch.equal(a, b) for a, b in zip(s["hidden_states"], want, strict=True))
            n += 1
    assert n > 0 and srv.n_requests >= n
    assert not list(dump.glob("*.piece")) and not list(dump.glob("*.done"))  # the client cleaned up
