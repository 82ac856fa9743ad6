"""Rule regenerate_concat: the regenerated chunks joined into the conversation file prepare reads."""

import sys

sys.stderr = sys.stdout = open(snakemake.log[0], "a", buffering=1, encoding="utf-8")

from hsextract.atomic import exit_on_sigterm

exit_on_sigterm()  # a stopped job removes its temporary output

import json

from hsextract import regenerate

stats = regenerate.concat_chunks(snakemake.input.chunks, snakemake.output.conversations)
print(json.dumps(stats, indent=1))
