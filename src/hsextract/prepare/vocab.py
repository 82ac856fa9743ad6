"""Token frequencies over trained tokens and the draft vocabulary mapping (d2t / t2d).

Formats follow speculators 0.4.0 (`speculators/train/vocab_mapping.py`):
- token_freq.pt: `torch.save(dict[int token_id, int count])`, counted only where loss_mask == 1.
- d2t: int64 [draft_vocab_size], an OFFSET: target_id = draft_idx + d2t[draft_idx].
- t2d: bool [target_vocab_size], True for target ids that are in the draft vocabulary.
Selection: the draft_vocab_size most frequent ids (ties broken by the smaller id); if fewer ids were seen,
filled with the smallest ids 0, 1, ... not yet selected; the selected ids are sorted ascending.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence

import pyarrow.parquet as pq
import torch

from hsextract.atomic import write_atomic
from hsextract.errors import ConfigError


def token_freq(samples: Iterable[tuple[Sequence[int], Sequence[int]]]) -> dict[int, int]:
    """Counts of token ids at trained positions, over (input_ids, loss_mask) pairs."""
    freq: Counter[int] = Counter()
    for ids, mask in samples:
        if len(ids) != len(mask):
            raise ValueError(f"input_ids ({len(ids)}) and loss_mask ({len(mask)}) differ in length")
        freq.update(int(t) for t, m in zip(ids, mask, strict=True) if m)
    return dict(freq)


def token_freq_from_prompts(paths: Iterable[str | os.PathLike[str]]) -> dict[int, int]:
    """token_freq over prompts parquet chunks (columns input_ids, loss_mask)."""
    total: Counter[int] = Counter()
    for p in paths:
        table = pq.read_table(p, columns=["input_ids", "loss_mask"])
        ids, masks = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
        total.update(token_freq(zip(ids, masks, strict=True)))
    return dict(total)


def save_token_freq(freq: dict[int, int], path: str | os.PathLike[str]) -> None:
    """torch.save of a plain {int: int} dict (loadable with weights_only=True), written atomically."""
    data = {int(k): int(v) for k, v in freq.items()}
    write_atomic(path, lambda f: torch.save(data, f))


def load_token_freq(path: str | os.PathLike[str]) -> dict[int, int]:
    data = torch.load(path, weights_only=True)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a dict of token id -> count, got {type(data).__name__}")
    return {int(k): int(v) for k, v in data.items()}


def build_vocab_mapping(token_freq: dict[int, int], target_vocab_size: int,
                        draft_vocab_size: int = 32000) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft_vocab_size] offsets, t2d bool [target_vocab_size]), as speculators 0.4.0 computes."""
    if draft_vocab_size <= 0 or target_vocab_size <= 0:
        raise ConfigError(f"vocab sizes must be positive (draft {draft_vocab_size}, target {target_vocab_size})")
    if draft_vocab_size > target_vocab_size:
        raise ConfigError(f"draft_vocab_size {draft_vocab_size} exceeds target_vocab_size {target_vocab_size}")
    bad = [t for t in token_freq if not 0 <= t < target_vocab_size]
    if bad:
        raise ConfigError(f"token ids {sorted(bad)[:5]} are outside the target vocabulary [0, {target_vocab_size})")
    ranked = sorted(token_freq.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [t for t, _ in ranked[:draft_vocab_size]]
    if len(chosen) < draft_vocab_size:
        seen = set(chosen)
        fill = (t for t in range(target_vocab_size) if t not in seen)
        chosen.extend(next(fill) for _ in range(draft_vocab_size - len(chosen)))
    chosen.sort()
    ids = torch.tensor(chosen, dtype=torch.long)
    d2t = ids - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


__all__ = ["build_vocab_mapping", "load_token_freq", "save_token_freq", "token_freq", "token_freq_from_prompts"]
