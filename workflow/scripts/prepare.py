"""Rule prepare: chat template, tokenize, loss masks, filters, chunk parquets and a summary."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")

from pathlib import Path

from hsextract.config.settings import from_config
from hsextract.prepare.run import run_prepare

# the configured sources, or the regenerated conversations (regenerate.enabled): common.smk's PREPARE_SOURCES
settings = from_config({**snakemake.config, "sources": list(snakemake.params.sources)})
summary = run_prepare(  # writes the prompts of every chunk, token_freq.pt and summary.json
    settings.prepare,
    snakemake.params.tokenizer,
    Path(snakemake.output.summary).parent,
    int(snakemake.params.num_chunks),
    regenerated=settings.regenerate.enabled,
    workers=int(snakemake.threads),
)
print(f"prepared {summary['kept']} samples ({summary['tokens']} tokens) in {summary['num_chunks']} chunks, "
      f"dropped {sum(summary['dropped'].values())}")
