"""Rule make_tiny_model: build the embedded default's random-weight model and tokenizer."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")

from hsextract.tinymodel.build import make_tiny_model

summary = make_tiny_model(
    snakemake.output.model,
    snakemake.input.conversations,
    seed=int(snakemake.params.settings["seed"]),
    tokenizer=snakemake.params.settings["tiny_model_tokenizer"],
)
print(f"tiny model written to {snakemake.output.model}: {summary}")
