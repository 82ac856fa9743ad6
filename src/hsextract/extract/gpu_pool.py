"""The GPU pool a run gives Snakemake, against the GPUs one extract job needs (workflow/rules/gpu_pool.smk).

Snakemake cuts a job's resource to the global pool without a word: an extract job that starts a TP-8 server
(`sglang.tp` GPUs: the job drives one local replica) under the pool `gpu: 1` of profiles/default runs as `gpu=1`,
and on a cluster asks SLURM or Kubernetes for one GPU. `settle` decides, before any job (dry runs too; not for
`--report`, `--unlock` and other commands that run no job):

- no pool, or one that holds a job: nothing to do;
- a pool smaller than one job on the local executor: refuse, naming `--resources gpu=N`;
- a pool smaller than one job under a cluster executor (SLURM, Kubernetes, ...) that did not come from the
  command line: it is profiles/default's local pool, which Snakemake also loads when a cluster profile is
  given with `--profile` instead of `--workflow-profile`; it limits nothing a cluster has, so it is lifted
  (the jobs ask for their GPUs, as with `--workflow-profile`), and a note says so;
- the same with `--resources gpu=M` on the command line: refuse (the user asked for it);
- `sglang.replicas` > 1 (servers side by side on one machine) under a cluster executor: refuse (there every job
  is an allocation with one server); on the local executor, a pool that runs fewer or more jobs than there are
  replicas: a note.

Snakemake's Snakefile does not learn the executor before it parses; it is read from the command line
(`--executor`/`-e`) and from the profiles named there (`--profile`, `--workflow-profile`, $SNAKEMAKE_PROFILE).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from hsextract.errors import ConfigError

LOCAL_EXECUTORS = frozenset({"local", "dryrun", "touch"})
# Snakemake modes that run and plan no job (the report of a finished run, unlocking, listings, graphs): no check.
NO_JOB_FLAGS = frozenset({
    "--report", "--unlock", "--lint", "--summary", "-S", "--detailed-summary", "-D", "--list-rules", "--list",
    "-l", "--list-target-rules", "--lt", "--cleanup-metadata", "--cm", "--touch", "-t", "--dag", "--rulegraph",
    "--filegraph", "--d3dag", "--list-changes", "--lc", "--generate-unit-tests", "--archive",
    "--delete-all-output", "--delete-temp-output", "--print-compilation", "--containerize",
    "--conda-create-envs-only", "--conda-cleanup-envs", "--export-cwl", "--list-input-changes",
    "--list-params-changes", "--list-code-changes", "--li", "--lp", "--list-untracked", "--lu",
})


@dataclass(frozen=True)
class Decision:
    pool: int | None  # the pool the run keeps (None: no pool)
    lifted: bool = False
    note: str = ""


def _values(argv: Sequence[str], flags: tuple[str, ...]) -> list[str]:
    """Values given to any of `flags` (`--flag v1 v2`, `--flag=v`), in order."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        name, eq, val = word.partition("=")
        if name in flags:
            if eq:
                out.append(val)
            else:
                j = i + 1
                while j < len(argv) and not argv[j].startswith("-"):
                    out.append(argv[j])
                    j += 1
                i = j - 1
        i += 1
    return out


def plans_jobs(argv: Sequence[str]) -> bool:
    """Whether a Snakemake command line runs or plans jobs (a dry run does; `--report`, `--unlock`, ... do not)."""
    return not any(word.partition("=")[0] in NO_JOB_FLAGS for word in argv[1:])


# Flags of NO_JOB_FLAGS that still mark or delete outputs (a model another run names among them)
OUTPUT_FLAGS = frozenset({"--touch", "-t", "--delete-all-output", "--delete-temp-output"})


def changes_outputs(argv: Sequence[str]) -> bool:
    """Whether a Snakemake command line runs or plans jobs, or marks or deletes outputs (`--touch`,
    `--delete-all-output`); not `--unlock`, `--lint`, `--report`, the listings."""
    return plans_jobs(argv) or any(word.partition("=")[0] in OUTPUT_FLAGS for word in argv[1:])


def pool_on_command_line(argv: Sequence[str]) -> bool:
    """Whether the command line gives `--resources` (Snakemake also takes `--res`) with a `gpu` entry."""
    return any(v.split("=", 1)[0] == "gpu" for v in _values(argv, ("--resources", "--res")))


def _profile_dirs(name: str, roots: Sequence[Path]) -> list[Path]:
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return [*(r / name for r in roots), *(r / "profiles" / name for r in roots), config_home / "snakemake" / name,
            Path("/etc/xdg/snakemake") / name]


def profile_executor(name: str, roots: Sequence[Path]) -> str | None:
    """The `executor:` of a profile (a folder under one of `roots`, or a name Snakemake looks up in its
    configuration folders), None if it sets none."""
    for d in _profile_dirs(name, roots):
        if not d.is_dir():
            continue
        for f in sorted(d.glob("*.yaml")):
            try:
                data = yaml.safe_load(f.read_text(encoding="utf-8"))
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(data, dict) and isinstance(data.get("executor"), str):
                return data["executor"]
        return None
    return None


def executor_of(argv: Sequence[str], roots: Sequence[str | os.PathLike[str]] = (".",),
                env: dict[str, str] | None = None) -> str:
    """The executor a Snakemake command line runs with: `--executor`/`-e`, else the first profile that names
    one (`--profile`, $SNAKEMAKE_PROFILE, `--workflow-profile`; folders looked up under `roots`, the working
    directory and the workflow's), else `local`."""
    given = _values(argv, ("--executor", "-e"))
    if given:
        return given[-1]
    env = os.environ if env is None else env
    profiles = _values(argv, ("--profile",)) or ([env["SNAKEMAKE_PROFILE"]] if env.get("SNAKEMAKE_PROFILE") else [])
    profiles += [p for p in _values(argv, ("--workflow-profile",)) if p != "none"]
    for name in profiles:
        found = profile_executor(name, [Path(r) for r in roots])
        if found:
            return found
    return "local"


def settle(need: int, pool: int | None, executor: str, pool_from_command_line: bool, why: str,
           replicas: int = 1) -> Decision:
    """What to do with the GPU pool `pool` (None: none) when one extract job needs `need` GPUs (`why`: where
    that number comes from) and a machine holds `replicas` local servers of `need` GPUs each, one job driving
    each; ConfigError when the run must not start."""
    local = executor in LOCAL_EXECUTORS
    whole = need * replicas
    if replicas > 1 and not local:
        raise ConfigError(
            f"sglang.replicas: {replicas} servers on one machine is for the local executor; under the {executor} "
            f"executor every extract job is an allocation of its own, with one server of sglang.tp GPUs, and the "
            f"cluster runs the jobs side by side: set sglang.replicas: 1")
    if not need or pool is None or pool >= need:
        gpus = f"{need} GPU{'s' if need != 1 else ''}"
        if need and pool is not None and replicas > 1 and pool < whole:
            return Decision(pool, note=(
                f"GPU pool gpu={pool}: {pool // need} of the {replicas} sglang replicas ({gpus} each) extract at "
                f"once; --resources gpu={whole} runs them all"))
        if need and replicas > 1 and (pool is None or pool > whole):
            return Decision(pool, note=(
                f"GPU pool {'gpu=' + str(pool) if pool is not None else 'unbounded'}: more extract jobs at once than "
                f"the {replicas} sglang replicas ({gpus} each); the others wait for a free one: --resources "
                f"gpu={whole} matches"))
        return Decision(pool)
    cut = (f"extract jobs need {need} GPUs each ({why}), but the run's GPU pool is gpu={pool}: Snakemake would "
           f"cut every extract job to {pool} GPU{'s' if pool != 1 else ''} without a word")
    if local:
        source = "--resources on the command line" if pool_from_command_line else "profiles/default/config.yaml"
        more = f" ({replicas} replicas: gpu={whole} runs one job on each)" if replicas > 1 else ""
        raise ConfigError(
            f"{cut} (the pool comes from {source}). Pass --resources gpu={need} on a machine with {need} GPUs"
            f"{more} (or lower sglang.tp); on a cluster, give its profile with --workflow-profile "
            "profiles/slurm (or profiles/kubernetes).")
    if pool_from_command_line:
        raise ConfigError(f"{cut} under the {executor} executor. Pass --resources gpu={need} or more (the pool "
                          "caps the GPUs of all jobs in flight), or leave --resources out.")
    return Decision(None, lifted=True, note=(
        f"GPU pool: the local pool gpu={pool} of profiles/default (loaded beside the cluster executor's "
        f"settings, e.g. a profile given with --profile) does not apply to the {executor} executor and is "
        f"lifted: each extract job asks for its {need} GPUs, as with --workflow-profile."))
