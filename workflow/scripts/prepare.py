"""Rule prepare: chat template, tokenize, loss masks, filters, chunk parquets and a summary."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1)

from pathlib import Path

from hsextract.atomic import write_json_atomic
from hsextract.config.settings import from_config
from hsextract.prepare.run import run_prepare

out_dir = Path(snakemake.output.summary).parent
# the configured sources, or the regenerated conversations (regenerate.enabled): common.smk's PREPARE_SOURCES
settings = from_config({**snakemake.config, "sources": list(snakemake.params.sources)})
summary = run_prepare(
    settings.prepare,
    snakemake.params.tokenizer,
    out_dir,
    int(snakemake.params.num_chunks),
    regenerated=settings.regenerate.enabled,
    workers=int(snakemake.threads),
)
missing = [p for p in snakemake.output.prompts if not Path(p).is_file()]
if missing:
    raise RuntimeError(f"prepare did not write {missing}")
write_json_atomic(snakemake.output.summary, summary)
print(summary)
print(f"prepared {summary['kept']} samples ({summary['tokens']} tokens) in {summary['num_chunks']} chunks, "
      f"dropped {sum(summary['dropped'].values())}")
