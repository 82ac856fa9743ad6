"""Rule regenerate_chunk: the input records of one chunk with their assistant turns regenerated."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")

from hsextract.atomic import exit_on_sigterm

exit_on_sigterm()  # a stopped job removes its temporary output

import json

import torch

from hsextract import regenerate
from hsextract.config.settings import from_config

torch.set_num_threads(int(snakemake.threads))
stats = regenerate.run_regenerate_chunk(
    from_config(snakemake.config), int(snakemake.params.chunk), snakemake.output.conversations
)
print(json.dumps(stats, indent=1))
