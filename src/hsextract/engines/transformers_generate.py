"""The transformers generator: `model.generate` in-process, batched with left padding (regenerate's default).

Greedy when temperature is 0; otherwise every row samples with its own torch.Generator seeded per prompt,
so a prompt's output does not depend on the batch it lands in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hsextract.engines.base import SamplingSettings, cut_at_stop
from hsextract.errors import EngineError


def _filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, top-k, top-p (nucleus: the smallest set whose probability reaches top_p) on one row."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token already enough
        logits = logits.clone()
        logits[order[drop]] = -math.inf
    return logits


class _SeededSampler:
    """A logits processor that samples each row with its own torch.Generator and leaves only the drawn token:
    `generate` in greedy mode then picks exactly that token. Rows draw independently of each other."""

    def __init__(self, seeds: list[int], temperature: float, top_k: int, top_p: float) -> None:
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, -math.inf)
        for b, gen in enumerate(self.gens):
            logits = _filter_logits(scores[b].detach().cpu(), self.temperature, self.top_k, self.top_p)
            tok = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
            out[b, int(tok)] = 0.0
        return out


class TransformersGenerator:
    """`model.generate` in-process, batched with left padding; greedy when temperature is 0."""

    def __init__(self, model: Any, settings: SamplingSettings, stop_token_ids: Sequence[int],
                 pad_token_id: int | None = None) -> None:
        self.model = model
        self.settings = settings
        self.stop_ids = list(stop_token_ids)
        self.pad_id = self.stop_ids[0] if pad_token_id is None else pad_token_id

    def _generation_config(self) -> Any:
        from transformers import GenerationConfig

        # A fresh config, also set on the model: generate() fills unset fields from model.generation_config,
        # and a checkpoint's generation_config.json (do_sample, temperature, repetition_penalty...) must not
        # change what the `regenerate` settings ask for.
        gc = GenerationConfig(max_new_tokens=self.settings.max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=self.stop_ids, pad_token_id=self.pad_id, use_cache=True)
        self.model.generation_config = gc
        return gc

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], seeds: list[int] | None = None) -> list[list[int]]:
        out: list[list[int]] = []
        bs = self.settings.batch_size
        for i in range(0, len(prompts), bs):
            out.extend(self._batch(prompts[i:i + bs], None if seeds is None else seeds[i:i + bs]))
        return out

    def _batch(self, prompts: list[list[int]], seeds: list[int] | None) -> list[list[int]]:
        if any(not p for p in prompts):
            raise EngineError("regenerate: an empty prompt cannot be generated from")
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, width - len(p):] = 1
        kwargs: dict[str, Any] = {}
        if self.settings.temperature > 0:
            from transformers import LogitsProcessorList

            row_seeds = seeds if seeds is not None else [self.settings.seed] * len(prompts)
            kwargs["logits_processor"] = LogitsProcessorList([_SeededSampler(
                row_seeds, self.settings.temperature, self.settings.top_k, self.settings.top_p)])
        try:
            gen = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      generation_config=self._generation_config(), **kwargs)
        except Exception as e:
            raise EngineError(f"regenerate: transformers generate failed on a batch of {len(prompts)} prompts "
                              f"(longest {width} tokens): {e}") from e
        gen = gen[:, width:].cpu().tolist()
        return [cut_at_stop(g, self.stop_ids) for g in gen]
