"""Rule manifest: dataset.json (shards, counts, checksums, provenance); the per-chunk files of chunks an earlier
configuration of more chunks left are removed first."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")

from hsextract.config.settings import from_config
from hsextract.report.manifest import write_manifest

manifest = write_manifest(
    from_config(snakemake.config),
    shards=list(snakemake.input.shards),
    validation=list(snakemake.input.validation),
    chunk_stats=list(snakemake.input.chunk_stats),
    prompts=list(snakemake.input.prompts),
    prepare_summary=snakemake.input.prepare,
    token_freq=snakemake.input.token_freq,
    out_path=snakemake.output.manifest,
    lock=snakemake.params.lock,
)
print(f"{manifest['counts']}")
