"""The masker: a conversation's samples and their loss masks, one sample or one per assistant turn
(`split_turns`).

For assistant turn j:

    P_j = ids(render(conv[:j], add_generation_prompt=True))   what the server saw before generating turn j
    E_j = ids(render(conv[:j+1]))                              the turn rendered as the last message
    R   = ids(render(conv))                                    the whole conversation

The turn's own sample is P_j then the turn as E_j renders it, found there by the locator chain (locators.py:
after P_j, after history the template rewrote, after an empty reasoning block or an opener that ends P_j and
no rendering has); none finds it: the template cannot render what the server saw, and the conversation is
refused as `not_prefix_stable` (a thinking generation prompt with data that has no reasoning, or the reverse).

Turn j is *history-stable* when its own sample is also a prefix of R: R then holds exactly the context and the
tokens of turn j. Templates that rewrite history (Qwen3 and Kimi drop earlier reasoning, harmony rewrites
`<|return|>` into `<|end|>`) make later turns unstable. `split_turns` decides what to store:

    auto    one sample R when every turn is history-stable; else one sample per assistant turn:
            its own sample (exactly the server's context plus the turn), trained on turn j only
            (a template that writes no stop token: the next message's header is appended as the stop)
    always  one sample per assistant turn, always
    never   one sample R; an unstable turn is located in R by the same chain (`turns_history_fallback`:
            trained as R renders it, which is not what the server saw), or, when none finds it there, left
            untrained (`turns_unlocated`)

Splitting costs tokens: a conversation of k turns stores the context of turn j once per later turn
(roughly k/2 times the tokens of the unsplit sample).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hsextract.errors import ConfigError
from hsextract.masks.ids import is_prefix
from hsextract.masks.locators import PromptedTurn, in_rendering, own_sample
from hsextract.masks.reasoning import reasoning_from_content
from hsextract.masks.refusals import TemplateError, empty_turn, refuse_unmaskable
from hsextract.masks.rendering import TemplateRenderer
from hsextract.masks.tool_ids import kimi_call_ids
from hsextract.masks.turns import Frame, TurnSample, TurnSpan
from hsextract.prepare.conversations import Conversation

SPLIT_MODES = ("auto", "never", "always")
TRAINED_KINDS = frozenset({"reasoning", "header", "body", "eot"})


@dataclass
class MaskedSample:
    input_ids: list[int]
    loss_mask: list[int]
    text: str  # the rendering the ids come from (for a split sample: the turn rendered last, uncut)
    turn: int | None = None  # message index of the trained turn when the conversation was split
    spans: list[TurnSpan] = field(default_factory=list)

    def kinds(self, train_on_reasoning: bool, train_on_eot: bool) -> list[str]:
        """Per token: prompt (context), untrained, or the kind of trained token (for `masks --explain`)."""
        out = ["prompt"] * len(self.input_ids)
        for sp in self.spans:
            for a, b, kind in sp.labels(train_on_reasoning, train_on_eot):
                out[a:b] = [kind] * (min(b, len(out)) - a)
        return out


class ChatMasker:
    """Renders conversations with a tokenizer's chat template; `encode` returns the samples with loss masks.

    `chat_template_kwargs` are passed to every render (e.g. {"enable_thinking": False} for Qwen3,
    {"thinking": True} for Kimi-K2.5 / DeepSeek-V3.1). Any tokenizer with a chat template works.
    `stats` counts, over every `encode` call: conversations, split_conversations, samples, turns,
    turns_history_fallback, turns_unlocated, turns_after_rewritten_history, reasoning_inserted,
    reasoning_not_rendered, turns_empty (rendered as the stop token alone: not trained), turns_weight_0 (given
    `weight: 0`: context, not trained).
    """

    def __init__(self, tokenizer: Any, *, train_on_eot: bool = True, train_on_reasoning: bool = True,
                 chat_template_kwargs: dict[str, Any] | None = None, split_turns: str = "auto") -> None:
        if split_turns not in SPLIT_MODES:
            raise ConfigError(f"config key `split_turns` must be one of {list(SPLIT_MODES)}, got {split_turns!r}")
        self.tokenizer = tokenizer
        self.renderer = TemplateRenderer(tokenizer, chat_template_kwargs)
        # named templates with a `tool_use` one (Hermes, Command-R): records with tools are rendered with it, as
        # transformers and SGLang choose (SGLang passes tools only when a request has some)
        named = getattr(tokenizer, "chat_template", None)
        self.tool_renderer = (TemplateRenderer(tokenizer, chat_template_kwargs, name="tool_use")
                              if isinstance(named, dict) and "tool_use" in named else self.renderer)
        self.train_on_eot = train_on_eot
        self.train_on_reasoning = train_on_reasoning
        self.split_turns = split_turns
        self.stats: Counter[str] = Counter()

    def renderer_for(self, tools: list[Any] | None) -> TemplateRenderer:
        """The renderer of a conversation with these tools (the `tool_use` template where there is one)."""
        return self.tool_renderer if tools else self.renderer

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
               add_generation_prompt: bool = False) -> str:
        rd = self.renderer_for(tools)
        return rd.render(self._as_written(rd, messages), tools, add_generation_prompt)

    def _as_written(self, rd: TemplateRenderer, msgs: list[dict[str, Any]], count: bool = False
                    ) -> list[dict[str, Any]]:
        """msgs with tool-call ids as the model writes them, where the template renders them (tool_ids): in every
        rendering (a sample, a prompt regenerate sends, its round trip), so that they agree."""
        if not rd.facts().renders_call_ids:
            return msgs
        msgs, given = kimi_call_ids(msgs, rd.added)
        if count and given:
            self.stats["tool_call_ids_given"] += given
        return msgs

    def _mask(self, n: int, spans: list[TurnSpan]) -> list[int]:
        mask = [0] * n
        for sp in spans:
            for a, b, kind in sp.labels(self.train_on_reasoning, self.train_on_eot):
                if kind in TRAINED_KINDS:
                    mask[a:min(b, n)] = [1] * (min(b, n) - a)
        return mask

    def _own(self, conv: Conversation, j: int, r_text: str) -> _OwnTurn:
        """Turn j's own sample (`r_text`: the whole conversation rendered, the turn's frame when it is last)."""
        msgs, rd = conv.messages, self.renderer_for(conv.tools)
        turn = PromptedTurn(rd, conv, j)
        e_text = r_text if j == len(msgs) - 1 else rd.render(msgs[:j + 1], conv.tools)
        frame = Frame(msgs[:j + 1], conv.tools, j, rd.ids(e_text), last=True)
        return _OwnTurn(turn, own_sample(rd, turn, frame, self.stats), e_text)

    def turn_ids(self, conv: Conversation, j: int) -> list[int]:
        """The ids of assistant turn j's own sample: the prompt the server saw, then the turn (as `split_turns`
        stores it)."""
        conv = Conversation(self._as_written(self.renderer_for(conv.tools), conv.messages), conv.tools, conv.untrained)
        return self._own(conv, j, self.render(conv.messages[:j + 1], conv.tools)).sample.ids

    def encode(self, conv: Conversation) -> list[MaskedSample]:
        """The samples of one conversation: one, or one per assistant turn (see `split_turns`)."""
        rd = self.renderer_for(conv.tools)
        msgs = self._as_written(rd, reasoning_from_content(rd, conv.messages), count=True)
        conv = Conversation(msgs, conv.tools, conv.untrained)
        msgs, tools = conv.messages, conv.tools
        refuse_unmaskable(rd, msgs, tools)
        r_text = rd.render(msgs, tools)
        r = rd.verify(r_text)
        turns = [self._own(conv, j, r_text) for j, m in enumerate(msgs) if m["role"] == "assistant"]
        # a turn rendered as its stop token alone is not trained (it would teach the model to stop at once); a
        # conversation of such turns only is refused
        empty = {t.turn.index for t in turns if t.sample.span.generated_nothing}
        if turns and len(empty) == len(turns):
            raise empty_turn(msgs, min(empty))
        if empty:
            self.stats["turns_empty"] += len(empty)
        # turns given weight 0 stay context; a conversation of such turns only gives a sample with nothing trained
        # (prepare drops it as no_trained_tokens, unless min_trained_tokens is 0)
        weight_0 = {t.turn.index for t in turns} & conv.untrained - empty
        if weight_0:
            self.stats["turns_weight_0"] += len(weight_0)
        skip = empty | weight_0
        self.stats["conversations"] += 1
        self.stats["turns"] += len(turns)
        stable = [is_prefix(t.sample.ids, r) for t in turns]
        trained_stable = all(ok for t, ok in zip(turns, stable, strict=True) if t.turn.index not in skip)
        per_turn = len(skip) < len(turns) and (self.split_turns == "always" or
                                               (self.split_turns == "auto" and not trained_stable))
        if per_turn:
            turns = [t for t in turns if t.turn.index not in skip]
            self.stats["split_conversations"] += 1
            self.stats["samples"] += len(turns)
            split = [self._with_next_stop(rd, msgs, t.sample) for t in turns]
            self._count_reasoning(msgs, [s.span for s in split])
            return [MaskedSample(s.ids, self._mask(len(s.ids), [s.span]), t.text, t.turn.index, [s.span])
                    for t, s in zip(turns, split, strict=True)]
        spans: list[TurnSpan] = []
        facts = rd.facts()
        for t, ok in zip(turns, stable, strict=True):
            if t.turn.index in skip:
                continue
            sp = t.sample.span
            if not ok:
                frame = Frame(msgs, tools, t.turn.index, r, lo=spans[-1].end if spans else 0)
                got = in_rendering(rd, t.turn, frame)
                if got is None:
                    self.stats["turns_unlocated"] += 1
                    continue
                sp = got
                self.stats["turns_history_fallback"] += 1
            if sp.stop is None and not facts.writes_stop and sp.end < len(r) and r[sp.end] in facts.stop_ids:
                sp = sp.stopped_by_next()  # the next message's header ends the turn (GLM)
            if spans and sp.prompt_end < spans[-1].end:
                raise TemplateError(f"assistant turn {t.turn.index}: found at token {sp.prompt_end}, inside the "
                                    f"previous turn (which ends at token {spans[-1].end}); the template renders "
                                    f"turns in an order this masker cannot follow")
            spans.append(sp)
        self.stats["samples"] += 1
        self._count_reasoning(msgs, spans)
        return [MaskedSample(r, self._mask(len(r), spans), r_text, None, spans)]

    def _with_next_stop(self, rd: TemplateRenderer, msgs: list[dict[str, Any]], sample: TurnSample) -> TurnSample:
        """A turn's own sample, ending with the stop token the model wrote after it where the template writes
        none (GLM-4.5: the header of the next message, `<|user|>` or `<|observation|>`, by its role)."""
        j, sp = sample.span.index, sample.span
        nxt = dict(rd.facts().next_stops).get(msgs[j + 1]["role"]) if j + 1 < len(msgs) else None
        if sp.stop is not None or nxt is None or sp.end != len(sample.ids):
            return sample
        return TurnSample(sample.ids + [nxt], sp.stopped_by_next())

    def _count_reasoning(self, msgs: list[dict[str, Any]], stored: list[TurnSpan]) -> None:
        """Of the turns stored: those with reasoning put back, and those whose reasoning is not in the sample."""
        for sp in stored:
            if sp.reasoning_inserted:
                self.stats["reasoning_inserted"] += 1
            elif msgs[sp.index].get("reasoning_content") and not sp.reasoning_rendered:  # dropped, even when last
                self.stats["reasoning_not_rendered"] += 1


@dataclass(frozen=True)
class _OwnTurn:
    turn: PromptedTurn
    sample: TurnSample
    text: str  # the turn rendered last, uncut (MaskedSample.text of its own sample)


__all__ = ["SPLIT_MODES", "TRAINED_KINDS", "ChatMasker", "MaskedSample"]
