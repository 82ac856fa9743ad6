"""Rule manifest: dataset.json (shards, counts, checksums, provenance)."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1)  # noqa: F821

from hsextract.atomic import write_json_atomic
from hsextract.manifest import build_manifest
from hsextract.settings import from_config

manifest = build_manifest(
    from_config(snakemake.config),  # noqa: F821
    shards=list(snakemake.input.shards),  # noqa: F821
    validation=list(snakemake.input.validation),  # noqa: F821
    chunk_stats=list(snakemake.input.chunk_stats),  # noqa: F821
    prepare_summary=snakemake.input.prepare,  # noqa: F821
    token_freq=snakemake.input.token_freq,  # noqa: F821
    out_path=snakemake.output.manifest,  # noqa: F821
    lock=snakemake.params.lock,  # noqa: F821
)
write_json_atomic(snakemake.output.manifest, manifest)  # noqa: F821
print(f"{manifest['counts']}")
