"""Rules regenerate_chunk (one chunk of input records regenerated) and regenerate_concat (chunks joined)."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1)  # noqa: F821

import json

from hsextract import regenerate

if snakemake.rule == "regenerate_concat":  # noqa: F821
    stats = regenerate.concat_chunks(
        snakemake.input.chunks, snakemake.output.conversations  # noqa: F821
    )
else:
    import torch

    torch.set_num_threads(int(snakemake.threads))  # noqa: F821
    stats = regenerate.run_regenerate_chunk(
        dict(snakemake.config),  # noqa: F821
        int(snakemake.params.chunk),  # noqa: F821
        snakemake.output.conversations,  # noqa: F821
    )
print(json.dumps(stats, indent=1))
