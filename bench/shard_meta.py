"""Shard metadata for the benchmarks' shards, which have no real model, tokenizer or chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def placeholder_metadata(hidden_size: int, aux_layers: Sequence[int], **fields: Any) -> dict[str, Any]:
    """The keys ShardWriter requires (hsextract.shard.REQUIRED_METADATA): hashes "-", bfloat16, post-norm
    final state; `fields` set or override any key."""
    return {"model": "bench", "engine": "bench", "engine_version": "-", "aux_layers": list(aux_layers),
            "final_state": "post_norm", "hidden_size": int(hidden_size), "dtype": "bfloat16", "config_hash": "-",
            "tokenizer_hash": "-", "chat_template_hash": "-", **fields}
