"""Rule make_tiny_model: build the embedded default's random-weight model and tokenizer."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1)  # noqa: F821

from hsextract.tinymodel import make_tiny_model

summary = make_tiny_model(
    snakemake.output.model,  # noqa: F821
    snakemake.input.conversations,  # noqa: F821
    seed=int(snakemake.params.seed),  # noqa: F821
    tokenizer=snakemake.params.tokenizer,  # noqa: F821
)
print(f"tiny model written to {snakemake.output.model}: {summary}")  # noqa: F821
