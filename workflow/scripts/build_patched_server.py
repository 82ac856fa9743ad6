"""Rule build_patched_server: install the plugin into the server's Python, check SGLang, write patched.json."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1)  # noqa: F821

from hsextract.sglang.config import build_patched, build_python

info = build_patched(
    dict(snakemake.config),  # noqa: F821
    snakemake.output.patched,  # noqa: F821
    repo=snakemake.params.repo,  # noqa: F821
    # sglang.python, else this job's interpreter only under --sdm conda (envs/sglang.yaml)
    python=build_python(snakemake.params.python, snakemake.params.conda_env),  # noqa: F821
)
print(info)
