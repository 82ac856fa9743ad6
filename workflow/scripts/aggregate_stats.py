"""Rule aggregate_stats: tables (TSV, and HTML for the report), validation summary, token frequencies,
the RMS plot."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1)

import json

from hsextract.report.plots import plot_rms_by_position
from hsextract.report.stats import ChunkTotals, iter_json_files, write_table, write_token_freq
from hsextract.report.tables import write_report_pages

out = snakemake.output
with open(snakemake.input.prepare) as f:
    prepare_summary = json.load(f)
# one pass, one chunk's statistics in memory at a time (thousands of chunks, each up to a vocabulary's counts)
totals = ChunkTotals(iter_json_files(snakemake.input.chunks))
tables = totals.tables(prepare_summary)
for name in ("summary", "chunks", "layers", "rms_by_position", "seq_lengths", "dropped"):
    write_table(tables[name], out[name])
write_report_pages(tables, snakemake.input.validation, {name: out[f"{name}_html"] for name in
                   ("summary", "chunks", "layers", "seq_lengths", "dropped", "validation")})
write_token_freq(totals.token_freq(), out.token_freq)
plot_rms_by_position(tables["rms_by_position"], out.rms_plot)
print(tables["summary"].to_string())
