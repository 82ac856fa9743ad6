"""Rule validate: check one shard against the reference sample; fail on any error (no report written)."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")

from hsextract.report.validate import validate_chunk

validate_chunk(
    snakemake.input.shard,
    snakemake.input.reference,
    snakemake.output.report,
    same_model=bool(snakemake.params.same_model),
)
