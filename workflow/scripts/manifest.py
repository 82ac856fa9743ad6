"""Rule manifest: dataset.json (shards, counts, checksums, provenance); the per-chunk files of chunks an earlier
configuration of more chunks left are removed first."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1)

from pathlib import Path

from hsextract.atomic import write_json_atomic
from hsextract.config.settings import from_config
from hsextract.report.manifest import build_manifest, remove_stale_chunks

remove_stale_chunks(Path(snakemake.output.manifest).parent, len(snakemake.input.shards))
manifest = build_manifest(
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
write_json_atomic(snakemake.output.manifest, manifest)
print(f"{manifest['counts']}")
