"""The engine interface: token ids in, per-sample hidden states out.

Layer convention (DESIGN.md): aux layer id i is the *output of decoder layer i*, i.e.
transformers' hidden_states[i+1] and SGLang's capture index i+1. The last tensor is the
last decoder layer's output, after the final norm (`post_norm`) or before it (`pre_norm`).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

FinalState = Literal["post_norm", "pre_norm", "both"]
# "both": the pre-norm then the post-norm state of the same forward (len(aux_layers) + 2 tensors). A
# diagnostic of the fidelity benchmark (bench/gpu/fidelity.py), not a config or shard value.
BOTH = "both"


@dataclass(frozen=True)
class CaptureSpec:
    aux_layers: tuple[int, ...]
    final_state: FinalState = "post_norm"

    @property
    def num_tensors(self) -> int:
        return len(self.aux_layers) + (2 if self.final_state == BOTH else 1)


@dataclass(frozen=True)
class Prompt:
    """One tokenized sample to run through the target model."""

    index: int  # position in its chunk; engines yield results in this order
    sample_id: str  # stable id from prepare (also the SGLang rid suffix)
    input_ids: list[int]


@dataclass
class Captured:
    """One sample's captured activations: len(aux_layers)+1 tensors of [seq, hidden], model dtype, CPU."""

    index: int
    sample_id: str
    hidden_states: list[torch.Tensor]


class Engine(abc.ABC):
    name: str

    @abc.abstractmethod
    def version(self) -> str:
        """Engine and library versions, recorded in every shard."""

    @abc.abstractmethod
    def extract(self, prompts: Iterable[Prompt]) -> Iterator[Captured]:
        """Yield one Captured per prompt, in the order of `prompts`."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release the model or the server connection."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
