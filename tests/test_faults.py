"""Fault injection (issue 7): each fault is tried, and what survives is asserted exactly.

Fast tests: disk full during a shard write, byte flips and truncations caught by validate, server
faults the sglang client tests do not already cover, schema violations, security properties.
Slow tests (one small workflow, 3 chunks): SIGKILL of the whole Snakemake process group during
extraction, 3 times at seeded random moments, then the same command (the killed run's lock removed
by the next parse, no --unlock); disk full inside a real extract job. tests/README.md lists every
fault with its figures and where else it is tested.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import yaml
from conftest import finish_run, make_sample, selected_tests_use, shard_metadata

from hsextract.errors import EngineError
from hsextract.report.validate import failure_line, validate_shard
from hsextract.shard import SHARD_SUFFIX, ShardReader, ShardWriter

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def tmp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def write_shard(path: Path, samples: list, prefix: str = "s", **meta) -> Path:
    with ShardWriter(path, shard_metadata(**meta)) as w:
        for k, (ids, hs, mask) in enumerate(samples):
            w.add(ids, hs, mask, sample_id=f"{prefix}{k}")
    return path


def sample_digests(shard: Path) -> dict[str, str]:
    """sample id -> sha256 over the decoded sample's bytes (ids, mask, every hidden tensor)."""
    r = ShardReader(shard)
    out = {}
    for k, sid in enumerate(r.sample_ids):
        s = r[k]
        h = hashlib.sha256()
        for t in (s["input_ids"], s["loss_mask"], *s["hidden_states"]):
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        out[sid] = h.hexdigest()
    r.close()
    return out


# ---- 3. disk full during a shard write ---------------------------------------------------------------
FSIZE_SCRIPT = textwrap.dedent("""
    import json, resource, signal, sys
    sys.path.insert(0, sys.argv[2])
    from conftest import make_sample, shard_metadata
    from hsextract.errors import ShardError
    from hsextract.shard import ShardWriter
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    for limit in map(int, sys.argv[3:]):
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            with ShardWriter(f"{sys.argv[1]}/chunk-00001.hss", shard_metadata(hidden_size=256)) as w:
                for k in range(40):
                    w.add(*make_sample(50, hidden=256, seed=k), sample_id=f"b{k}")
            print(json.dumps({"limit": limit, "error": None}))
        except ShardError as e:
            print(json.dumps({"limit": limit, "error": str(e), "type": type(e).__name__}))
""")
FSIZE_LIMITS = (300, 20_000, 200_000)  # in the header, after a few samples, later


def test_disk_full_fails_with_a_message_and_leaves_nothing(tmp_path: Path) -> None:
    earlier = write_shard(tmp_path / "chunk-00000.hss", [make_sample(50, hidden=256, seed=k) for k in range(3)],
                          hidden_size=256)
    before = (earlier.read_bytes(), earlier.stat().st_mtime_ns)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path), str(TESTS), *map(str, FSIZE_LIMITS)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["limit"] for r in results] == list(FSIZE_LIMITS)
    target = tmp_path / "chunk-00001.hss"
    for got in results:
        assert got.get("type") == "ShardError", got
        assert re.fullmatch(
            rf"{re.escape(str(target))}: writing failed after \d+ samples \(File too large\); no shard was left "
            rf"behind\. Free space in {re.escape(str(tmp_path))} \(or fix the error\) and rerun the chunk\.",
            got["error"]), got["error"]
    assert {r["error"].split(" after ")[1].split(" ")[0] for r in results} != {"0"}  # not only in the header
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunk-00000.hss"]  # no shard, no temp
    assert (earlier.read_bytes(), earlier.stat().st_mtime_ns) == before
    ids, hs, mask = make_sample(2, hidden=256)
    assert validate_shard(earlier, {"input_ids": ids, "hidden_states": hs, "loss_mask": mask})["passed"]


def test_a_disk_too_small_for_the_shard_is_refused_before_the_server_starts(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """shard.check_free_space: the job estimates its shard as `hsextract plan` does and stops before the engine
    (the server's start, the prefill) when the disk cannot hold it; false goes on to the engine."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import hsextract.extract.run as run
    from hsextract.config.settings import from_config
    from hsextract.errors import ShardError

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 7168, "num_hidden_layers": 61,
                                                                   "vocab_size": 163840}}))
    prompts = tmp_path / "chunk-00003.parquet"
    # three samples of 1,000 tokens, the third taking 600 of them from the second (not computed, not stored)
    pq.write_table(pa.table({"sample_id": ["a", "b", "c"], "input_ids": [[1] * 1000] * 3,
                             "loss_mask": [[1] * 1000] * 3, "parent": [-1, -1, 1], "prefix_len": [0, 0, 600]}),
                   prompts)
    config = {"model": str(model), "make_tiny_model": False, "engine": "sglang", "capture": "custom",
              "aux_layers": [2, 30, 58], "aux_layers_convention": "hidden_states"}
    shard = tmp_path / "shards/chunk-00003.hss"
    # 2,400 tokens computed x (16 + 4 x 7168 x 2) B + 600 x 16 B, x 0.6965 = 95,889,663 B (ceil)
    need = math.ceil((2400 * (16 + 4 * 7168 * 2) + 600 * 16) * Fraction("0.6965"))
    assert run.shard_estimate(run.read_prompts(prompts), 7168, 4, "bf16")[0] == need == 95_889_663
    monkeypatch.setattr(run.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**12, 10**12 - need + 1,
                                                                                      need - 1))

    def engine(*_):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(run, "build_engine", engine)
    with pytest.raises(ShardError) as e:
        run.run_extract(from_config(config).extract, prompts, shard, chunk=3)
    assert str(e.value) == (
        f"{shard.parent}: 0.096 GB free, but chunk 3's shard will take about 0.096 GB (2,400 tokens computed x "
        "57,360 B raw x codec ratio 0.6965, as hsextract plan reckons): free space there (or move results/ to a "
        "larger disk), or lower prompts_per_chunk; shard.check_free_space: false starts anyway (a full disk then "
        "fails the chunk alone, which reruns)")
    assert list(shard.parent.iterdir()) == []
    monkeypatch.setattr(run.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**12, 10**12 - need, need))
    with pytest.raises(AssertionError, match="the engine was built"):  # exactly enough: on to the engine
        run.run_extract(from_config(config).extract, prompts, shard, chunk=3)
    monkeypatch.setattr(run.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**12, 10**12, 0))
    with pytest.raises(AssertionError, match="the engine was built"):
        run.run_extract(from_config({**config, "shard": {"check_free_space": False}}).extract, prompts, shard, chunk=3)


def test_a_prompts_file_that_is_not_the_one_prepare_wrote_is_refused_before_the_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bit flipped in a compressed parquet page can still read cleanly, as other token ids: extract compares the
    file with the sha256 prepare recorded in summary.json (per_chunk) before anything is computed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import hsextract.extract.run as run
    from hsextract.config.settings import from_config
    from hsextract.errors import ShardError
    from hsextract.provenance import sha256_file

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 100}))
    prompts = tmp_path / "chunk-00001.parquet"
    pq.write_table(pa.table({"sample_id": ["a"], "input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]]}), prompts)
    summary = tmp_path / "summary.json"
    config = from_config({"model": str(model), "make_tiny_model": False, "capture": "mtp"}).extract

    def engine(*_):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(run, "build_engine", engine)
    written = sha256_file(prompts)
    same = [{"chunk": 0, "sha256": "0" * 64}, {"chunk": 1, "sha256": written}]
    for per_chunk in ([], [{"chunk": 1, "rows": 1}], same):
        summary.write_text(json.dumps({"per_chunk": per_chunk}))  # before prepare recorded it, or the same file
        with pytest.raises(AssertionError, match="the engine was built"):
            run.run_extract(config, prompts, tmp_path / "s.hss", chunk=1, prepare_summary=summary)
    pq.write_table(pa.table({"sample_id": ["a"], "input_ids": [[1, 2, 4]], "loss_mask": [[0, 1, 1]]}), prompts)
    with pytest.raises(ShardError) as e:
        run.run_extract(config, prompts, tmp_path / "s.hss", chunk=1, prepare_summary=summary)
    assert str(e.value) == (
        f"{prompts}: its sha256 is {sha256_file(prompts)}, but prepare wrote chunk 1's prompts with sha256 {written} "
        f"({summary}): the file was damaged or changed after prepare, and would be extracted as other tokens. Restore "
        "it (`cp -p` from a copy), or delete it and run the same command: prepare writes every chunk's prompts "
        "again, and every chunk is then extracted again")


# ---- 4. corruption: random byte flips and truncations, each reported by validate --------------------
N_SHARDS, N_SAMPLES, FLIPS_PER_SHARD, CUTS_PER_SHARD = 3, 5, 70, 8


@pytest.fixture
def ref16() -> dict:
    ids, hs, mask = make_sample(5, seed=99)
    return {"input_ids": ids, "hidden_states": hs, "loss_mask": mask}


def cut_sample(offsets: list[int], lens: list[int], end: int) -> int | None:
    """The sample whose record a cut at byte `end` falls inside; None for a cut between records or past the last
    (how many samples followed is in the lost footer)."""
    return next((k for k, (o, n) in enumerate(zip(offsets, lens, strict=True)) if o < end < o + n), None)


def test_random_flips_and_truncations_are_all_reported(tmp_path: Path, ref16: dict) -> None:
    rng = random.Random(2024)
    bad = tmp_path / "bad" / "chunk-00000.hss"
    bad.parent.mkdir()
    tally = {"flips": 0, "flips_in_a_sample": 0, "flips_in_structure": 0, "cuts": 0, "accepted": 0}
    for s in range(N_SHARDS):
        samples = [make_sample(rng.randrange(4, 40), seed=100 * s + k) for k in range(N_SAMPLES)]
        good_path = write_shard(tmp_path / f"chunk-{s:05d}.hss", samples, prefix=f"c{s}-")
        assert validate_shard(good_path, ref16)["passed"]
        good = good_path.read_bytes()
        r = ShardReader(good_path)
        offs, lens = r.index["offsets"], r.index["record_lens"]
        r.close()
        for _ in range(FLIPS_PER_SHARD):
            pos = rng.randrange(len(good))
            data = bytearray(good)
            data[pos] ^= 1 << rng.randrange(8)
            bad.write_bytes(bytes(data))
            rep = validate_shard(bad, ref16)
            tally["flips"] += 1
            tally["accepted"] += rep["passed"]
            assert not rep["passed"], pos
            line = failure_line(rep)
            assert line.startswith(f"{bad}: "), line
            hit = next((k for k, o in enumerate(offs) if o <= pos < o + lens[k]), None)
            first = rep["first_failure"]
            if hit is not None:  # inside sample `hit`'s record: that sample, and only it, fails
                tally["flips_in_a_sample"] += 1
                assert (first["check"], first["sample"], first["sample_id"]) == ("checksum", hit, f"c{s}-{hit}"), line
                assert f"sample {hit} (id c{s}-{hit}): check checksum failed" in line
                assert rep["checks"]["checksum"]["failed"] == 1 and rep["num_samples"] == N_SAMPLES
            else:  # header, index or footer: the shard does not open, the report says so
                tally["flips_in_structure"] += 1
                assert first["check"] == "integrity" and rep["num_samples"] is None, line
        for _ in range(CUTS_PER_SHARD):
            end = rng.randrange(len(good))
            bad.write_bytes(good[:end])
            rep = validate_shard(bad, ref16)
            tally["cuts"] += 1
            tally["accepted"] += rep["passed"]
            assert not rep["passed"], end
            first = rep["first_failure"]
            line = failure_line(rep)
            assert line.startswith(f"{bad}: ") and "truncated" in line, line
            assert first["check"] == "integrity" and first["sample"] == cut_sample(offs, lens, end), line
    assert tally["flips"] >= 200 and tally["cuts"] >= 20 and tally["accepted"] == 0
    assert tally["flips_in_a_sample"] > 150 and tally["flips_in_structure"] > 0  # both kinds were hit
    print("corruption tally:", json.dumps(tally))


# ---- 5. server faults the client tests do not cover: misattributed dumps, death mid-chunk -----------
sys.path.insert(0, str(TESTS))
from fake_sglang import HIDDEN, FakeServer, _Req, expected_states  # noqa: E402 - importable once TESTS is on sys.path

AUX = (1, 3, 5)


class SwappingServer(FakeServer):
    """Writes the first `swaps` passes that hold >= 2 requests under each other's rids (misattribution)."""

    def __init__(self, *a, swaps: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.swaps_left = swaps
        self.swapped = 0

    def _run_pass(self, parts: list) -> None:
        if self.swaps_left > 0 and len(parts) >= 2:
            self.swaps_left -= 1
            self.swapped += 1
            (a, pa, ea), (b, pb, eb) = parts[0], parts[1]
            # each request's own tokens, the other one's rid: what a rid mix-up in a server would dump
            parts = [(_Req(b.rid, a.origin_input_ids), pa, ea), (_Req(a.rid, b.origin_input_ids), pb, eb), *parts[2:]]
            super()._run_pass(parts)
            for (r, _, _), orig in zip(parts[:2], (a, b), strict=True):
                orig.progress = r.progress
            return
        super()._run_pass(parts)


def prompts(n: int, seed: int) -> list:
    from hsextract.engines.base import Prompt

    g = torch.Generator().manual_seed(seed)
    return [Prompt(i, f"s{i:03d}", torch.randint(0, 5000, (int(L),), generator=g).tolist())
            for i, L in enumerate(torch.randint(4, 60, (n,), generator=g))]


def sglang_engine(srv: FakeServer, **kw):
    from hsextract.engines.base import CaptureSpec
    from hsextract.sglang.client import SGLangEngine

    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("backoff_s", 0.01)
    return SGLangEngine(srv.url, CaptureSpec(aux_layers=AUX, final_state="post_norm"), srv.dumper.cfg.dump_dir, **kw)


def dump_dir(tmp_path: Path) -> Path:
    d = tmp_path / "dump"
    d.mkdir(mode=0o700)
    return d


def fake_meta() -> dict:
    return shard_metadata(aux_layers=list(AUX), hidden_size=HIDDEN, engine="sglang")


def test_misattributed_dumps_are_rejected_and_retried(tmp_path: Path) -> None:
    from hsextract.extract.run import ChunkPrompts, extract_chunk

    srv = SwappingServer(dump_dir(tmp_path), AUX, swaps=2, pass_delay_s=0.05).start()
    try:
        ps = prompts(12, seed=11)
        shard = tmp_path / "chunk-00000.hss"
        cp = ChunkPrompts([p.sample_id for p in ps], [p.input_ids for p in ps], [[1] * len(p.input_ids) for p in ps])
        extract_chunk(cp, shard, sglang_engine(srv, concurrency=6, retries=3), fake_meta(), progress=False)
        assert srv.swapped == 2 and srv.n_requests >= 12 + 2  # the swapped requests were asked again
        r = ShardReader(shard)
        assert r.sample_ids == [p.sample_id for p in ps]
        for k, p in enumerate(ps):  # every sample holds its own states, none another's
            assert r[k]["input_ids"].tolist() == p.input_ids
            assert all(torch.equal(g, w)
                       for g, w in zip(r[k]["hidden_states"], expected_states(p.input_ids, 4), strict=True))
    finally:
        srv.stop()


def test_misattribution_without_retries_fails_the_chunk_without_a_shard(tmp_path: Path) -> None:
    # (with retries, a retried request travels alone in a pass, cannot be swapped and succeeds)
    from hsextract.extract.run import ChunkPrompts, extract_chunk

    # all 4 requests in the first pass, in index order: s000 and s001 are the swapped pair (on a loaded CI
    # box they once arrived apart, s001 and s002 were swapped and s001's marker never came)
    srv = SwappingServer(dump_dir(tmp_path), AUX, swaps=10**6, pass_delay_s=0.05, gather=4).start()
    try:
        ps = prompts(4, seed=12)
        cp = ChunkPrompts([p.sample_id for p in ps], [p.input_ids for p in ps], [[1] * len(p.input_ids) for p in ps])
        with pytest.raises(EngineError) as e:
            # timeout 10 s, not 2: on a loaded CI box the writer can take longer than 2 s, and the expected
            # error (the mix-up) must win over a dump timeout
            extract_chunk(cp, tmp_path / "chunk-00000.hss",
                          sglang_engine(srv, concurrency=4, retries=0, timeout_s=10.0), fake_meta(), progress=False)
        assert re.fullmatch(
            r"sample 's00[01]' \(index [01]\): failed once "
            r"although the server at http://127\.0\.0\.1:\d+ is healthy; "
            r"last error: request hsx-\S+: (the server dumped \d+ tokens, the prompt has \d+; a rid was reused or the "
            r"server tokenized differently|the token ids the server saw differ from the prompt's "
            r"\(sha256 mismatch\))\. "
            r"The chunk fails, no shard is written\.", str(e.value)), str(e.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]  # no shard, no temp
    finally:
        srv.stop()


def test_server_dying_mid_chunk_leaves_no_shard(tmp_path: Path) -> None:
    from hsextract.extract.run import ChunkPrompts, extract_chunk

    srv = FakeServer(dump_dir(tmp_path), AUX, die_after=6).start()
    ps = prompts(20, seed=13)
    cp = ChunkPrompts([p.sample_id for p in ps], [p.input_ids for p in ps], [[1] * len(p.input_ids) for p in ps])
    with pytest.raises(EngineError, match=r"is down .*no shard is written"):  # the health check, not retries x timeout
        extract_chunk(cp, tmp_path / "chunk-00000.hss", sglang_engine(srv, concurrency=2, timeout_s=30, retries=5),
                      fake_meta(), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]  # the samples before the death were not kept


# ---- 6. bad config: every kind of schema violation names the key and what is allowed ---------------
SCHEMA = ROOT / "workflow/schemas/config.schema.yaml"
SCHEMA_CASES = {
    # kind: (key path, bad value, the one-line message (without the schema's path) a user sees first)
    "type": ("prompts_per_chunk", "8", "prompts_per_chunk: '8' is not of type 'integer'"),
    # JSON Schema's integer takes 0.0, which numpy's SeedSequence then refused in the prepare job
    "whole float": ("seed", 0.0, "seed: 0.0 is not of type 'integer'"),
    # `--config aux_layers=[1,4,6]`: Snakemake's --config reads a list's items as strings
    "--config list": ("aux_layers", ["1", "4", "6"], "aux_layers[0]: '1' is not of type 'integer'; if given with "
                      "--config: a list there reaches the workflow as text (Snakemake reads its items as strings): put "
                      "the list in a --configfile"),
    # `--config 'stats={seq_len_bins: 20}'`: a mapping's values too
    "--config mapping": ("stats.seq_len_bins", "20", "stats.seq_len_bins: '20' is not of type 'integer'; if given "
                         "with --config: a mapping there reaches the workflow as text (Snakemake reads its items as "
                         "strings): put the mapping in a --configfile"),
    "enum": ("engine", "vllm", "engine: 'vllm' is not one of ['transformers', 'sglang']"),
    "minimum": ("prompts_per_chunk", 0, "prompts_per_chunk: 0 is less than the minimum of 1"),
    "maximum": ("shard.compression_level", 23, "shard.compression_level: 23 is greater than the maximum of 22"),
    "pattern": ("run_name", "../x", "run_name: '../x' does not match '^[A-Za-z0-9][A-Za-z0-9._-]*$(?!\\\\n)'"),
    "minItems": ("sources", [], "sources: [] should be non-empty"),
    "uniqueItems": ("aux_layers", [1, 1], "aux_layers: [1, 1] has non-unique elements"),
    "items": ("aux_layers", [1, -2], "aux_layers[1]: -2 is less than the minimum of 0"),
    "unknown key": ("prompts_per_chunck", 4, "prompts_per_chunck: unknown key; did you mean `prompts_per_chunk`?"),
    "nested unknown key": ("transformers.devcie", "cpu", "transformers.devcie: unknown key; did you mean `device`?"),
    "nested enum": ("transformers.dtype", "int8",
                    "transformers.dtype: 'int8' is not one of ['bfloat16', 'float16', 'float32']"),
    "device pattern": ("transformers.device", "gpu", "transformers.device: 'gpu' does not match"),
    "required": ("sources", [{"format": "messages"}], "sources[0]: 'path' is a required property"),
}


@pytest.mark.parametrize("kind", SCHEMA_CASES)
def test_each_schema_violation_names_the_key_and_what_is_allowed(kind: str) -> None:
    """What the Snakefile checks before Snakemake's validate: one line naming the key."""
    from hsextract.config.settings import fill_defaults
    from hsextract.errors import ConfigError

    key, value, message = SCHEMA_CASES[kind]
    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    node = config
    *parents, last = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = copy.deepcopy(value)
    with pytest.raises(ConfigError) as e:
        fill_defaults(config)
    msg = str(e.value)
    assert msg.startswith(message) and msg.endswith("(workflow/schemas/config.schema.yaml)"), (kind, msg)
    assert "\n" not in msg


@pytest.mark.parametrize("run_name", ["../x", "/abs", "a/b", "..", ".hidden", "x/../../y", "", "a b"])
def test_run_name_cannot_leave_the_results_folder(run_name: str) -> None:
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    config["run_name"] = run_name
    with pytest.raises(WorkflowError, match="instance\\['run_name'\\]"):
        validate(config, str(SCHEMA))


def test_a_run_name_snakemake_takes_for_a_recursion_is_a_config_error() -> None:
    """A name ending in one piece repeated 20 times passes the schema; Snakemake then stopped with its raw
    PeriodicWildcardError. The check refuses exactly the names Snakemake's own detector flags."""
    from snakemake.io import PeriodicityDetector

    from hsextract.config.checks import check
    from hsextract.errors import ConfigError

    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    for name in ("r" + "x" * 99, "run-" + "ab" * 20, "run-" + "ab" * 19, "tiny-default", "a" * 20, "a" * 19):
        flagged = PeriodicityDetector().is_periodic(name) is not None
        assert flagged == (name in ("r" + "x" * 99, "run-" + "ab" * 20, "a" * 20)), name
        try:
            check({**config, "run_name": name})
        except ConfigError as e:
            assert flagged and str(e).startswith(f"run_name: {name[:40]}"), (name, str(e))
        else:
            assert not flagged, name
    with pytest.raises(ConfigError) as e:
        check({**config, "run_name": "r" + "x" * 99})
    assert str(e.value) == ("run_name: rxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... ends in 'x' repeated 99 times, "
                            "which Snakemake refuses in a path's wildcard (20 or more); choose another name")


# ---- 7. security ----------------------------------------------------------------------------------
def test_server_binds_loopback_unless_configured() -> None:
    from hsextract.errors import ConfigError
    from hsextract.sglang import server as hsrv

    cfg = hsrv.ServerConfig(model="/m", aux_layers=(1,), final_state="post_norm")
    assert cfg.host == "127.0.0.1"
    cmd = hsrv.build_command(cfg)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    remote = hsrv.ServerConfig(model="/m", aux_layers=(1,), host="10.0.0.5", final_state="post_norm")
    other = hsrv.build_command(remote, 0, "/state/private/replica-0.yaml")  # only with a key file (issue 36)
    assert other[other.index("--host") + 1] == "10.0.0.5"
    with pytest.raises(ConfigError, match="not a loopback address"):
        hsrv.build_command(remote)


def test_dump_dir_is_private_unpredictable_and_contained() -> None:
    from hsextract.sglang import server as hsrv

    dirs = [hsrv.make_dump_dir("../../etc/run") for _ in range(3)]
    try:
        base = dirs[0].parent
        assert base in (Path("/dev/shm"), Path(os.environ.get("TMPDIR", "/tmp")))
        assert len({d.name for d in dirs}) == 3  # a fresh name every time
        for d in dirs:
            assert d.parent == base and d.name.startswith("hsx-.._.._etc_run-")  # '/' cannot climb out
            assert d.stat().st_mode & 0o777 == 0o700 and d.stat().st_uid == os.getuid()
            assert len(d.name) - len("hsx-.._.._etc_run-") >= 8  # mkdtemp's random part
    finally:
        for d in dirs:
            shutil.rmtree(d)


def test_plugin_does_nothing_unless_enabled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hsextract.sglang_plugin import plugin

    monkeypatch.delenv(plugin.ENV_DUMP_DIR, raising=False)
    assert plugin.PluginConfig.from_env() is None
    plugin.register()  # without the variable: returns before touching SGLang at all
    assert plugin._DUMPER is None
    assert plugin.PluginConfig.from_env({plugin.ENV_DUMP_DIR: ""}) is None
    # with it, register goes on to SGLang's hook registry (absent here: the import proves it tried)
    monkeypatch.setenv(plugin.ENV_DUMP_DIR, str(tmp_path))
    monkeypatch.setenv(plugin.ENV_AUX_LAYERS, "1,3,5")
    try:
        import sglang  # noqa: F401 - only whether it imports matters
    except ImportError:
        with pytest.raises(ImportError):
            plugin.register()
        assert plugin._DUMPER is None


def test_unsafe_rids_are_never_dumped(tmp_path: Path) -> None:
    from hsextract.sglang_plugin import dumpfiles, plugin

    d = plugin.Dumper(plugin.PluginConfig(tmp_path, AUX), pin=False)
    for rid in ("hsx-../../x", "hsx-a/b", "../hsx-a", "hsx-a\0b", ".hsx-a", "hsx-" + "a" * 300):
        assert not d.accept(rid) and not dumpfiles.is_safe_rid(rid), rid
    assert d.accept("hsx-run-c00001-0a1b2c3d-i7-a0")


def _calls(source: str, name: str) -> list[str]:
    """Every `name(...)` call in source, with its arguments (balanced parentheses)."""
    out = []
    for m in re.finditer(re.escape(name) + r"\(", source):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        out.append(source[m.start():i])
    return out


def test_no_unpickling_anywhere_in_the_code() -> None:
    files = [*ROOT.joinpath("src").rglob("*.py"), *ROOT.joinpath("workflow/scripts").glob("*.py"), ROOT / "Snakefile",
             *ROOT.joinpath("workflow/rules").glob("*.smk")]
    loads = []
    for f in files:
        text = f.read_text()
        code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())  # comments may mention it
        for call in _calls(code, "torch.load"):
            loads.append(f"{f.relative_to(ROOT)}: {call}")
            assert "weights_only=True" in call, (f, call)
        assert not re.search(r"\bimport pickle\b|\bpickle\.(loads?|Unpickler)\b|\bdill\b|\bjoblib\.load\b", code), f
    assert len(loads) >= 1, loads  # the reference sample's (config/reference.py): the grep does find them


def test_reading_shards_never_unpickles(tmp_path: Path, ref16: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    import hsextract

    (tmp_path / "shards").mkdir()
    path = write_shard(tmp_path / "shards" / "chunk-00000.hss", [make_sample(7, seed=k) for k in range(3)])

    def refuse(*a, **kw):
        raise AssertionError("something unpickled while reading a shard")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    real_load = torch.load
    monkeypatch.setattr(torch, "load",
                        lambda *a, **kw: real_load(*a, **kw) if kw.get("weights_only") is True else refuse())
    ds = hsextract.open_dataset(finish_run(tmp_path))
    assert [tuple(ds[i]["input_ids"].shape) for i in range(len(ds))] == [(7,)] * 3
    assert validate_shard(path, ref16)["passed"]


def test_names_from_data_cannot_escape_the_export_folder(tmp_path: Path) -> None:
    from hsextract.cli import main

    run = tmp_path / "deep" / "run"
    (run / "shards").mkdir(parents=True)
    evil = ["../../../escaped", "/etc/passwd", "a/../../b", "..", "x\\..\\y"]
    with ShardWriter(run / "shards" / "chunk-00000.hss",
                     shard_metadata(run_name="../../escaped", model="../../m", vocab_size=1000)) as w:
        for k, sid in enumerate(evil):
            w.add(*make_sample(5, seed=k), sample_id=sid)
    finish_run(run)
    before = {p for p in tmp_path.rglob("*")}
    for fmt in ("speculators-v1", "specforge", "speculators-safetensors"):
        out = tmp_path / "deep" / "out" / fmt
        assert main(["export", "--format", fmt, str(run), str(out)]) == 0
    made = {p for p in tmp_path.rglob("*")} - before
    assert made and all(p.resolve().is_relative_to((tmp_path / "deep" / "out").resolve()) for p in made), sorted(made)
    assert ShardReader(run / "shards" / "chunk-00000.hss").sample_ids == evil  # kept as data, never as a path


# ---- 1. hard kill of the whole workflow, and disk full inside a real extract job (slow) -------------
RUN = "faults"
RECORDS, PER_CHUNK, N_CHUNKS = 9, 3, 3
CONFIG = f"""\
run_name: {RUN}
sources:
  - {{path: data/conversations.jsonl, format: messages, weight: 1.0, max_records: {RECORDS}}}
prompts_per_chunk: {PER_CHUNK}
max_seq_len: 256
truncate: true
transformers: {{device: cpu, dtype: bfloat16, token_budget: 1024}}
extract: {{threads: 1, mem_mb: 1000, retries: 0}}
"""
SHARDS = [f"results/{RUN}/shards/chunk-{i:05d}{SHARD_SUFFIX}" for i in range(N_CHUNKS)]
KILLS, KILL_SEED = 3, 7


def _wf():
    import test_workflow as wf  # its helpers: copy the project, run snakemake, parse job stats

    return wf


def smk_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


def smk_argv(*args: str, cores: int = 2) -> list[str]:
    # targets and options first: --configfile takes every word after it
    return [*_wf().snakemake_cmd(), *args, "--cores", str(cores), "--configfile", "config/test.yaml"]


def shard_file(wd: Path, chunk: int) -> Path:
    return wd / SHARDS[chunk]


def locks(wd: Path) -> list[Path]:
    return sorted((wd / ".snakemake" / "locks").glob("*.lock"))


def dry_plan(wd: Path) -> tuple[dict[int, str], str]:
    """chunk -> Snakemake's reason, from a dry run with --rerun-incomplete; and the run's output."""
    proc = _wf().smk(wd, *SHARDS, "-n", "--rerun-incomplete")
    plan = {}
    for block in proc.stdout.split("rule extract:")[1:]:
        chunk = int(re.search(r"output: results/\S+/chunk-(\d{5})", block)[1])
        plan[chunk] = re.search(r"reason: ([^\n:]+)", block)[1]
    return plan, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project copy with the tiny model built and the prompts prepared: copied for every scenario."""
    wf = _wf()
    wd = wf.make_workdir(tmp_path_factory.mktemp("faults") / "prepared")
    (wd / "config/test.yaml").write_text(CONFIG)
    wf.smk(wd, f"results/{RUN}/prompts/summary.json")
    return wd


@pytest.fixture(scope="module")
def reference_started(prepared: Path, background: ThreadPoolExecutor) -> Future[Path]:
    """The uninterrupted run of the same chunks, in the background: the hard-kill test's attempts (one job at
    a time) overlap it and wait on it only to compare the samples."""
    wd = prepared.parent / "reference"
    shutil.copytree(prepared, wd, symlinks=True)

    def run() -> Path:
        _wf().smk(wd, *SHARDS)
        return wd

    return background.submit(run)


DISK_LIMIT = 64 * 1024  # above every log and metadata file Snakemake writes, below a shard
# Snakemake under a file-size limit, SIGXFSZ ignored (a write past the limit fails with EFBIG); a wrapper that
# execs it rather than preexec_fn, which is unsafe in a process with threads (the background pool)
SMALL_DISK = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "limit = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)); "
              "os.execv(sys.argv[2], sys.argv[2:])")


class DiskFull(NamedTuple):
    workdir: Path
    kept: dict[int, tuple[int, str]]  # chunk -> (mtime, sha256) of the shards not redone, before the run
    proc: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def disk_full_started(reference_started: Future[Path], background: ThreadPoolExecutor) -> Future[DiskFull]:
    """A copy of the reference run without shard 2, rerun under a 64 kB file-size limit (in the background)."""

    def run() -> DiskFull:
        reference = reference_started.result()
        wd = reference.parent / "diskfull"
        shutil.copytree(reference, wd, symlinks=True)
        shard_file(wd, 2).unlink()
        kept = {i: (shard_file(wd, i).stat().st_mtime_ns,
                    hashlib.sha256(shard_file(wd, i).read_bytes()).hexdigest()) for i in (0, 1)}
        proc = subprocess.run([sys.executable, "-c", SMALL_DISK, str(DISK_LIMIT), *smk_argv(*SHARDS)], cwd=wd,
                              env=smk_env(), capture_output=True, text=True, timeout=600)
        return DiskFull(wd, kept, proc)

    return background.submit(run)


@pytest.mark.slow
def test_hard_kill_during_extraction_then_rerun_incomplete(
    prepared: Path, reference_started: Future[Path], request: pytest.FixtureRequest
) -> None:
    if selected_tests_use(request, "disk_full_started"):
        request.getfixturevalue("disk_full_started")  # the disk-full run overlaps the attempts below
    wd = prepared.parent / "killed"
    shutil.copytree(prepared, wd, symlinks=True)
    rng = random.Random(KILL_SEED)
    first_seen: dict[int, int] = {}  # chunk -> mtime of its shard when first seen complete and not planned again
    record = []
    for attempt in range(KILLS):
        t0 = time.time()
        logf = open(wd / f"attempt-{attempt}.log", "w")  # closed once the killed run is waited on
        # one job at a time, so that a kill after a finished chunk lands inside the next one
        proc = subprocess.Popen(smk_argv(*SHARDS, "--rerun-incomplete", cores=1), cwd=wd, env=smk_env(), stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True)
        logs = wd / "logs" / RUN / "extract"
        missing = [i for i in range(N_CHUNKS) if not shard_file(wd, i).exists()]

        def event(missing: list[int] = missing, t0: float = t0, attempt: int = attempt, logs: Path = logs) -> bool:
            # (defaults: this attempt's values, bound here; event() is only called in this attempt)
            # with >= 2 chunks to do, after one of them finished (the kill lands in the next one); with one
            # left, after its job started
            if len(missing) >= 2:
                # Snakemake prints "Finished jobid" once it has recorded the job's outputs; a kill between the
                # shard's rename and that record would (rightly) redo the chunk and leave nothing to prove
                done = any(shard_file(wd, i).exists() and shard_file(wd, i).stat().st_mtime >= t0
                           for i in range(N_CHUNKS))
                return done and "Finished jobid" in (wd / f"attempt-{attempt}.log").read_text()
            return logs.is_dir() and any(p.stat().st_mtime >= t0 for p in logs.iterdir())

        while proc.poll() is None and not event():
            time.sleep(0.05)
        delay = rng.uniform(0.3, 3.0)  # then a seeded random moment
        deadline = time.time() + delay
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        killed = proc.poll() is None
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)  # Snakemake and every job it started, at once
        proc.wait(60)
        logf.close()
        present = [i for i in range(N_CHUNKS) if shard_file(wd, i).exists()]
        for i in present:  # whatever exists is a whole shard: every sample reads back with its checksums
            r = ShardReader(shard_file(wd, i))
            [r[k] for k in range(len(r))]
        plan = {}
        if killed:  # the killed run left its lock; the next parse (this dry run) removes it: no --unlock
            assert locks(wd), "the kill left no lock to recover from"
            plan, said = dry_plan(wd)
            assert "hsextract: removed Snakemake's lock" in said and not locks(wd), said[-2000:]
        assert set(range(N_CHUNKS)) - set(present) <= set(plan)  # missing chunks are redone
        for i in present:
            if i not in plan:
                first_seen.setdefault(i, shard_file(wd, i).stat().st_mtime_ns)
        record.append({"attempt": attempt, "killed_after_s": round(time.time() - t0, 1), "killed": killed,
                       "delay_s": round(delay, 2), "shards_present": present, "planned": plan})
        if not killed:
            break
    assert sum(r["killed"] for r in record) == KILLS, record  # the faults really happened mid-run
    # some survived a kill
    assert any(i not in r["planned"] for r in record[:KILLS] for i in r["shards_present"]), record

    # after the kills: the same command; it redoes exactly the planned chunks
    if record[-1]["killed"]:
        plan = dry_plan(wd)[0]
        before = {i: shard_file(wd, i).stat().st_mtime_ns for i in range(N_CHUNKS) if shard_file(wd, i).exists()}
        done = _wf().smk(wd, *SHARDS, "--rerun-incomplete")
        counts = _wf().job_counts(done.stdout + done.stderr)
        assert counts.get("extract", 0) == len(plan), (counts, plan)
        after = {i: shard_file(wd, i).stat().st_mtime_ns for i in range(N_CHUNKS)}
        assert {i for i in before if before[i] != after[i]} <= set(plan)
        assert all(before[i] == after[i] for i in before if i not in plan)
        record.append({"final_plan": plan, "extract_jobs": counts.get("extract", 0)})
    # a shard seen complete once (and not planned again) was never rewritten by a later attempt
    assert all(shard_file(wd, i).stat().st_mtime_ns == m for i, m in first_seen.items()), first_seen
    assert tmp_files(wd / f"results/{RUN}/shards") == []  # temps of killed writers are gone
    reference = reference_started.result()
    assert [sample_digests(shard_file(wd, i)) for i in range(N_CHUNKS)] == \
           [sample_digests(shard_file(reference, i)) for i in range(N_CHUNKS)]
    nothing = _wf().smk(wd, *SHARDS, "-n")
    assert "Nothing to be done" in nothing.stdout + nothing.stderr
    (Path(os.environ.get("HSX_FAULTS_REPORT", wd / "kill-record.json"))).write_text(json.dumps(record, indent=1))
    print("hard kill record:", json.dumps(record))


@pytest.mark.slow
def test_disk_full_in_an_extract_job(disk_full_started: Future[DiskFull]) -> None:
    wd, kept, proc = disk_full_started.result()
    victim = shard_file(wd, 2)
    assert proc.returncode != 0
    log = (wd / f"logs/{RUN}/extract/chunk-00002.log").read_text()
    assert re.search(rf"ShardError: \S*{re.escape(SHARDS[2])}: writing failed after \d+ samples \(File too large\); "
                     r"no shard was left behind\. Free space in \S+ \(or fix the error\) and rerun the chunk\.",
                     log), log[-2000:]
    assert not victim.exists() and tmp_files(victim.parent) == []
    assert kept == {i: (shard_file(wd, i).stat().st_mtime_ns,
                        hashlib.sha256(shard_file(wd, i).read_bytes()).hexdigest())
                    for i in (0, 1)}


@pytest.mark.parametrize("change", [
    {"sglang": {"servers": [{"url": "http://u:KEY-0123456789@h:1"}]}},  # a URL's credentials, in a mapping
    {"sglang": {"server_url": ["http://u:KEY-0123456789@h:1"]}},
    {"sglang": {"launch_args": "--api-key KEY-0123456789"}},
    {"sglang": {"api_key_file": ["KEY-0123456789"]}},
    {"regenerate": {"server_url": {"url": "http://u:KEY-0123456789@h"}}},
])
def test_a_schema_error_on_a_key_that_could_hold_a_secret_does_not_quote_it(change: dict[str, Any]) -> None:
    from hsextract.config.settings import fill_defaults
    from hsextract.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        fill_defaults(change)
    section, (key, _) = next(iter(change.items())), next(iter(next(iter(change.values())).items()))
    assert str(e.value).startswith(f"{section[0]}.{key}") and "KEY-0123456789" not in str(e.value), str(e.value)
