"""Rule build_patched_server never installs into the workflow's own environment: with sglang.python null
and no --sdm conda it stops before pip runs, saying which to set."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hsextract.errors import ConfigError
from hsextract.sglang.config import build_python

MESSAGE = (
    "sglang.python is null and the workflow runs without --sdm conda, so rule build_patched_server has "
    f"no server environment to install the plugin into (it will not touch the workflow's own, {sys.prefix}). "
    "Set sglang.python to the Python of your SGLang installation "
    "(--config 'sglang={python: /path/to/sglang/bin/python}'), or add --sdm conda to build envs/sglang.yaml."
)


def test_build_python_choices() -> None:
    assert build_python("/opt/sglang/bin/python", conda_env=False) == "/opt/sglang/bin/python"
    assert build_python("/opt/sglang/bin/python", conda_env=True) == "/opt/sglang/bin/python"
    assert build_python(None, conda_env=True) == sys.executable  # the job runs in envs/sglang.yaml
    with pytest.raises(ConfigError) as err:
        build_python(None, conda_env=False)
    assert str(err.value) == MESSAGE


@pytest.mark.slow
def test_rule_stops_before_installing_into_the_workflow_env(tmp_path: Path) -> None:
    from test_profiles import kimi_workdir
    from test_workflow import smk

    wd = kimi_workdir(tmp_path / "wd")
    target = "results/kimi-k25/server/patched.json"
    proc = smk(wd, target, "--resources", "gpu=8", check=False, configfiles=("config/kimi.yaml", "config/test.yaml"))
    assert proc.returncode != 0
    log = (wd / "logs/kimi-k25/server/build_patched_server.log").read_text()
    assert MESSAGE in log
    assert "pip" not in log.replace(MESSAGE, "")  # nothing was installed
    assert not (wd / target).exists()
