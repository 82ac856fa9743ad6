"""The cluster profiles: dry runs with the SLURM and Kubernetes executor plugins list the expected
jobs with the expected resources, the SLURM plugin turns an extract job's resources into the
expected sbatch flags, and every key of a profile is commented."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

pytest.importorskip("snakemake_executor_plugin_slurm", reason="needs the cluster extra")
pytest.importorskip("snakemake_executor_plugin_kubernetes", reason="needs the cluster extra")
pytest.importorskip("snakemake_storage_plugin_fs", reason="needs the cluster extra")

from test_workflow import ROOT, job_counts, make_workdir, snakemake_cmd

RUN = "prof-test"
RECORDS, PER_CHUNK = 24, 8
N_CHUNKS = math.ceil(RECORDS / PER_CHUNK)
# A GPU config (transformers on cuda: the extract rule asks for 1 GPU); extract.mem_mb is the
# rule's own memory, which the profiles must not override.
TEST_CONFIG = f"""\
run_name: {RUN}
sources:
  - {{path: data/conversations.jsonl, format: messages, weight: 1.0, max_records: {RECORDS}}}
prompts_per_chunk: {PER_CHUNK}
transformers: {{device: cuda, dtype: bfloat16, token_budget: 1024}}
extract: {{threads: 2, mem_mb: 3000, retries: 1}}
"""
JOBS = {"make_tiny_model": 1, "prepare": 1, "extract": N_CHUNKS, "validate": N_CHUNKS, "stats": N_CHUNKS,
        "aggregate_stats": 1, "seq_length_hist": 1, "manifest": 1, "all": 1}


def dry_run(
    workdir: Path, profile: str, *extra: str, configfiles: tuple[str, ...] = ("config/test.yaml",)
) -> str:
    cmd = snakemake_cmd()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [*cmd, "-n", "--workflow-profile", f"profiles/{profile}", *extra,
         "--configfile", "config/config.yaml", *configfiles],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, (f"dry run with profiles/{profile} failed:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def job_resources(output: str) -> dict[str, list[dict[str, str]]]:
    """rule -> the resources line of each of its jobs in the dry run, as {name: value}."""
    jobs: dict[str, list[dict[str, str]]] = {}
    for block in re.split(r"^\[.*\]\n(?=(?:local)?rule )", output, flags=re.M)[1:]:
        rule = re.match(r"(?:local)?rule (\w+):", block)[1]
        line = re.search(r"^\s+resources: (.*)$", block, re.M)
        res = dict(item.split("=", 1) for item in line[1].split(", ")) if line else {}
        jobs.setdefault(rule, []).append(res)
    return jobs


def subset(res: dict[str, str], keys: dict[str, str]) -> dict[str, str | None]:
    return {k: res.get(k) for k in keys}


SLURM_EXTRACT = {"slurm_partition": "gpu", "gpu": "1", "gpu_model": "h200", "cpus_per_gpu": "8",
                 "runtime": "720", "mem_mb": "3000", "slurm_extra": "--exclusive"}
SLURM_CPU = {"slurm_partition": "cpu", "runtime": "60", "mem_mb": "4000"}


def run_slurm(tmp: Path) -> str:
    return dry_run(make_workdir(tmp / "wd", TEST_CONFIG), "slurm")


@pytest.fixture(scope="module")
def slurm_output(scenarios_started: dict[str, Future[str]]) -> str:
    return scenarios_started["slurm_output"].result()


def test_slurm_dry_run_jobs_and_resources(slurm_output: str) -> None:
    assert "Using workflow specific profile profiles/slurm" in slurm_output
    assert job_counts(slurm_output) == JOBS
    res = job_resources(slurm_output)
    assert len(res["extract"]) == N_CHUNKS
    for job in res["extract"]:
        assert subset(job, SLURM_EXTRACT) == SLURM_EXTRACT
    for rule in ("make_tiny_model", "prepare", "validate", "stats", "aggregate_stats", "manifest"):
        for job in res[rule]:
            assert subset(job, SLURM_CPU) == SLURM_CPU, rule
            assert "gpu" not in job and "gpu_model" not in job, rule


def test_slurm_plugin_submits_extract_with_these_flags(slurm_output: str) -> None:
    """The plugin's own sbatch builder, fed one extract job's resources from the dry run."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    raw = job_resources(slurm_output)["extract"][0]
    values = {k: int(v) if v.isdigit() else v for k, v in raw.items() if k in SLURM_EXTRACT}

    class Resources(dict):
        __getattr__ = dict.__getitem__

    job = SimpleNamespace(resources=Resources(values), threads=2, is_group=lambda: False)
    params = {"run_uuid": "u", "slurm_logfile": "log", "comment_str": "extract", "account": "",
              "partition": f"-p {values['slurm_partition']}", "workdir": "/wd"}
    call = get_submit_command(job, params) + set_gres_string(job)
    for flag in ("-p gpu", "-t 720", "--mem 3000", "--cpus-per-gpu=8", "--exclusive", "--gpus=h200:1"):
        assert flag in call.split(" ") or flag in call, (flag, call)


def run_slurm_cpu(tmp: Path) -> str:
    return dry_run(make_workdir(tmp / "wd", TEST_CONFIG.replace("device: cuda", "device: cpu")), "slurm")


def test_slurm_keeps_the_rules_gpu_count(scenario: str) -> None:
    """The profile does not force GPUs: a CPU config's extract jobs ask for gpu=0."""
    out = scenario
    assert {job["gpu"] for job in job_resources(out)["extract"]} == {"0"}


def test_the_cluster_command_without_cores_parses(tmp_path: Path) -> None:
    """`snakemake --workflow-profile profiles/slurm`, as docs/CLUSTER.md gives it: no --cores, so Snakemake's
    workflow.cores raises (a dry run sets 1 and hides it). `--dag` parses the workflow as a run does and submits
    nothing."""
    wd = make_workdir(tmp_path / "wd", TEST_CONFIG)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([*snakemake_cmd(), "--dag", "--workflow-profile", "profiles/slurm", "--configfile",
                           "config/config.yaml", "config/test.yaml"], cwd=wd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("digraph"), proc.stderr[-3000:]


def run_kubernetes(tmp: Path) -> tuple[str, Path]:
    wd = make_workdir(tmp / "wd", TEST_CONFIG)
    # the storage (the claim in the profile): sources and reference at the config's relative paths
    store = tmp / "store"
    shutil.copytree(ROOT / "data", store / "data")
    shutil.copytree(ROOT / "resources/reference", store / "resources/reference")
    return dry_run(wd, "kubernetes", "--default-storage-prefix", str(store)), store


def test_kubernetes_dry_run_jobs_and_resources(scenario: tuple[str, Path]) -> None:
    out, store = scenario
    assert "Using workflow specific profile profiles/kubernetes" in out
    assert job_counts(out) == JOBS
    # inputs come from the storage and outputs go back to it
    shard = f"{store}/results/{RUN}/shards/chunk-00000.hss (send to storage)"
    assert shard in out
    assert f"{store}/data/conversations.jsonl (retrieve from storage)" in out
    res = job_resources(out)
    assert len(res["extract"]) == N_CHUNKS
    want = {"gpu": "1", "gpu_manufacturer": "nvidia", "machine_type": "p5en.48xlarge", "mem_mb": "3000",
            "disk_mb": "400000"}
    for job in res["extract"]:
        assert subset(job, want) == want
    for rule in ("prepare", "validate", "stats", "aggregate_stats", "manifest"):
        for job in res[rule]:
            want = {"mem_mb": "4000", "disk_mb": "20000", "gpu": None}
            assert subset(job, {"mem_mb": "", "disk_mb": "", "gpu": ""}) == want


def test_kubernetes_profile_mounts_the_claim_under_the_prefix() -> None:
    prof = yaml.safe_load((ROOT / "profiles/kubernetes/config.yaml").read_text())
    claims = dict(v.split(":") for v in prof["kubernetes-persistent-volumes"])
    assert prof["executor"] == "kubernetes" and prof["default-storage-provider"] == "fs"
    assert any(prof["default-storage-prefix"].startswith(path + "/") for path in claims.values())


@pytest.mark.parametrize("profile", ["slurm", "kubernetes"])
def test_every_profile_key_is_commented(profile: str) -> None:
    lines = (ROOT / f"profiles/{profile}/config.yaml").read_text().splitlines()
    keys = 0
    for i, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z_][\w-]*:", line):
            keys += 1
            assert "#" in line or lines[i - 1].lstrip().startswith("#"), f"profiles/{profile}: uncommented key: {line}"
    assert keys > 10


def test_cluster_doc_uses_the_tested_profiles() -> None:
    """docs/CLUSTER.md's commands name these profiles, and its figures are theirs."""
    doc = (ROOT / "docs/CLUSTER.md").read_text()
    assert set(re.findall(r"--workflow-profile profiles/(\w+)", doc)) == {"slurm", "kubernetes"}
    slurm = yaml.safe_load((ROOT / "profiles/slurm/config.yaml").read_text())
    ext = slurm["set-resources"]["extract"]
    assert f"partition `{ext['slurm_partition']}` with `--gpus={ext['gpu_model']}:N`" in doc
    assert f"{ext['cpus_per_gpu']} CPUs per GPU, {ext['runtime']} min" in doc
    k8s = yaml.safe_load((ROOT / "profiles/kubernetes/config.yaml").read_text())
    assert (f"`{k8s['default-storage-prefix']}` the default storage "
            f"(`{k8s['default-storage-provider']}` provider)") in doc
    assert f"{k8s['set-resources']['extract']['disk_mb'] // 1000} GB of ephemeral disk" in doc


# config/kimi.yaml as shipped, with a source and a local model directory of Kimi-K2.5's shape (the hub
# id cannot be read offline): one local SGLang server of tp 8 per extract job.
KIMI_RECORDS, KIMI_PER_CHUNK = 12, 6
KIMI_GPUS = 8  # sglang.tp in config/kimi.yaml (one replica)


def kimi_workdir(dest: Path, extra: str = "") -> Path:
    wd = make_workdir(dest, "")
    kimi = yaml.safe_load((wd / "config/kimi.yaml").read_text())
    assert kimi["sglang"]["tp"] == KIMI_GPUS and kimi["sglang"]["replicas"] == 1
    (wd / "kimi-model").mkdir()
    (wd / "kimi-model/config.json").write_text(
        '{"text_config": {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840}}')
    (wd / "config/test.yaml").write_text(
        f"model: {wd / 'kimi-model'}\nprompts_per_chunk: {KIMI_PER_CHUNK}\n"
        f"sources:\n  - {{path: data/conversations.jsonl, format: messages, max_records: {KIMI_RECORDS}}}\n"
        + extra)
    return wd


KIMI_FILES = ("config/kimi.yaml", "config/test.yaml")


class Resources(dict):
    __getattr__ = dict.__getitem__


def sbatch_call(raw: dict[str, str]) -> list[str]:
    """The sbatch command line the SLURM plugin builds for a job with these dry-run resources."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    values = {k: int(v) if v.isdigit() else v for k, v in raw.items() if k in SLURM_EXTRACT}
    job = SimpleNamespace(resources=Resources(values), threads=8, is_group=lambda: False)
    params = {"run_uuid": "u", "slurm_logfile": "log", "comment_str": "extract", "account": "",
              "partition": f"-p {values['slurm_partition']}", "workdir": "/wd"}
    return (get_submit_command(job, params) + set_gres_string(job)).split()


def run_slurm_kimi(tmp: Path) -> str:
    return dry_run(kimi_workdir(tmp / "wd"), "slurm", configfiles=KIMI_FILES)


def test_slurm_kimi_extract_jobs_request_the_servers_gpus(scenario: str) -> None:
    """engine: sglang with a local server: each extract job starts a TP-8 server, so it asks for 8 GPUs."""
    out = scenario
    res = job_resources(out)
    assert len(res["extract"]) == KIMI_RECORDS // KIMI_PER_CHUNK
    for job in res["extract"]:
        assert subset(job, {"gpu": "", "gpu_model": "", "cpus_per_gpu": "", "mem_mb": ""}) == {
            "gpu": str(KIMI_GPUS), "gpu_model": "h200", "cpus_per_gpu": "8", "mem_mb": "32000"}
        call = sbatch_call(job)
        assert "--gpus=h200:8" in call and "--cpus-per-gpu=8" in call and "-p" in call
        assert call[call.index("-p") + 1] == "gpu"
    assert "gpu" not in res["build_patched_server"][0] and "gpu" not in res["prepare"][0]


def run_slurm_kimi_external(tmp: Path) -> tuple[str, str]:
    """The plain dry run, and the one of profiles/README.md that drops the GPU kind (in a copy of the profile: on
    the command line the keys replaced the whole map, the extract jobs' runtime with it)."""
    extra = "sglang: {servers: ['http://10.0.0.5:30000', 'http://10.0.0.6:30000'], dump_dir: /shared/dump}\n"
    wd = kimi_workdir(tmp / "wd", extra)
    site = wd / "profiles/site"
    shutil.copytree(wd / "profiles/slurm", site)
    text = (site / "config.yaml").read_text()
    assert text.count("    slurm_partition: gpu\n") == 1 and text.count("    gpu_model: h200\n") == 1
    (site / "config.yaml").write_text(text.replace("    slurm_partition: gpu\n", "    slurm_partition: cpu\n")
                                      .replace("    gpu_model: h200\n", "    gpu_model: ''\n"))
    return dry_run(wd, "slurm", configfiles=KIMI_FILES), dry_run(wd, "site", configfiles=KIMI_FILES)


def test_slurm_kimi_with_external_servers_requests_no_gpu(scenario: tuple[str, str]) -> None:
    """sglang.servers: the extract jobs are clients of servers that run elsewhere."""
    out, no_gpu_kind = scenario
    res = job_resources(out)
    assert "build_patched_server" not in res
    assert {job["gpu"] for job in res["extract"]} == {"0"}
    # profiles/README.md: drop the GPU kind for such a run, and no --gpus flag is left
    out = no_gpu_kind
    call = sbatch_call(job_resources(out)["extract"][0])
    assert not [flag for flag in call if flag.startswith("--gpus")], call
    assert call[call.index("-p") + 1] == "cpu" and job_resources(out)["extract"][0]["runtime"] == "720"


def pod_resources(raw: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The Kubernetes plugin's pod for a job with these dry-run resources: its container's resource
    requests and its tolerations' keys (run_job with the API call replaced)."""
    from snakemake_executor_plugin_kubernetes import Executor

    values = {k: int(v) if v.isdigit() else v for k, v in raw.items()
              if k in ("gpu", "gpu_manufacturer", "machine_type", "mem_mb", "disk_mb")}
    values["_cores"] = 8
    created = {}
    ex = object.__new__(Executor)
    ex.__dict__.update(
        format_job_exec=lambda job: "snakemake ...", run_namespace="ns", container_image="img", privileged=False,
        persistent_volumes=[], k8s_service_account_name=None, k8s_cpu_scalar=1.0, secret_envvars={},
        namespace="default", logger=SimpleNamespace(debug=lambda *a: None, info=lambda *a: None, error=print),
        report_job_submission=lambda info: None, _kubernetes_retry=lambda f: f(),
        batchapi=SimpleNamespace(create_namespaced_job=lambda ns, body: created.setdefault("body", body)))
    ex.run_job(SimpleNamespace(resources=values, jobid=1, attempt=1, is_containerized=False))
    pod = created["body"].spec.template.spec
    return pod.containers[0].resources.requests, [t.key for t in pod.tolerations or []]


def kubernetes_store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    shutil.copytree(ROOT / "data", store / "data")
    shutil.copytree(ROOT / "resources/reference", store / "resources/reference")
    return store


def run_kubernetes_kimi(tmp: Path) -> str:
    return dry_run(kimi_workdir(tmp / "wd"), "kubernetes", "--default-storage-prefix", str(kubernetes_store(tmp)),
                   configfiles=KIMI_FILES)


def test_kubernetes_kimi_extract_pods_request_the_servers_gpus(scenario: str) -> None:
    out = scenario
    res = job_resources(out)
    assert len(res["extract"]) == KIMI_RECORDS // KIMI_PER_CHUNK
    for job in res["extract"]:
        requests, tolerations = pod_resources(job)
        assert requests == {"cpu": "8000m", "memory": "32000M", "ephemeral-storage": "400000M",
                            "nvidia.com/gpu": str(KIMI_GPUS)}
        assert tolerations == ["nvidia.com/gpu"]
    requests, tolerations = pod_resources(res["prepare"][0])
    assert "nvidia.com/gpu" not in requests and tolerations == []


def run_kubernetes_kimi_external(tmp: Path) -> str:
    wd = kimi_workdir(tmp / "wd", "sglang: {server_url: 'http://10.0.0.5:30000', dump_dir: /shared/dump}\n")
    return dry_run(wd, "kubernetes", "--default-storage-prefix", str(kubernetes_store(tmp)), configfiles=KIMI_FILES)


def test_kubernetes_kimi_with_external_servers_requests_no_gpu(scenario: str) -> None:
    out = scenario
    for job in job_resources(out)["extract"]:
        assert pod_resources(job)[0]["nvidia.com/gpu"] == "0"


def readme_production_words() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Production"):]
    return re.search(r"^ {4}(snakemake --cores .*--configfile config/kimi\.yaml)\s", section, re.M)[1].split()


def run_readme_production(tmp: Path) -> subprocess.CompletedProcess[str]:
    wd = kimi_workdir(tmp / "wd")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return subprocess.run([*snakemake_cmd(), "-n", *readme_production_words()[1:], "config/test.yaml"], cwd=wd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_readme_production_command_plans_gpu_pool_for_the_server(scenario: subprocess.CompletedProcess[str]) -> None:
    """README's production command, as written plus a source and a local model: the local pool it
    gives (--resources gpu=N) holds an extract job's GPUs (Snakemake refuses a job larger than the pool)."""
    words = readme_production_words()
    assert words[:5] == ["snakemake", "--cores", "8", "--resources", "gpu=8"]
    proc = scenario
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    pool = int(words[4].split("=")[1])
    gpus = {job["gpu"] for job in job_resources(proc.stdout)["extract"]}
    assert gpus == {str(pool)} == {str(KIMI_GPUS)}
    # kimi.yaml's sglang.python is null and the command has no --sdm conda: the dry run says the build will stop
    assert ("hsextract: WARNING: rule build_patched_server will stop: sglang.python is null and the workflow runs "
            "without --sdm conda") in " ".join(proc.stderr.split())


def dry_run_given(wd: Path, flag: str, profile: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """A dry run of config/kimi.yaml with a profile given by `flag` (--profile: profiles/default is loaded too)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return subprocess.run([*snakemake_cmd(), "-n", flag, f"profiles/{profile}", *extra, "--configfile", *KIMI_FILES],
                          cwd=wd, env=env, capture_output=True, text=True, timeout=300)


def run_cluster_profiles_either_way(tmp: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    wd = kimi_workdir(tmp / "wd")
    store = ("--default-storage-prefix", str(kubernetes_store(tmp)))
    return {f"{profile} {flag}": dry_run_given(wd, flag, profile, *(store if profile == "kubernetes" else ()))
            for profile in ("slurm", "kubernetes") for flag in ("--profile", "--workflow-profile")}


def test_cluster_profiles_plan_the_same_jobs_either_way_they_are_given(
        scenario: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """--profile profiles/slurm loads profiles/default too (its local pool gpu=1 would cut a TP-8 job to one GPU,
    its default-resources would replace the cluster's): the pool is lifted, and every job asks for what it asks
    for with --workflow-profile."""
    for profile in ("slurm", "kubernetes"):
        given, workflow = scenario[f"{profile} --profile"], scenario[f"{profile} --workflow-profile"]
        for proc in (given, workflow):
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "workflow specific profile profiles/default" in given.stderr
        assert f"does not apply to the {profile} executor and is lifted" in given.stderr
        assert "is lifted" not in workflow.stderr
        assert job_resources(given.stdout) == job_resources(workflow.stdout)
        assert {job["gpu"] for job in job_resources(given.stdout)["extract"]} == {str(KIMI_GPUS)}
    call = sbatch_call(job_resources(scenario["slurm --profile"].stdout)["extract"][0])
    assert "--gpus=h200:8" in call
    requests, _ = pod_resources(job_resources(scenario["kubernetes --profile"].stdout)["extract"][0])
    assert requests["nvidia.com/gpu"] == str(KIMI_GPUS)


def run_slurm_small_pool_on_command_line(tmp: Path) -> subprocess.CompletedProcess[str]:
    return dry_run_given(kimi_workdir(tmp / "wd"), "--profile", "slurm", "--resources", "gpu=4")


def test_cluster_pool_given_smaller_than_a_job_refuses(scenario: subprocess.CompletedProcess[str]) -> None:
    proc = scenario
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "extract jobs need 8 GPUs each" in out and "gpu=4" in out and "Pass --resources gpu=8 or more" in out
    assert "rule extract:" not in out  # refused before any job was planned


# every dry run above, all started in the background by the first test that needs one (conftest.scenarios_started)
SCENARIOS = {
    "slurm_output": run_slurm,
    "test_slurm_keeps_the_rules_gpu_count": run_slurm_cpu,
    "test_kubernetes_dry_run_jobs_and_resources": run_kubernetes,
    "test_slurm_kimi_extract_jobs_request_the_servers_gpus": run_slurm_kimi,
    "test_slurm_kimi_with_external_servers_requests_no_gpu": run_slurm_kimi_external,
    "test_kubernetes_kimi_extract_pods_request_the_servers_gpus": run_kubernetes_kimi,
    "test_kubernetes_kimi_with_external_servers_requests_no_gpu": run_kubernetes_kimi_external,
    "test_readme_production_command_plans_gpu_pool_for_the_server": run_readme_production,
    "test_cluster_profiles_plan_the_same_jobs_either_way_they_are_given": run_cluster_profiles_either_way,
    "test_cluster_pool_given_smaller_than_a_job_refuses": run_slurm_small_pool_on_command_line,
}
