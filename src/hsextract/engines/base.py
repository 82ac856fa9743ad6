"""The engine interfaces: `Engine` (token ids in, per-sample hidden states out) and `Generator` (token ids
in, generated token ids out; used by `regenerate`).

Layer convention (hsextract.layers): aux layer id i is transformers' `hidden_states[i]`, the input of
decoder layer i (the output of layer i-1), SGLang's capture index i and vLLM's aux layer id i. The last
tensor is the last decoder layer's output, after the final norm (`post_norm`) or before it (`pre_norm`).
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from hsextract.errors import EngineError

FinalState = Literal["post_norm", "pre_norm", "both"]
# "both": the pre-norm then the post-norm state of the same forward (len(aux_layers) + 2 tensors). A
# diagnostic of the fidelity benchmark (bench/gpu/fidelity.py), not a config or shard value.
BOTH = "both"


@dataclass(frozen=True)
class CaptureSpec:
    aux_layers: tuple[int, ...]
    # no default: pre_norm is what speculators reads, post_norm what SpecForge does; choosing must be explicit
    final_state: FinalState

    @property
    def num_tensors(self) -> int:
        return len(self.aux_layers) + (2 if self.final_state == BOTH else 1)


@dataclass(frozen=True)
class Prompt:
    """One tokenized sample to run through the target model."""

    index: int  # position in its chunk; engines yield results in this order
    sample_id: str  # stable id from prepare (also the SGLang rid suffix)
    input_ids: list[int]
    # shared prefixes (docs/SHARED_PREFIX.md): the earlier prompt (its index) whose first `prefix_len` tokens
    # equal this one's; an engine may then compute only the positions from `prefix_len` on (Captured.start)
    parent: int = -1
    prefix_len: int = 0


@dataclass
class Captured:
    """One sample's captured activations: len(aux_layers)+1 tensors of [seq - start, hidden], model dtype, CPU."""

    index: int
    sample_id: str
    hidden_states: list[torch.Tensor]
    # the position of the first row: > 0 when the rows before it are the prompt's parent's (Prompt.parent), and
    # then at most Prompt.prefix_len (the transformers engine: exactly; SGLang: its radix-cache hit)
    start: int = 0


def check_references(prompts: Sequence[Prompt]) -> Counter[int]:
    """EngineError unless every reference names an earlier prompt whose ids agree over the prefix; returns
    how many later prompts use each parent (by its index)."""
    seen: dict[int, Prompt] = {}
    users: Counter[int] = Counter()
    for p in prompts:
        if p.parent >= 0 or p.prefix_len:
            where = f"sample {p.sample_id!r} (index {p.index})"
            parent = seen.get(p.parent)
            if parent is None:
                raise EngineError(f"{where}: parent {p.parent} is not an earlier prompt of this chunk")
            top = min(len(parent.input_ids), len(p.input_ids) - 1)
            if not 1 <= p.prefix_len <= top:
                raise EngineError(f"{where}: prefix_len {p.prefix_len} outside [1, {top}] (parent "
                                  f"{parent.sample_id!r} has {len(parent.input_ids)} tokens, this one "
                                  f"{len(p.input_ids)})")
            if p.input_ids[:p.prefix_len] != parent.input_ids[:p.prefix_len]:
                raise EngineError(f"{where}: its first {p.prefix_len} token ids differ from its parent "
                                  f"{parent.sample_id!r}'s; prepare's references are stale: rerun prepare")
            users[p.parent] += 1
        seen[p.index] = p
    return users


class Engine(abc.ABC):
    name: str

    @abc.abstractmethod
    def version(self) -> str:
        """Engine and library versions, recorded in every shard."""

    @abc.abstractmethod
    def extract(self, prompts: Iterable[Prompt]) -> Iterator[Captured]:
        """Yield one Captured per prompt, in the order of `prompts`."""

    def close(self) -> None:  # noqa: B027 - optional: a no-op for engines with nothing to release
        """Release the model or the server connection."""

    def lost_prefixes(self) -> str:
        """Why a sample may be computed from an earlier position than its prefix length (its parent's keys and
        values no longer cached), said where that happened; "" for an engine that never does."""
        return ""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SamplingSettings(Protocol):
    """What a generator reads from its settings (`hsextract.config.settings.RegenerateSettings` has these fields)."""

    temperature: float  # 0: greedy
    top_p: float
    top_k: int  # 0: off
    max_new_tokens: int
    seed: int
    batch_size: int  # prompts per forward (transformers) or requests in flight (sglang)


class Generator(Protocol):
    """Token ids in, generated token ids out, in order. An output ends with a stop token when the
    generation stopped on one (nothing after it, see `cut_at_stop`), otherwise it hit max_new_tokens.
    `seeds`, one per prompt, make sampling reproducible whatever the batching."""

    def generate(self, prompts: list[list[int]], seeds: list[int] | None = None) -> list[list[int]]: ...


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """Ids up to and including the first stop id (all of them when none occurs)."""
    stops = set(stop_ids)
    for k, t in enumerate(ids):
        if t in stops:
            return list(ids[:k + 1])
    return list(ids)
