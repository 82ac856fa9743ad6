"""Rule aggregate_stats: tables (TSV, and HTML for the report), validation summary, token frequencies,
the RMS plot."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")

from hsextract.report.aggregate import write_aggregate

summary = write_aggregate(
    snakemake.input.prepare, snakemake.input.chunks, snakemake.input.validation, snakemake.output
)
print(summary.to_string())
