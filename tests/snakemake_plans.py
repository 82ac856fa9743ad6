"""What `snakemake -n` would plan, for many configs of one project copy, in one interpreter.

Started by tests/test_workflow.py (`python tests/snakemake_plans.py WORKDIR CONFIGFILE...`): one process pays
Snakemake's and hsextract's imports once (about 3 s), then each dry run costs its parse and DAG (0.1 to
0.3 s), where a `snakemake -n` command costs 4 s. Through Snakemake's own API, as its command line does, with
the resource pools (on 8 GPUs) and rerun triggers of profiles/default (which the command line reads by itself).

One JSON request per stdin line, one JSON answer per stdout line:
  {"plan": CONFIG, "forcerun": [RULE, ...]}: the jobs a dry run plans under the config files with CONFIG on
      top, {"plan": {rule: count}, "rules": [every rule of the workflow]}; forcerun (optional) names rules
      to rerun with what follows them (those the workflow lacks under CONFIG are left out);
  {"touch": CONFIG}: `snakemake --touch` under CONFIG: every output is recorded as made by that config
      (params included), so that later plans compare with it; a missing output is made first, empty.
A failure answers {"error": "..."}.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import sys
import traceback
from collections import Counter
from itertools import chain
from pathlib import Path
from typing import Any

import yaml
from snakemake.api import SnakemakeApi
from snakemake.settings.enums import Quietness, RerunTrigger
from snakemake.settings.types import ConfigSettings, DAGSettings, ExecutionSettings, OutputSettings, ResourceSettings


def parse_schemas_once() -> None:
    """Snakemake's validate() parses the config schema (500 lines of YAML) at every parse of the Snakefile: 40%
    of a dry run's time here. The schema's parse, once per file version."""
    import snakemake.utils

    load = getattr(snakemake.utils, "_load_configfile", None)
    if load is None:  # another Snakemake: slower, not wrong
        return

    @functools.cache
    def schema(path: str, mtime_ns: int) -> Any:
        return load(path, filetype="Schema")

    def cached(source: Any, filetype: str = "Config") -> Any:
        if filetype == "Schema" and isinstance(source, (str, Path)) and Path(source).is_file():
            return copy.deepcopy(schema(str(Path(source).resolve()), Path(source).stat().st_mtime_ns))
        return load(source, filetype=filetype)

    snakemake.utils._load_configfile = cached


class Planner:
    def __init__(self, workdir: Path, configfiles: list[str]) -> None:
        self.workdir = workdir
        self.configfiles = [workdir / f for f in configfiles]
        self.profile = yaml.safe_load((workdir / "profiles/default/config.yaml").read_text())

    def run(self, config: dict[str, Any], executor: str, forcerun: list[str] | None = None,
            forceall: bool = False) -> dict[str, Any]:
        with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
            wf = api.workflow(
                # the profile's pools on a machine of 8 GPUs (sglang.tp and replicas change the GPUs a job needs)
                resource_settings=ResourceSettings(cores=2, resources={**self.profile["resources"], "gpu": 8}),
                config_settings=ConfigSettings(configfiles=self.configfiles, config=config),
                snakefile=self.workdir / "Snakefile",
                workdir=self.workdir,
            )
            rules = sorted(rule.name for rule in wf._workflow.rules)
            dag = wf.dag(DAGSettings(
                forcerun=frozenset(r for r in forcerun or () if r in rules),
                forceall=forceall,
                rerun_triggers=frozenset(RerunTrigger.parse_choices_set(self.profile["rerun-triggers"])),
            ))
            dag.execute_workflow(executor=executor, execution_settings=ExecutionSettings(lock=False))
            d = wf._workflow.dag
            # a dry run marks the jobs it would run finished: the plan is both
            plan = Counter(job.rule.name for job in chain(d.needrun_jobs(), d.finished_jobs))
            missing = sorted({str(f) for job in d.jobs for f in job.output if not Path(f).exists()})
        return {"plan": dict(sorted(plan.items())), "rules": rules, "missing": missing}

    def plan(self, config: dict[str, Any], forcerun: list[str] | None = None) -> dict[str, Any]:
        out = self.run(config, "dryrun", forcerun)
        del out["missing"]
        return out

    def touch(self, config: dict[str, Any]) -> dict[str, Any]:
        """--touch, with the outputs it cannot touch (missing ones) made first, empty: a missing ancient()
        input would count as updated, a missing intermediate one as nothing."""
        for name in self.run(config, "dryrun")["missing"]:
            path = self.workdir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        # every job's outputs, in the DAG's order, each recorded as made (a job that had not to run, too)
        out = self.run(config, "touch", forceall=True)
        del out["missing"]
        return out


def main() -> None:
    parse_schemas_once()
    planner = Planner(Path(sys.argv[1]).resolve(), sys.argv[2:])
    answers = sys.stdout
    sys.stdout = sys.stderr  # whatever the workflow prints stays off the answers
    for line in sys.stdin:
        request = json.loads(line)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                if "touch" in request:
                    out = planner.touch(request["touch"])
                else:
                    out = planner.plan(request["plan"], request.get("forcerun"))
        except (Exception, SystemExit) as e:  # noqa: BLE001 - answered: the test names the request
            out = {"error": "".join(traceback.format_exception_only(e)).strip()[-3000:]}
        answers.write(json.dumps(out) + "\n")
        answers.flush()
    os._exit(0)  # at once: Snakemake's leftovers take seconds to wind down


if __name__ == "__main__":
    main()
