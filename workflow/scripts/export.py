"""Rule export: the run's shards rewritten in another trainer's layout (config key export_formats)."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")

from hsextract.atomic import exit_on_sigterm

exit_on_sigterm()  # a stopped job removes its temporary output

from pathlib import Path

from hsextract.export import export

summary = export(
    Path(snakemake.input.manifest).parent,
    snakemake.output.data,
    snakemake.wildcards.format,
    force=True,
)
print(summary)
