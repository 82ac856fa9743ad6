"""Rule validate: check one shard against the reference sample and its prompts; fail on any error."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1)  # noqa: F821

import json

from hsextract.errors import ValidationFailure
from hsextract.atomic import write_json_atomic
from hsextract.validate import validate_shard

report = validate_shard(snakemake.input.shard, snakemake.input.reference)  # noqa: F821
print(json.dumps(report, indent=1))
if not report.get("ok"):
    raise ValidationFailure(f"{snakemake.input.shard} failed validation; see {snakemake.log[0]}")  # noqa: F821
write_json_atomic(snakemake.output.report, report)  # noqa: F821
