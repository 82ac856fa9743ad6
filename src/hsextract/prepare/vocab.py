"""Token frequencies over trained tokens: token_freq.pt, the one writer of it (prepare, stats and the exports).

Format of speculators 0.4.0: `torch.save(dict[int token_id, int count])`, counted only where loss_mask == 1. The
trainer builds its draft vocabulary (d2t / t2d) from this file itself (`speculators/train/vocab_mapping.py`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from hsextract.atomic import write_atomic


def token_freq(samples: Iterable[tuple[Sequence[int], Sequence[int]]]) -> dict[int, int]:
    """Counts of token ids at trained positions, over (input_ids, loss_mask) pairs."""
    freq: Counter[int] = Counter()
    for ids, mask in samples:
        if len(ids) != len(mask):
            raise ValueError(f"input_ids ({len(ids)}) and loss_mask ({len(mask)}) differ in length")
        freq.update(int(t) for t, m in zip(ids, mask, strict=True) if m)
    return dict(freq)


def save_token_freq(freq: dict[int, int], path: str | os.PathLike[str]) -> None:
    """torch.save of a plain {int: int} dict (loadable with weights_only=True), written atomically."""
    data = {int(k): int(v) for k, v in freq.items()}
    write_atomic(path, lambda f: torch.save(data, f))


__all__ = ["save_token_freq", "token_freq"]
