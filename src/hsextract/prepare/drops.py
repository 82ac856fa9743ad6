"""What prepare drops, and in which unit: a whole input record (malformed, a duplicate, refused by the chat
template: every sample it would give), or one sample of a record (split_turns gives several) that fails a filter.
The summary's `dropped` counts both by reason; counts that add them up keep the units apart."""

from __future__ import annotations

from collections.abc import Mapping

TOO_LONG = "too_long"
NO_TRAINED_TOKENS = "no_trained_tokens"
TRUNCATED_UNTRAINED = "truncated_untrained"  # cut to max_seq_len, which left fewer than min_trained_tokens
DUPLICATE = "duplicate"
# a sample equal (ids and mask) to one of another record: per-turn samples of agentic data recorded step by step
# (record k+1 = record k and one more turn) repeat every turn of the record before
DUPLICATE_SAMPLE = "duplicate_sample"
# the filters applied to each sample; every other reason drops a record
SAMPLE_REASONS = frozenset({TOO_LONG, NO_TRAINED_TOKENS, TRUNCATED_UNTRAINED, DUPLICATE_SAMPLE})


def unit(reason: str) -> str:
    return "sample" if reason in SAMPLE_REASONS else "record"


def totals(dropped: Mapping[str, int]) -> dict[str, int]:
    """{"dropped_records": ..., "dropped_samples": ...} of a summary's `dropped` counts."""
    out = {"dropped_records": 0, "dropped_samples": 0}
    for reason, n in dropped.items():
        out[f"dropped_{unit(reason)}s"] += int(n)
    return out
