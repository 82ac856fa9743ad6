"""Rule validate: check one shard against the reference sample; fail on any error."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1)

import json

from hsextract.atomic import write_json_atomic
from hsextract.errors import ValidationFailure
from hsextract.report.validate import failure_line, validate_shard

report = validate_shard(
    snakemake.input.shard,
    snakemake.input.reference,
    same_model=bool(snakemake.params.same_model),
)
print(json.dumps(report, indent=1))
if not report["passed"]:
    # no report file: the chunk counts as failed and reruns (delete its shard to re-extract it)
    raise ValidationFailure(failure_line(report, advice=True))
write_json_atomic(snakemake.output.report, report)
