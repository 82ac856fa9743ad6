"""The transformers engine: an in-process forward, CPU or GPU; the numerical reference.

What the installed transformers does (verified on 5.24.0 with DeepseekV3, see
tests/test_transformers_engine.py): `output_hidden_states=True` returns num_layers + 1
tensors, `hidden_states[0]` the embeddings and `hidden_states[i+1]` the output of decoder
layer i, EXCEPT the last entry, which transformers replaces with the output of the final
norm (`capture_outputs(tie_last_hidden_states=True)`; transformers 4.x appended the normed
state last as well). The last decoder layer's own (pre-norm) output is not in the tuple.

Aux ids are hidden_states indices (hsextract.layers), so this engine takes aux id i from
`hidden_states[i]` (i < num_layers: the tuple's entries before its replaced last one) and gets
the last layer's output from forward hooks: on the last decoder layer (pre-norm) and on the
final norm module (post-norm). It runs the backbone (`model.model`), not the lm_head: logits
are never needed.

Batching is sort-free: consecutive prompts are grouped while batch_size * max_len stays
within `token_budget` (and batch_size within `max_batch`); a prompt longer than the budget
runs alone; past ONE_FORWARD_TOKENS, in pieces of that many positions (or token_budget's, if more), each on the
keys and values of those before it (attention then holds piece x length scores, not length x length: memory grew
with the square of a long sample's length), where the model's cache holds every position (`_uncuttable`; else in
one forward; and alone, whole and without a parent's cache past the length that a rope set by the forward's length
leaves alone: `rope_by_length`). Right padding with an attention mask; position ids count from 0 in every row, so a
real token sees exactly what it would see unbatched. Each sample's rows are copied back to the CPU, contiguous, in
the model dtype; padding rows are never returned.

Shared prefixes (docs/SHARED_PREFIX.md): a prompt with a parent (`Prompt.parent`, `prefix_len` k) runs only its
tokens k..seq-1, at positions k..seq-1, on the parent's keys and values cut to k (`past_key_values`), and its
Captured holds those rows only (`start` = k). Parents keep their cache until their last child has run. Family
members run one at a time; prompts outside any family are batched as above. The kept caches hold at most
`cache_tokens` positions together (default: CACHE_BUDGET_BYTES of the model's keys and values, or CACHE_BUDGET_FACTOR
x token_budget positions if more): past that, the caches whose next child comes last are dropped (the one just
computed included), and a child whose parent's cache was dropped runs in full, as a root (`start` 0), so the shard
records the reference actually used. A model whose cache cannot be cut
to a prefix (sliding-window or linear-attention layers: `_uncuttable`) keeps none: every child runs in full.

Progress: pass `on_sample`, called with each Captured just before it is yielded (the
caller can also count the yielded samples itself).
"""

from __future__ import annotations

import copy
import inspect
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from hsextract.capture import MAX_AUX_LAYERS
from hsextract.engines.base import BOTH, Captured, CaptureSpec, Engine, Prompt, check_references
from hsextract.errors import ConfigError, EngineError

# kept parent caches: the positions of CACHE_BUDGET_FACTOR forward batches (token_budget each), or as many as
# CACHE_BUDGET_BYTES hold (measured on the first cache kept), whichever is more: a fixed rule. Positions alone cost
# a small model its sharing (an agentic turn past 4 x 1,024 tokens kept no cache for the next), bytes alone a
# large one its memory.
CACHE_BUDGET_FACTOR = 4
CACHE_BUDGET_BYTES = 1 << 30
# A prompt up to this many tokens runs in one forward whatever token_budget says: the numerics every default run
# (max_seq_len 4096) was checked with; a split rounds attention differently in bf16.
ONE_FORWARD_TOKENS = 4096
# what transformers' dynamic rope update rewrites on a rotary module (each with a layer type's prefix where rope is
# per type): its frequencies, the length they were made for, the attention scaling
_ROPE_STATE = ("inv_freq", "max_seq_len_cached", "attention_scaling")


def resolve_device(device: str) -> str:
    """The config's `device`, with "auto" resolved: cuda if available, else cpu."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not supported; use one of {sorted(_DTYPES)}.")
    return _DTYPES[name]


def _first(output: Any) -> torch.Tensor:
    # decoder layers return a tensor in transformers 5, a tuple (hidden, ...) in 4.x
    return output[0] if isinstance(output, tuple) else output


def rope_by_length(config: Any) -> tuple[str, int] | None:
    """(rope type, longest forward it leaves alone) for a rotary embedding whose frequencies transformers sets from a
    forward's largest position: dynamic NTK past max_position_embeddings (and, after a longer forward, until a
    shorter one resets it), longrope past original_max_position_embeddings. None for every other kind."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    for p in [params] if "rope_type" in params or "type" in params else [v for v in params.values()
                                                                          if isinstance(v, dict)]:
        kind = str(p.get("rope_type", p.get("type", "")))
        if "dynamic" in kind:
            return kind, int(config.max_position_embeddings)
        if kind == "longrope":
            return kind, int(p.get("original_max_position_embeddings") or config.max_position_embeddings)
    return None


def validate_capture_spec(spec: CaptureSpec, num_layers: int, model: str) -> None:
    """ConfigError unless every aux id is a distinct decoder layer of the model and final_state is known."""
    if spec.final_state not in ("post_norm", "pre_norm", BOTH):
        raise ConfigError(f"final_state: {spec.final_state!r} is not allowed; use 'post_norm' or 'pre_norm'.")
    if len(spec.aux_layers) > MAX_AUX_LAYERS:  # none is fine: capture: mtp stores the final state only
        raise ConfigError(f"aux_layers: {len(spec.aux_layers)} layers; at most {MAX_AUX_LAYERS} are supported.")
    for i in spec.aux_layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
            raise ConfigError(
                f"aux_layers: layer id {i!r} is out of range for {model}, which has {num_layers} decoder layers; "
                f"allowed ids are 0..{num_layers - 1} (id i = hidden_states[i], the output of decoder layer i-1)."
            )
    if len(set(spec.aux_layers)) != len(spec.aux_layers):
        raise ConfigError(f"aux_layers: {list(spec.aux_layers)} repeats a layer id; give each layer once.")


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        spec: CaptureSpec,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.bfloat16,
        token_budget: int = 8192,
        max_batch: int = 64,
        attn_implementation: str = "sdpa",
        on_sample: Callable[[Captured], None] | None = None,
        cache_tokens: int | None = None,
    ) -> None:
        from hsextract.extract.text_model import load_causal_lm

        if token_budget < 1:
            raise ConfigError(f"token_budget: {token_budget} must be >= 1 (tokens per forward batch).")
        if max_batch < 1:
            raise ConfigError(f"max_batch: {max_batch} must be >= 1 (prompts per forward batch).")
        if cache_tokens is not None and cache_tokens < 0:
            raise ConfigError(f"cache_tokens: {cache_tokens} must be >= 0 (positions of parent caches kept).")
        # the parents' keys and values kept for their children, in positions of all layers together (by default
        # raised to CACHE_BUDGET_BYTES' worth once a cache's bytes per position are known: _fit_caches)
        self.cache_tokens = CACHE_BUDGET_FACTOR * token_budget if cache_tokens is None else cache_tokens
        self._cache_rule = self._default_budget = cache_tokens is None
        self.peak_cached_tokens = 0  # the most positions kept at once during the last extract()
        self.no_reuse: str | None = None  # why no child can run on its parent's cache (this model's cache layers)
        self.no_pieces: str | None = None  # why a long prompt runs in one forward (this model's cache layers)
        self.model_path = str(model_path)
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = _as_dtype(dtype)
        self.token_budget = token_budget
        self.max_batch = max_batch
        self.on_sample = on_sample

        def load(attn: str) -> Any:
            # a multimodal wrapper (Kimi-K2.5): its text model, from text_config and the language_model.* weights
            return load_causal_lm(self.model_path, self.dtype, attn)

        try:
            try:
                model = load(attn_implementation)
            except ValueError as e:  # gpt-oss (attention sinks) has no sdpa path: its eager attention is the one
                if attn_implementation != "sdpa" or "attention implementation" not in str(e):
                    raise
                model = load("eager")
        except (OSError, ValueError) as e:
            raise EngineError(
                f"transformers could not load model {self.model_path!r}: {e}. Check the `model` key: a local "
                "model directory (config.json + weights) or a hub id on a machine that reaches the hub."
            ) from e
        self.model = model.to(self.device).eval()
        text_config = self.model.config.get_text_config()
        self.num_layers: int = int(text_config.num_hidden_layers)
        self.hidden_size: int = int(text_config.hidden_size)
        self.vocab_size: int = int(text_config.vocab_size)
        pad = getattr(text_config, "pad_token_id", None)
        self.pad_id: int = int(pad) if pad is not None else 0
        validate_capture_spec(spec, self.num_layers, self.model_path)

        self._backbone = getattr(self.model, self.model.base_model_prefix, None)
        layers = getattr(self._backbone, "layers", None)
        norm = getattr(self._backbone, "norm", None)
        if layers is None or norm is None or len(layers) < self.num_layers:
            raise EngineError(
                f"{self.model_path}: {type(self.model).__name__} has no `{self.model.base_model_prefix}.layers` "
                "and `.norm` modules; the transformers engine hooks those to capture the last layer's output. "
                "Use a decoder-only model of the Llama/DeepSeek family."
            )
        # the forward's cache argument: `cache` from transformers 5.25 on, `past_key_values` before
        self._cache_kw = "cache" if "cache" in inspect.signature(self._backbone.forward).parameters \
            else "past_key_values"
        # a rope set by a forward's length: a sample past `limit` runs alone and whole (no batch-mates, pieces or
        # parent cache change its frequencies), and dynamic NTK's frequencies go back to the loaded ones before each
        # forward (transformers keeps a longer forward's until a forward within the limit): each sample as if alone
        self.rope_limit: int | None = None
        self._rope_state: list[tuple[torch.nn.Module, dict[str, Any]]] = []
        if (rope := rope_by_length(text_config)) is not None:
            kind, self.rope_limit = rope
            # every frequency buffer and length the update rewrites (one set per layer type where rope is per type)
            self._rope_state = [(m, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in
                                     [*m._buffers.items(), *vars(m).items()]
                                     if k.endswith(_ROPE_STATE)})
                                for m in self.model.modules() if "dynamic" in str(getattr(m, "rope_type", ""))]
            print(f"NOTE: {self.model_path}: its rope_type {kind!r} sets the rotary frequencies from a forward's "
                  f"length: samples over {self.rope_limit} tokens run alone and in one forward, without a parent's "
                  "cache", flush=True)
            if not self._rope_state and "dynamic" in kind:
                print(f"WARNING: {self.model_path}: no rotary module with a dynamic rope_type found to reset before "
                      "each forward: a sample after a longer one may get the longer one's frequencies (a model class "
                      f"this engine was not checked with). Keep every sample within {self.rope_limit} tokens "
                      "(`max_seq_len`), or use `engine: sglang`", flush=True)
        self._captured: dict[str, torch.Tensor] = {}
        self._hooks = [
            layers[self.num_layers - 1].register_forward_hook(self._hook("pre_norm")),
            norm.register_forward_hook(self._hook("post_norm")),
        ]

    def _hook(self, key: str) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            self._captured[key] = _first(output)

        return hook

    def version(self) -> str:
        import transformers

        return f"transformers {transformers.__version__} / torch {torch.__version__}"

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._captured.clear()

    # ------------------------------------------------------------------ batching
    def _check(self, p: Prompt) -> None:
        if len(p.input_ids) == 0:
            raise EngineError(
                f"sample {p.sample_id!r} (index {p.index}): input_ids is empty; a sample needs at least one "
                "token. Filter empty conversations in prepare."
            )
        lo, hi = min(p.input_ids), max(p.input_ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise EngineError(
                f"sample {p.sample_id!r} (index {p.index}): token id {bad} is outside the model's vocabulary "
                f"0..{self.vocab_size - 1}; the prompts were tokenized with another tokenizer than {self.model_path}."
            )

    def _alone(self, n: int) -> bool:
        """A sample of n tokens whose rope frequencies its batch-mates, pieces or parent would change."""
        return self.rope_limit is not None and n > self.rope_limit

    def _batches(self, prompts: Iterable[Prompt]) -> Iterator[list[Prompt]]:
        batch: list[Prompt] = []
        longest = 0
        for p in prompts:
            self._check(p)
            n = len(p.input_ids)
            grown = max(longest, n)
            if batch and ((len(batch) + 1) * grown > self.token_budget or len(batch) >= self.max_batch
                          or self._alone(grown)):
                yield batch
                batch, grown = [], n
            batch.append(p)
            longest = grown
        if batch:
            yield batch

    # ------------------------------------------------------------------ forward
    def _run(self, prompts: list[Prompt]) -> Iterator[Captured]:
        """Batches of the prompts; a prompt past ONE_FORWARD_TOKENS alone, in pieces (_forward_one)."""
        for batch in self._batches(prompts):
            if len(batch) == 1 and len(batch[0].input_ids) > ONE_FORWARD_TOKENS:
                yield self._forward_one(batch[0], None, keep=False)[0]
            else:
                yield from self._forward(batch)

    @torch.inference_mode()
    def _forward(self, batch: list[Prompt]) -> list[Captured]:
        lengths = [len(p.input_ids) for p in batch]
        width = max(lengths)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, : lengths[row]] = torch.tensor(p.input_ids, dtype=torch.long)
            mask[row, : lengths[row]] = 1
        self._captured.clear()
        self._loaded_rope()
        try:
            out = self._backbone(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                output_hidden_states=True,
                use_cache=False,
                return_dict=True,
            )
        except RuntimeError as e:  # includes torch.OutOfMemoryError
            names = ", ".join(repr(p.sample_id) for p in batch[:4]) + (" ..." if len(batch) > 4 else "")
            raise EngineError(
                f"forward failed on a batch of {len(batch)} samples x {width} tokens ({names}): {e}. "
                "If it ran out of memory, lower token_budget or max_batch."
            ) from e
        layers = self._layers(out)
        results = []
        for row, p in enumerate(batch):
            n = lengths[row]
            # copy=True: a view would keep the whole padded batch alive behind each sample
            tensors = [t[row, :n].to("cpu", copy=True).contiguous() for t in layers]
            results.append(Captured(index=p.index, sample_id=p.sample_id, hidden_states=tensors))
        return results

    def _loaded_rope(self) -> None:
        for m, state in self._rope_state:
            for k in [k for k in vars(m) if k.endswith(_ROPE_STATE) and k not in state]:
                delattr(m, k)  # set by a forward since (a layer type's own cached length)
            for k, v in state.items():
                setattr(m, k, v.to(self.device, copy=True) if isinstance(v, torch.Tensor) else v)  # kept intact

    def _layers(self, out: Any) -> list[torch.Tensor]:
        """The captured tensors of a forward's output, [batch, tokens, hidden] each, in the spec's order."""
        hs = out.hidden_states
        if hs is None or len(hs) != self.num_layers + 1:
            raise EngineError(
                f"{self.model_path}: expected {self.num_layers + 1} hidden states from output_hidden_states, got "
                f"{None if hs is None else len(hs)}; this transformers version builds them differently."
            )
        pre, post = self._captured.get("pre_norm"), self._captured.get("post_norm")
        if pre is None or post is None:
            raise EngineError(f"{self.model_path}: the last-layer/final-norm hooks did not fire during the forward.")
        finals = {"pre_norm": [pre], "post_norm": [post], BOTH: [pre, post]}[self.spec.final_state]
        self._captured.clear()
        return [hs[i] for i in self.spec.aux_layers] + finals

    # ------------------------------------------------------------------ shared prefixes
    @staticmethod
    def _uncuttable(cache: Any) -> str | None:
        """Why a parent's cache cannot be cut to a prefix (None: it can). Only full-attention layers hold every
        position's keys and values: a sliding-window layer keeps the last window's (gpt-oss, Gemma 3, Mistral), a
        linear-attention one a recurrent state (Qwen3-Next), and neither can be wound back to position k."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        if layers is None:
            return f"its {type(cache).__name__} has no per-layer keys and values"
        odd = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
        return f"its cache holds {', '.join(odd)} layers, which cannot be cut to a prefix" if odd else None

    @staticmethod
    def _prefix_cache(cache: Any, k: int) -> Any:
        """The parent's cache (`_uncuttable` None) cut to its first k positions, sharing its tensors (views): the
        child's forward appends by concatenation, which leaves the parent's tensors as they are for its other
        children."""
        cut = copy.copy(cache)
        cut.layers = []
        for layer in cache.layers:
            c = copy.copy(layer)
            c.keys, c.values = layer.keys[..., :k, :], layer.values[..., :k, :]
            cut.layers.append(c)
        return cut

    @torch.inference_mode()
    def _forward_one(self, p: Prompt, cache: Any, keep: bool) -> tuple[Captured, Any]:
        """One prompt from position `p.prefix_len` on (0 without a cache), in pieces past ONE_FORWARD_TOKENS where
        the cache can hold them all; returns its Captured and, if `keep`, its cache over all its positions."""
        n = len(p.input_ids)
        if self._alone(n):
            cache = None  # computed in full: the shard records no reference (start 0)
        k = p.prefix_len if cache is not None else 0
        piece = n if self.no_pieces or self._alone(n) or n - k <= ONE_FORWARD_TOKENS \
            else max(self.token_budget, ONE_FORWARD_TOKENS)
        pieces: list[list[torch.Tensor]] = []
        a = k
        while a < n:
            b = min(n, a + piece)
            self._captured.clear()
            self._loaded_rope()
            try:
                out = self._backbone(
                    input_ids=torch.tensor([p.input_ids[a:b]], dtype=torch.long, device=self.device),
                    position_ids=torch.arange(a, b, device=self.device)[None],
                    use_cache=keep or cache is not None or b < n,
                    output_hidden_states=True,
                    return_dict=True,
                    **{self._cache_kw: cache},
                )
            except RuntimeError as e:
                raise EngineError(f"forward failed on sample {p.sample_id!r} (tokens {a}..{b - 1} after a prefix of "
                                  f"{k}): {e}. If it ran out of memory, lower token_budget.") from e
            cache = out.cache if self._cache_kw == "cache" else out.past_key_values
            if b < n and (why := self._uncuttable(cache)):  # a window's or a recurrent state: one forward instead
                self.no_pieces = why
                print(f"NOTE: {self.model_path}: {why}; samples longer than {ONE_FORWARD_TOKENS} tokens run in one "
                      "forward, whose attention memory grows with the square of their length", flush=True)
                return self._forward_one(p, None, keep)  # k is 0: a cut parent cache was a cuttable one
            pieces.append([t[0].to("cpu", copy=True) for t in self._layers(out)])
            a = b
        tensors = [torch.cat(ts) if len(ts) > 1 else ts[0].contiguous() for ts in zip(*pieces, strict=True)]
        return Captured(index=p.index, sample_id=p.sample_id, hidden_states=tensors, start=k), cache if keep else None

    def _shared(self, prompts: list[Prompt], users: Counter[int]) -> Iterator[Captured]:
        """Prompts outside any family batched as usual; each family member alone, a child on its parent's cache
        if that was kept within `cache_tokens`, else in full."""
        children: dict[int, list[int]] = {}  # parent -> the positions (in `prompts`) of its children, in order
        for pos, p in enumerate(prompts):
            if p.parent >= 0:
                children.setdefault(p.parent, []).append(pos)
        caches: dict[int, tuple[Any, int]] = {}  # parent -> (its cache, its positions)
        plain: list[Prompt] = []
        self.peak_cached_tokens = 0
        for p in prompts:
            if p.parent < 0 and not users[p.index]:
                plain.append(p)
                continue
            yield from self._run(plain)
            plain = []
            self._check(p)
            cache = None
            if p.parent >= 0:
                children[p.parent].pop(0)
                if p.parent in caches:
                    cache = self._prefix_cache(caches[p.parent][0], p.prefix_len)
                    if not children[p.parent]:  # its last child: the parent's cache goes
                        del caches[p.parent]
            keep = bool(children.get(p.index)) and not self.no_reuse and not self._alone(len(p.input_ids))
            captured, kept = self._forward_one(p, cache, keep=keep)
            del cache
            if kept is not None and (why := self._uncuttable(kept)):
                self.no_reuse, kept = why, None
                print(f"NOTE: {self.model_path}: {why}; samples that share a prefix are computed in full and "
                      "stored whole (share_prefixes saves nothing with this engine on this model)", flush=True)
            if kept is not None:
                caches[p.index] = (kept, len(p.input_ids))
                self._fit_caches(caches, children)
            yield captured
        yield from self._run(plain)

    def _fit_caches(self, caches: dict[int, tuple[Any, int]], children: dict[int, list[int]]) -> None:
        """Drop the caches whose next child comes last until the rest hold at most `cache_tokens` positions (the
        furthest next use first: the fewest children lose their parent's cache)."""
        if self._cache_rule:  # the first cache kept gives the bytes per position
            cache, n = next(iter(caches.values()))
            per = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values)) / max(n, 1)
            self.cache_tokens = max(self.cache_tokens, int(CACHE_BUDGET_BYTES // max(per, 1)))
            self._cache_rule = False
        total = sum(n for _, n in caches.values())
        while total > self.cache_tokens:
            last = max(caches, key=lambda q: children[q][0])
            total -= caches.pop(last)[1]
        self.peak_cached_tokens = max(self.peak_cached_tokens, total)

    def lost_prefixes(self) -> str:
        rule = f" ({CACHE_BUDGET_BYTES >> 30} GiB of this model's keys and values, or {CACHE_BUDGET_FACTOR} x " \
            "transformers.token_budget if more)" if self._default_budget else ""
        return self.no_reuse or (
            f"the transformers engine keeps parents' keys and values for {self.cache_tokens:,} positions at "
            f"most{rule} and drops those whose next child comes last: families that interleave in a chunk, or long "
            "parents, lose theirs")

    def extract(self, prompts: Iterable[Prompt]) -> Iterator[Captured]:
        items = list(prompts)
        users = check_references(items)
        results = self._shared(items, users) if users else self._run(items)
        for captured in results:
            if self.on_sample is not None:
                self.on_sample(captured)
            yield captured

