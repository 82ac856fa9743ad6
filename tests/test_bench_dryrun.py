"""bench/sglang_throughput.py end to end against tests/fake_sglang.py: a broken GPU bench costs device time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import listen_port

ROOT = Path(__file__).resolve().parents[1]


def run_throughput_bench(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 1000}))
    out = tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"  # a shard-writer variant that writes its shard to another folder
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{ROOT / 'tests'}")
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sglang_throughput.py"), "--model", str(model), "--server-module",
         "fake_sglang", "--skip-hf", "--lens", "64", "32", "--n", "24", "16", "--aux", "0", "1", "2",
         "--concurrency", "4", "8", "--shard-threads", "2", f"1:{elsewhere}", "--repeats", "2", "--out", str(out),
         "--state", str(tmp_path / "state"),
         "--port", str(listen_port(0))],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    return r, out, elsewhere


def test_throughput_bench_dry_run_fills_every_part(
    scenario: tuple[subprocess.CompletedProcess[str], Path, Path],
) -> None:
    r, out, elsewhere = scenario
    res = json.loads((out / "throughput.json").read_text())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert res["errors"] == {} and res["skipped"] == {}
    runs = res["runs"]
    v1 = f"b_capture_with_shards/t1:{str(elsewhere).replace('/', '_')}"
    assert sorted(runs) == sorted([
        "a_plain", "a_plain#2", "a_plain@8", "b0_capture_no_shards", "b0_capture_no_shards#2",
        "b0_capture_no_shards@8", "b_capture_with_shards", f"{v1}#1", "b_capture_with_shards/t2#2", f"{v1}#2",
        "b_capture_with_shards@8", "c_return_hidden_states_json", "d_handmade_pt", "d_one_at_a_time"])
    assert runs[f"{v1}#2"]["64"]["shard_threads"] == 1 and runs[f"{v1}#2"]["64"]["shard_dir"] == str(elsewhere)
    assert runs["b_capture_with_shards/t2#2"]["64"]["shard_dir"] == str(out) and list(elsewhere.iterdir()) == []
    d = runs["d_handmade_pt"]["64"]  # one prompt at a time, a raw .pt each: 4 bf16 [64, 64] tensors and more
    assert d["n"] == 24 and d["pt_bytes"] > 24 * 4 * 64 * 64 * 2 and not (out / "handmade-64").exists()
    for part in runs.values():  # every part says what CPU it used
        cpu = part["64"]["cpu"]
        assert cpu["cpus"] == os.cpu_count() and cpu["client_cores"] >= 0 and cpu["machine_busy_cores"] >= 0
        assert cpu["top"] and all(v > 0 for v in cpu["top"].values())
    b = runs["b_capture_with_shards"]["64"]
    assert b["n"] == 24 and b["tokens"] == 24 * 64 and b["shard_threads"] == 2
    assert b["writer"]["requests_done"] >= 24 and b["writer"]["writer_threads"] == 4
    assert 0 < b["stored_over_raw"] < 1.0 and b["shard_bytes"] > 0  # the shard was really written (and compressed)
    # the per-sample timeline reaches from the client through the plugin's marker timestamps and back
    tl = b["timeline"]
    assert set(tl) >= {"slot_wait", "http", "write", "marker_after_answer", "collect_after_marker"}
    assert 0 < tl["last_answered_s"] <= tl["last_collected_s"] <= tl["last_yielded_s"] < b["wall_s"] + 1
    assert len(json.loads((out / "timelines" / "b_capture_with_shards-64.json").read_text())) == 2 * 24
    for name in ("b_capture_with_shards/t2#2", "b0_capture_no_shards#2", "a_plain#2"):  # repeats at every length
        assert sorted(runs[name]) == ["32", "64"]
    table = (out / "throughput.md").read_text()
    assert "| b_capture_with_shards@8 / a_plain@8 (target >= 0.9 at 512) |" in table
    row = next(line for line in table.splitlines() if line.startswith("| (b)/(a), every repeat"))
    assert row.count("2 x 2 runs") == 2  # (b) twice (t2, t2#2), (a) twice, at both lengths


def run_fidelity_script(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out"
    env = dict(os.environ, FID_DRY="1", PY=sys.executable, OUT=str(out), MODELS_DIR=str(tmp_path / "models"),
               FID_N="3", PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "run_fidelity.sh")], env=env, capture_output=True,
                       text=True, timeout=1800, check=False)
    return r, out


def test_fidelity_script_dry_run_runs_every_model_and_its_routing_fixed_twin(
    scenario: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """bench/gpu/run_fidelity.sh with FID_DRY=1: the GPU call's script, models, checks and files on the CPU
    (the candidate is the transformers engine batched with padding instead of the SGLang server)."""
    r, out = scenario
    log = (out / "run.log").read_text()
    assert r.returncode == 0, log[-3000:] + r.stderr[-2000:]
    assert "models: deepseek:eagle3 deepseek-fixed:eagle3 llama:dflash" in log  # the MoE model's twin added
    res = {n: json.loads((out / f"fidelity-{n}.json").read_text()) for n in ("deepseek", "deepseek-fixed", "llama")}
    assert [res[n]["check_mode"] for n in res] == ["token", "sample", "sample"]  # the twin: dense bounds
    assert res["deepseek"]["aux_layers"] == [2, 4, 5] and res["llama"]["aux_layers"] == [2, 3, 4, 5, 6]
    for n, x in res.items():
        assert x["pass"] and "error" not in x, (n, x.get("error"), x.get("checks"))
        assert x["tensors"][-2:] == ["final_pre_norm", "final_post_norm"]
        for check in ("final_states_distinguishable", "final_pre_norm_is_not_post_norm",
                      "final_post_norm_is_not_pre_norm", "post_norm_is_norm_of_pre_norm",
                      "specforge_export_is_post_norm", "shard_roundtrip"):
            assert x["checks"][check] is True, (n, check)
        assert x["min_rel_ref_pre_vs_post"] > 0.5  # mk_models' final-norm weight makes the two states differ
    assert "shard_validates" not in res["llama"]["checks"]  # 5 aux layers: the 4-tensor reference does not apply
    md = (out / "fidelity.md").read_text()
    assert md.count("PASS") == 3 and "### llama: PASS (checks: sample, aux [2, 3, 4, 5, 6])" in md


def run_gpu_script_on_fake(tmp_path: Path, script: str, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """bench/gpu/`script` on mk_models' tiny Llama, its server tests/fake_sglang.py, on the CPU."""
    models, out = tmp_path / "models", tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{ROOT / 'tests'}", HSX_DEVICE="cpu")
    subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "mk_models.py"), str(models), "--only", "llama"],
                   env=env, capture_output=True, text=True, timeout=600, check=True)
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu" / script), "--model", str(models / "llama"),
         "--state", str(tmp_path / "state"), "--out", str(out), "--server-module", "fake_sglang",
         "--startup-timeout", "120", *args],
        env=env, capture_output=True, text=True, timeout=900, check=False)
    return r, out


def run_fidelity_sglang(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    return run_gpu_script_on_fake(tmp_path, "fidelity.py", "--name", "f", "--aux", "dflash", "--n", "4",
                                  "--max-len", "48", "--alone", "2", "--direct-hf", "2", "--port", str(listen_port(1)))


def test_fidelity_sglang_path_plumbing_against_the_fake_server(
    scenario: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """fidelity.py's SGLang path (server start, final_state both, K+2 tensors per sample, shard, SpecForge export)
    against tests/fake_sglang.py with the real plugin code: no stage fails. Its states are not a model's, so
    the value checks fail, as they must."""
    r, out = scenario
    res = json.loads((out / "fidelity-f.json").read_text())
    assert "error" not in res and res.get("shard_error") is None, (res.get("error"), r.stderr[-2000:])
    assert res["plugin_marker"]["final_state"] == "both" and res["plugin_marker"]["aux_layers"] == [2, 3, 4, 5, 6]
    assert res["tensors"] == ["aux2", "aux3", "aux4", "aux5", "aux6", "final_pre_norm", "final_post_norm"]
    assert res["checks"]["shard_roundtrip"] is True and res["specforge_final_norm_applied"] is True
    assert res["checks"]["right_layers_within_tol"] is False and r.returncode == 1  # fake states: checks fail


def run_read_bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "read.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "read.py"), "--dry", "--decode-threads", "3", *args,
         "--dir", str(tmp_path), "--out", str(out), "--md", str(tmp_path / "read.md")],
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), capture_output=True, text=True, timeout=300, check=False)
    return r, tmp_path


def run_read_bench_all(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    return run_read_bench(tmp_path, "--workers", "1", "2", "--batch", "1", "none")


def run_read_bench_stream(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    return run_read_bench(tmp_path, "--workers", "2", "--stores", "stream", "--prefetch", "0", "3", "--no-profile")


def test_read_bench_dry_run_fills_every_store_and_worker_cell(
    scenario: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """bench/read.py --dry: three stores of the same samples (ours read three ways), every (cache, workers, loader
    batching, store) cell measured."""
    r, tmp_path = scenario
    out = tmp_path / "read.json"
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["evict_method"] == "fadvise" and res["samples"] >= 2
    assert set(res["stores"]) == {"ours", ".pt", "safetensors"} and all(v["bytes"] > 0 for v in res["stores"].values())
    assert sorted(res["cells"]) == ["cold", "warm"]
    for by_w in res["cells"].values():
        assert list(by_w) == ["1", "2", "1 uncollated", "2 uncollated"]
        for row in by_w.values():
            assert list(row) == ["ours", "ours t3", "ours stream t3", ".pt", "safetensors"]
            assert all(c["samples_s"] > 0 and c["gb_s"] > 0 for c in row.values())
            assert all(c["steady_samples_s"] > 0 and c["steady_gb_s"] > 0 for c in row.values())
    assert abs(sum(res["profile"]["split"].values()) - 1) < 1e-9 and res["profile"]["split"]["zstd decompress"] > 0
    assert sorted(res["decode_threads"]) == ["1", "2", "3"]
    assert all(v["samples_s"] > 0 and v["samples_per_cpu_s"] > 0 for v in res["decode_threads"].values())
    md = (tmp_path / "read.md").read_text()
    head = ("| cache | workers | ours GB/s | ours t3 GB/s | ours stream t3 GB/s | .pt GB/s | safetensors GB/s | "
            "ours / .pt | ours / .pt steady | ours t3 / .pt | ours t3 / .pt steady | ours stream t3 / .pt | "
            "ours stream t3 / .pt steady |")
    assert head in md
    assert md.count("\n| warm |") == 4 and md.count("\n| cold |") == 4 and "| decode_threads |" in md
    assert "\n| cold | 2 uncollated | " in md
    assert list(tmp_path.glob("hsx-read-*")) == []  # the stores are removed


def test_read_bench_dry_run_reads_the_chosen_stores_only(
    scenario: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """--stores stream --prefetch 0 3 --no-profile: the stream once per prefetch and the .pt baseline they are
    compared with, no profile tables."""
    r, tmp_path = scenario
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "read.json").read_text())
    assert set(res["stores"]) == {"ours", ".pt"} and "profile" not in res
    assert [list(row) for by_w in res["cells"].values() for row in by_w.values()] == [
        ["ours stream t3 p0", "ours stream t3 p3", ".pt"]] * 2
    md = (tmp_path / "read.md").read_text()
    assert ("| cache | workers | ours stream t3 p0 GB/s | ours stream t3 p3 GB/s | .pt GB/s | "
            "ours stream t3 p0 / .pt | ours stream t3 p0 / .pt steady | ours stream t3 p3 / .pt | "
            "ours stream t3 p3 / .pt steady |") in md
    assert "| decode_threads |" not in md


def run_shared_prefix_bench(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    return run_gpu_script_on_fake(tmp_path, "shared_prefix.py", "--name", "sp", "--convs", "4", "--turns", "3",
                                  "--decl", "80", "--concurrency", "4", "--reference", "2",
                                  "--port", str(listen_port(2)))


def test_shared_prefix_bench_plumbing_against_the_fake_server(
    scenario: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """bench/gpu/shared_prefix.py against tests/fake_sglang.py (its radix per cache key, the real plugin code): a
    flat and a shared server, the chunk through both, prefill tokens from the dumps and from the servers' log lines,
    the shards compared. The fake's states are no model's, so the reference check fails, as it must."""
    r, out = scenario
    res = json.loads((out / "shared-prefix-sp.json").read_text())
    assert "error" not in res, res.get("error")
    ch, runs = res["chunk"], res["runs"]
    assert (ch["samples"], ch["tokens"], ch["distinct_tokens"], ch["proposed_references"]) == (12, 4800, 3200, 11)
    assert runs["flat"]["computed_tokens"] == runs["flat"]["server_new_tokens"] == 4800
    assert runs["shared"]["computed_tokens"] == runs["shared"]["server_new_tokens"] == 3200
    assert "--disable-radix-cache" in runs["flat"]["command"]
    assert "--disable-radix-cache" not in runs["shared"]["command"]
    cmp = res["shared_vs_flat"]
    assert cmp["format_versions"] == [1, 2] and cmp["stored_references"] == 11 and cmp["bitwise_equal_samples"] == 12
    assert {k: v for k, v in res["checks"].items() if not v} == {"flat_within_tol_of_reference": False,
                                                                  "shared_within_tol_of_reference": False}
    assert r.returncode == 1 and "### sp: FAIL" in (out / "shared-prefix-sp.md").read_text()


# each test's bench run, all started in the background by the first of them (conftest.scenarios_started), the
# longest first: two at a time, they overlap
SCENARIOS = {
    "test_shared_prefix_bench_plumbing_against_the_fake_server": run_shared_prefix_bench,
    "test_fidelity_script_dry_run_runs_every_model_and_its_routing_fixed_twin": run_fidelity_script,
    "test_throughput_bench_dry_run_fills_every_part": run_throughput_bench,
    "test_fidelity_sglang_path_plumbing_against_the_fake_server": run_fidelity_sglang,
    "test_read_bench_dry_run_fills_every_store_and_worker_cell": run_read_bench_all,
    "test_read_bench_dry_run_reads_the_chosen_stores_only": run_read_bench_stream,
}


# Snakemake 9's log of a run stopped by `timeout` (bench/gpu/run_production.sh's b-rerun on the H100, trimmed):
# rule blocks start right after a time stamp line, and each error block names its own job by `jobid:`
KILLED_RUN_LOG = """\
hsextract: removed Snakemake's lock (2 files in .snakemake/locks) left by a run that no longer exists
[Sun Dec  6 00:33:30 2026]
localrule extract:
    output: results/kimi-k25/shards/chunk-00003.hss
    jobid: 6
    reason: Missing output files: results/kimi-k25/shards/chunk-00003.hss
    wildcards: run=kimi-k25, chunk=00003
    resources: tmpdir=/tmp
[Sun Dec  6 00:34:01 2026]
Finished jobid: 6 (Rule: extract)
[Sun Dec  6 00:34:01 2026]
localrule validate:
    input: results/kimi-k25/shards/chunk-00003.hss
    jobid: 12
    wildcards: run=kimi-k25, chunk=00003
[Sun Dec  6 00:34:29 2026]
localrule extract:
    output: results/kimi-k25/shards/chunk-00000.hss
    jobid: 1
    reason: Missing output files: results/kimi-k25/shards/chunk-00000.hss
    wildcards: run=kimi-k25, chunk=00000
    resources: tmpdir=/tmp
Will exit after finishing currently running jobs (scheduler).
[Sun Dec  6 00:34:32 2026]
Error in rule validate:
    message: None
    jobid: 12
[Sun Dec  6 00:34:32 2026]
Error in rule extract:
    message: None
    jobid: 1
"""


def test_production_jobs_parser_reads_a_killed_run() -> None:
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    try:
        from production_tools import parse_jobs
    finally:
        sys.path.remove(str(ROOT / "bench" / "gpu"))
    jobs = parse_jobs(KILLED_RUN_LOG)
    assert jobs["by_rule"] == {"extract": 2, "validate": 1}
    assert jobs["extract_chunks"] == ["00000", "00003"]
    assert jobs["finished_extract_chunks"] == ["00003"]
    assert jobs["extract_reasons"] == {"00003": "Missing output files", "00000": "Missing output files"}
    assert jobs["failed_rules"] == ["validate", "extract"]
    assert jobs["stale_lock_removed"] and not jobs["lock_error"]
