"""Rule extract: one chunk of prompts through the engine into one shard."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")

from hsextract.atomic import exit_on_sigterm

exit_on_sigterm()  # a stopped job removes its temporary output

import json

import torch

from hsextract.config.settings import from_config
from hsextract.extract.run import run_extract
from hsextract.progress import quiet_library_bars

quiet_library_bars()  # this job's process only: its log gets no carriage-return bar of transformers'

# CPU engines use exactly the job's threads (Snakemake schedules by them).
torch.set_num_threads(int(snakemake.threads))
summary = run_extract(
    from_config(snakemake.config).extract,
    snakemake.input.prompts,
    snakemake.output.shard,
    chunk=int(snakemake.params.chunk),
    prepare_summary=snakemake.input.prepare_summary,
)
print(json.dumps(summary, indent=1))
