"""Rule extract: one chunk of prompts through the engine into one shard."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1)  # noqa: F821

import json

import torch

from hsextract.extract import run_extract
from hsextract.settings import from_config

# CPU engines use exactly the job's threads (Snakemake schedules by them).
torch.set_num_threads(int(snakemake.threads))  # noqa: F821
summary = run_extract(
    from_config(snakemake.config).extract,  # noqa: F821
    snakemake.input.prompts,  # noqa: F821
    snakemake.output.shard,  # noqa: F821
    chunk=int(snakemake.params.chunk),  # noqa: F821
    prepare_summary=snakemake.input.prepare_summary,  # noqa: F821
)
print(json.dumps(summary, indent=1))
