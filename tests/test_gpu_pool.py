"""hsextract.extract.gpu_pool: a GPU pool smaller than one extract job is refused (local) or lifted (profiles/default's
pool under a cluster executor); the executor and the pool are read from the command line and its profiles.
The workflow runs: tests/test_production_dryrun.py (local refusal) and tests/test_profiles.py (cluster profiles
given with --profile or --workflow-profile)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsextract.errors import ConfigError
from hsextract.extract import gpu_pool

WHY = "engine sglang: a local server of sglang.tp 8"


@pytest.mark.parametrize(("need", "pool"), [(0, 1), (8, None), (8, 8), (8, 16), (1, 1)])
def test_a_pool_that_holds_a_job_or_no_pool_is_kept(need: int, pool: int | None) -> None:
    for executor in ("local", "slurm"):
        assert gpu_pool.settle(need, pool, executor, False, WHY) == gpu_pool.Decision(pool)


def test_local_run_with_a_small_pool_refuses_and_names_the_flag() -> None:
    with pytest.raises(ConfigError) as e:
        gpu_pool.settle(8, 1, "local", False, WHY)
    msg = str(e.value)
    assert msg.startswith(f"extract jobs need 8 GPUs each ({WHY}), but the run's GPU pool is gpu=1")
    assert "Pass --resources gpu=8" in msg and "profiles/default/config.yaml" in msg
    assert "--workflow-profile profiles/slurm" in msg
    with pytest.raises(ConfigError, match=r"gpu=2: .*comes from --resources on the command line"):
        gpu_pool.settle(8, 2, "dryrun", True, WHY)


def test_cluster_executor_lifts_the_default_pool_but_not_one_given_on_the_command_line() -> None:
    d = gpu_pool.settle(8, 1, "slurm", False, WHY)
    assert d.pool is None and d.lifted and "does not apply to the slurm executor" in d.note
    with pytest.raises(ConfigError, match=r"gpu=4: .* under the kubernetes executor\. Pass --resources gpu=8 or more"):
        gpu_pool.settle(8, 4, "kubernetes", True, WHY)


def test_replicas_run_side_by_side_on_one_machine_and_are_refused_under_a_cluster_executor() -> None:
    # two servers of tp 4: a job needs 4 GPUs, gpu=8 runs both at once, gpu=4 one at a time (said)
    assert gpu_pool.settle(4, 8, "local", True, WHY, replicas=2) == gpu_pool.Decision(8)
    for pool, said in ((16, "gpu=16"), (None, "unbounded")):
        assert gpu_pool.settle(4, pool, "local", True, WHY, replicas=2) == gpu_pool.Decision(pool, note=(
            f"GPU pool {said}: more extract jobs at once than the 2 sglang replicas (4 GPUs each); the others wait "
            "for a free one: --resources gpu=8 matches"))
    assert gpu_pool.settle(4, 4, "local", True, WHY, replicas=2) == gpu_pool.Decision(4, note=(
        "GPU pool gpu=4: 1 of the 2 sglang replicas (4 GPUs each) extract at once; --resources gpu=8 runs them all"))
    with pytest.raises(ConfigError) as e:
        gpu_pool.settle(4, 1, "local", False, WHY, replicas=2)
    assert "Pass --resources gpu=4 on a machine with 4 GPUs (2 replicas: gpu=8 runs one job on each)" in str(e.value)
    for executor in ("slurm", "kubernetes"):
        with pytest.raises(ConfigError) as e:
            gpu_pool.settle(4, None, executor, False, WHY, replicas=2)
        assert str(e.value) == (
            f"sglang.replicas: 2 servers on one machine is for the local executor; under the {executor} executor "
            "every extract job is an allocation of its own, with one server of sglang.tp GPUs, and the cluster "
            "runs the jobs side by side: set sglang.replicas: 1")


def test_pool_on_the_command_line() -> None:
    assert gpu_pool.pool_on_command_line(["snakemake", "--cores", "8", "--resources", "gpu=8", "--configfile", "a"])
    assert gpu_pool.pool_on_command_line(["snakemake", "--res", "server=1", "gpu=2"])
    assert gpu_pool.pool_on_command_line(["snakemake", "--resources=gpu=2"])
    assert not gpu_pool.pool_on_command_line(["snakemake", "--resources", "server=2", "--set-resources", "gpu=1"])
    assert not gpu_pool.pool_on_command_line(["snakemake", "--cores", "8"])


def test_commands_that_run_no_job_are_not_checked() -> None:
    assert gpu_pool.plans_jobs(["snakemake", "-n", "--cores", "8"])
    assert gpu_pool.plans_jobs(["snakemake", "--cores", "8", "--configfile", "config/kimi.yaml"])
    for flag in ("--report", "--report=r.html", "--unlock", "--lint", "--summary", "--cleanup-metadata", "--touch"):
        assert not gpu_pool.plans_jobs(["snakemake", flag, "--configfile", "config/kimi.yaml"])
    # ... but --touch and the deletions mark or remove outputs (a tiny model another run names: common.smk)
    for flag in ("-n", "--touch", "-t", "--delete-all-output", "--delete-temp-output"):
        assert gpu_pool.changes_outputs(["snakemake", flag, "--cores", "1"]), flag
    for flag in ("--report", "--unlock", "--lint", "--list-rules", "--summary"):
        assert not gpu_pool.changes_outputs(["snakemake", flag, "--cores", "1"]), flag


def test_executor_from_the_command_line_and_its_profiles(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    assert gpu_pool.executor_of(["snakemake", "--cores", "2"], [root], env={}) == "local"
    assert gpu_pool.executor_of(["snakemake", "--executor", "slurm"], [root], env={}) == "slurm"
    assert gpu_pool.executor_of(["snakemake", "-e", "kubernetes"], [root], env={}) == "kubernetes"
    for name in ("slurm", "kubernetes"):
        for flag in ("--profile", "--workflow-profile"):
            assert gpu_pool.executor_of(["snakemake", flag, f"profiles/{name}"], [root], env={}) == name
        # by name, as Snakemake also looks profiles up beside the workflow
        assert gpu_pool.executor_of(["snakemake", "--profile", name], [root], env={}) == name
    assert gpu_pool.executor_of(["snakemake", "--workflow-profile", "profiles/default"], [root], env={}) == "local"
    # a personal profile (in $SNAKEMAKE_PROFILE) that names none, and one in the config folder that does
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("jobs: 4\n")
    assert gpu_pool.executor_of(["snakemake"], [tmp_path], env={"SNAKEMAKE_PROFILE": "mine"}) == "local"
    (mine / "config.yaml").write_text("executor: slurm\njobs: 4\n")
    assert gpu_pool.executor_of(["snakemake"], [tmp_path], env={"SNAKEMAKE_PROFILE": "mine"}) == "slurm"
    # the command line wins over a profile
    assert gpu_pool.executor_of(["snakemake", "--profile", "mine", "-e", "local"], [tmp_path], env={}) == "local"
