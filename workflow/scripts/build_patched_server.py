"""Rule build_patched_server: install the plugin into the server's Python, check SGLang, write patched.json."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1)  # noqa: F821

from hsextract.sglang.config import build_patched

info = build_patched(
    dict(snakemake.config),  # noqa: F821
    snakemake.output.patched,  # noqa: F821
    repo=snakemake.params.repo,  # noqa: F821
    # null: this job's interpreter (the envs/sglang.yaml environment under --sdm conda)
    python=snakemake.params.python or sys.executable,  # noqa: F821
)
print(info)
