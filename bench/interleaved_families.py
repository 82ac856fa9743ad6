"""Interleaved families in one chunk: the transformers engine's kept-cache budget against prepare's plan.

Writes OUT/conversations.jsonl and OUT/config.yaml: 8 agentic records of bench/shared_prefix.py's kind, in one chunk
of 8 (`dedup: false`, `share_prefixes: true`), ordered so that families interleave as rollouts and copies do: a
conversation cut after its first exchange, the conversation, a copy of it; three single-turn records on the same
tool declaration; a second conversation and a cut of it. Then, with the embedded tiny model:

    PYTHONPATH=src python bench/interleaved_families.py /tmp/if
    snakemake --cores 1 --configfile config/config.yaml /tmp/if/config.yaml
    grep -h '"computed_tokens"\\|"planned_computed_tokens"\\|"lost_prefixes"' logs/interleaved-families/extract/*.log

computed_tokens = planned_computed_tokens (lost_prefixes and shortened_prefixes 0) when the engine kept every
parent's cache the plan needs; bench/README.md ("shared prefixes") has the figures.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shared_prefix  # bench/'s own generator of agentic conversations


class _Words:
    """Counts a word a token: the sizes of the generated texts need no real tokenizer."""

    def encode(self, text: str) -> list[str]:
        return text.split()


def records() -> list[dict]:
    a, b, c = shared_prefix.conversations(3, 2, 3, 200, _Words(), seed=7)
    out = [{**copy.deepcopy(a), "id": "a-cut", "messages": a["messages"][:3]}, a, {**copy.deepcopy(a), "id": "a-copy"}]
    for j in range(3):  # the system prompt and tool declaration of b, one question each
        out.append({"id": f"single{j}", "tools": b["tools"], "messages": b["messages"][:1] + [
            {"role": "user", "content": f"question {j} " * 5}, {"role": "assistant", "content": f"answer {j}"}]})
    return out + [c, {**copy.deepcopy(c), "id": "c-cut", "messages": c["messages"][:5]}]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    recs = records()
    (out / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    (out / "config.yaml").write_text(
        # a tiny model of its own: its tokenizer is trained on these records (the first source), not on data/'s
        "run_name: interleaved-families\nmodel: resources/tiny-model-interleaved-families\n"
        f"sources:\n  - {{path: {out / 'conversations.jsonl'}, format: messages}}\n"
        f"prompts_per_chunk: {len(recs)}\nshare_prefixes: true\ndedup: false\nseed: 0\n", encoding="utf-8")
    print(f"{len(recs)} records: {out / 'conversations.jsonl'}; config: {out / 'config.yaml'}")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path, help="folder for conversations.jsonl and config.yaml")
    main(ap.parse_args().out_dir)
