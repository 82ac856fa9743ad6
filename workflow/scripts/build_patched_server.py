"""Rule build_patched_server: install the plugin into the server's Python, check SGLang, write patched.json."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")

from hsextract.config.settings import from_config
from hsextract.sglang.config import build_patched, build_python

info = build_patched(
    from_config(snakemake.config).extract,
    snakemake.output.patched,
    repo=snakemake.params.repo,
    # sglang.python, else this job's interpreter only under --sdm conda (envs/sglang.yaml)
    python=build_python(snakemake.params.settings["sglang.python"], snakemake.params.conda_env),
)
print(info)
