"""Rule stats: the statistics of one shard."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")

from hsextract.atomic import write_json_atomic
from hsextract.report.stats import chunk_stats

stats = chunk_stats(snakemake.input.shard, position_bins=int(snakemake.params.settings["stats.position_bins"]))
write_json_atomic(snakemake.output.stats, stats)
print(f"{stats['samples']} samples, {stats['tokens']} tokens")
