"""Rule seq_length_hist: histogram of tokens and trained tokens per sample over all chunks."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")

from hsextract.report.plots import plot_seq_length_hist
from hsextract.report.stats import iter_json_files

plot_seq_length_hist(
    iter_json_files(snakemake.input.chunks),
    snakemake.output.plot,
    bins=int(snakemake.params.settings["stats.seq_len_bins"]),
)
