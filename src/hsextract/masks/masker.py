"""Loss masks from the chat template itself, on token ids: which tokens of a rendered conversation are trained.

The rule (config/README.md, "Loss masks"): a token gets loss 1 exactly when the target model generates it in
that assistant turn: everything after the generation prompt up to and including its stop token (content,
tool-call markup, headers it writes itself, reasoning per `train_on_reasoning`, the stop token per
`train_on_eot`); never the generation prompt, never template text after the stop token, never a token of
another message (but for a template that writes no stop token, GLM's: the next message's header the model
wrote to stop, `<|user|>` or `<|observation|>`, is the turn's stop token). Filler a template writes for a
turn whose reasoning it does not render (an empty `<think></think>`) was not generated: not trained; but the
closer of a block the generation prompt opened, where the turn's rendering starts with it (DeepSeek-V3.1
`thinking: true`, GLM-4.7), the model wrote: trained as reasoning, in every `split_turns` mode.

Turn boundaries are found on token ids, never on character offsets, so slow tokenizers (tiktoken,
sentencepiece, custom code) work as fast ones do. For assistant turn j:

    P_j = ids(render(conv[:j], add_generation_prompt=True))   what the server saw before generating turn j
    E_j = ids(render(conv[:j+1]))                              the turn rendered as the last message

P_j must be a prefix of E_j, or the turn must be found in E_j after history the template rewrote (after the
generation prompt; for a template without one, as Mistral's, which puts the system prompt into the last user
message only, after the longest tail of P_j); otherwise the template cannot render what the server saw and
the conversation is refused with reason `not_prefix_stable` (a thinking generation prompt with data that has
no reasoning, or the reverse). `turn_spans.find_turn` then splits E_j[len(P_j):] into reasoning, header,
body, stop token and template tail. A turn whose own text holds a stop token is refused as
`stop_token_in_turn` (the model stops there: a runaway generation copied into the data), a tool-call turn
the template renders as if it had no calls as `tool_calls_not_rendered`, a tool message it drops as
`tool_results_not_rendered`.

Turn j is *history-stable* when E_j up to its last generated token is also a prefix of the full rendering
R = ids(render(conv)): R then holds exactly the context and the tokens of turn j. Templates that rewrite
history (Qwen3 and Kimi drop earlier reasoning, harmony rewrites `<|return|>` into `<|end|>`) make later
turns unstable. `split_turns` decides what to store:

    auto    one sample R when every turn is history-stable; else one sample per assistant turn:
            E_j cut after its stop token (exactly the server's context plus the turn), trained on turn j only
            (a template that writes no stop token: the next message's header is appended as the stop)
    always  one sample per assistant turn, always
    never   one sample R; an unstable turn is located in R with the same method in the full rendering
            (`turns_history_fallback`: trained as R renders it, which is not what the server saw), or, when
            P_j is not even a prefix of R, left untrained (`turns_unlocated`)

A template that never renders a turn's reasoning, even as the last message (Kimi's final answer), but keeps
the special tokens around it (`TemplateFacts.reasoning_slot`), gets the reasoning put back between them in
the split sample (`reasoning_inserted`).

Splitting costs tokens: a conversation of k turns stores the context of turn j once per later turn
(roughly k/2 times the tokens of the unsplit sample).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from hsextract.conversations import Conversation
from hsextract.errors import ConfigError
from hsextract.masks.rendering import TemplateError, TemplateRenderer, common_prefix, is_prefix
from hsextract.masks.turns import TurnSpan, find_turn, shifted

SPLIT_MODES = ("auto", "never", "always")
NOT_PREFIX_STABLE = "not_prefix_stable"
STOP_TOKEN_IN_TURN = "stop_token_in_turn"
TOOL_CALLS_NOT_RENDERED = "tool_calls_not_rendered"
TOOL_RESULTS_NOT_RENDERED = "tool_results_not_rendered"
REASONING_LEFT_OPEN = "reasoning_left_open"
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
    reasoning_not_rendered.
    """

    def __init__(self, tokenizer: Any, *, train_on_eot: bool = True, train_on_reasoning: bool = True,
                 chat_template_kwargs: dict[str, Any] | None = None, split_turns: str = "auto") -> None:
        if split_turns not in SPLIT_MODES:
            raise ConfigError(f"config key `split_turns` must be one of {list(SPLIT_MODES)}, got {split_turns!r}")
        self.tokenizer = tokenizer
        self.renderer = TemplateRenderer(tokenizer, chat_template_kwargs)
        self.train_on_eot = train_on_eot
        self.train_on_reasoning = train_on_reasoning
        self.split_turns = split_turns
        self.stats: Counter[str] = Counter()
        self._stop_texts: list[str] | None = None

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
               add_generation_prompt: bool = False) -> str:
        return self.renderer.render(messages, tools, add_generation_prompt)

    def _mask(self, n: int, spans: list[TurnSpan]) -> list[int]:
        mask = [0] * n
        for sp in spans:
            for a, b, kind in sp.labels(self.train_on_reasoning, self.train_on_eot):
                if kind in TRAINED_KINDS:
                    mask[a:min(b, n)] = [1] * (min(b, n) - a)
        return mask

    def _prompt_ids(self, conv: Conversation, j: int) -> list[int]:
        try:
            return self.renderer.render_ids(conv.messages[:j], conv.tools, add_generation_prompt=True)
        except Exception as e:
            raise TemplateError(f"assistant turn {j}: the template cannot render the conversation before it with "
                                f"a generation prompt: {e}") from e

    def _not_prefix_stable(self, j: int, p: list[int], e: list[int]) -> TemplateError:
        k = next(i for i in range(len(p)) if i >= len(e) or p[i] != e[i])
        dec = self.renderer.tokenizer.decode
        return TemplateError(
            f"assistant turn {j}: the template is not prefix-stable: the turn rendered does not start with the "
            f"generation prompt the server saw (first difference at token {k}: prompt {dec(p[k:k + 4])!r} vs "
            f"turn {dec(e[k:k + 4])!r}). Set `chat_template_kwargs` (e.g. enable_thinking / thinking) to match "
            f"the data, or fix the data's reasoning fields", reason=NOT_PREFIX_STABLE)

    def _generation_prompt(self, conv: Conversation, j: int, p: list[int]) -> list[int]:
        b = self.renderer.render_ids(conv.messages[:j], conv.tools)
        return p[len(b):] if is_prefix(b, p) else []

    def _turn(self, conv: Conversation, j: int, r_text: str) -> tuple[list[int], str, TurnSpan]:
        """(ids of the server's prompt + the turn, the turn rendered last as text, span in those ids)."""
        msgs, tools, rd = conv.messages, conv.tools, self.renderer
        p = self._prompt_ids(conv, j)
        e_text = r_text if j == len(msgs) - 1 else rd.render(msgs[:j + 1], tools)
        e = rd.ids(e_text)
        gen: list[int] = []
        if is_prefix(p, e):
            sp = find_turn(rd, msgs[:j + 1], tools, j, e, len(p), last=True)
        else:  # the template rewrote earlier turns: the turn opens with the generation prompt after them
            gen = self._generation_prompt(conv, j, p)
            sp = find_turn(rd, msgs[:j + 1], tools, j, e, None, gen, last=True, prompt=p)
            if sp is not None:
                self.stats["turns_after_rewritten_history"] += 1
        if sp is None and (k := self._closed_block(p, e, gen)) is not None:
            # the prompt ends with an empty reasoning block no rendering has (Gemma-4 with thinking off)
            sp = find_turn(rd, msgs[:j + 1], tools, j, e, None, p[len(p) - len(gen):k], last=True, prompt=p[:k])
            # what the rendering writes before the content: nothing, the block's closer again, or the whole block
            # where the prompt wrote its closer alone
            before = [] if sp is None else e[sp.prompt_end:sp.content_start]
            if sp is not None and sp.prompt_end == k and not sp.reasoning_rendered and \
                    (before == p[len(p) - len(before):] or self._whole_block(p, before)):
                ids, span = self._put_back(p, [], e, sp)
                return ids, e_text, replace(span, reasoning_rendered=False, reasoning_inserted=False)
            sp = None
        if sp is None:  # or the prompt opens a reasoning block that no rendering has (R1, QwQ)
            opened = self._opened_reasoning(conv, j, p, e, gen)
            if opened is None:
                raise self._not_prefix_stable(j, p, e)
            return opened[0], e_text, opened[1]
        slot = rd.facts().reasoning_slot
        reasoning = msgs[j].get("reasoning_content")
        if reasoning and not sp.reasoning_rendered and slot and \
                tuple(e[sp.prompt_end:sp.content_start]) == slot[0] + slot[1]:
            # The template never renders this turn's reasoning (Kimi's final answer): put it back between the
            # markup it keeps, so the sample holds what the model generated.
            ids, span = self._put_back(p, list(slot[0]) + rd.ids(reasoning) + list(slot[1]), e, sp)
            return ids, e_text, span
        self._refuse_open_block(j, p, e[sp.prompt_end:sp.end])
        return p + e[sp.prompt_end:sp.end], e_text, shifted(sp, len(p) - sp.prompt_end)

    def _refuse_open_block(self, j: int, p: list[int], turn: list[int]) -> None:
        """A prompt that ends by opening a reasoning block (`<think>\n`) and a turn, as the template renders it,
        that never closes it (a template that reads no reasoning field and renders the content right there):
        the sample would train the answer as reasoning, and the model's `</think>` nowhere."""
        rd = self.renderer
        opener = re.search(r"<([A-Za-z_][\w-]*)>\s*$", rd.text(p[-4:]))
        if opener is None or f"</{opener[1]}>" not in rd.template or f"</{opener[1]}>" in rd.text(turn):
            return
        raise TemplateError(
            f"assistant turn {j}: the generation prompt opens a reasoning block ('<{opener[1]}>') that the template "
            f"does not close in this turn, so its sample would train the answer as reasoning: give the turn its raw "
            f"text in `content` (reasoning, '</{opener[1]}>', answer), or turn thinking off with "
            f"`chat_template_kwargs`", reason=REASONING_LEFT_OPEN)

    def turn_ids(self, conv: Conversation, j: int) -> list[int]:
        """The ids of assistant turn j's own sample: the prompt the server saw, then the turn (as `split_turns`
        stores it)."""
        return self._turn(conv, j, self.renderer.render(conv.messages[:j + 1], conv.tools))[0]

    def _put_back(self, p: list[int], block: list[int], e: list[int], sp: TurnSpan) -> tuple[list[int], TurnSpan]:
        """The server's prompt p, the turn's reasoning `block` the template does not render, then the turn as
        rendered in e from its content on (span sp in e)."""
        body = e[sp.content_start:sp.end]
        start = len(p) + len(block)
        stop = None if sp.stop is None else start + sp.stop - sp.content_start
        return p + block + body, replace(sp, prompt_end=len(p), header_start=start, content_start=start, stop=stop,
                                         end=start + len(body), reasoning_rendered=True, reasoning_inserted=True)

    def _closed_block(self, p: list[int], x: list[int], gen: list[int]) -> int | None:
        """k where the end of the generation prompt, p[k:], is an empty reasoning block that x, rendered from the
        same history, lacks: two special tokens around at most a word (Gemma-4 with thinking off writes
        `<|channel>thought\n<channel|>` there, and never in a rendered turn; `<think></think>`), or a block's
        closer alone (`</think>`, where the rendering writes `<think></think>`); then at most whitespace. The
        model wrote the turn after that block, as the template renders the turn."""
        k = self._prompt_tail(p, x, gen)
        if k is None:
            return None
        special, text = self.renderer.special_ids(), self.renderer.text
        tail = p[k:]
        while tail and tail[-1] not in special and not text(tail[-1:]).strip():
            tail = tail[:-1]
        if len(tail) == 1 and tail[0] in special and self._opener_of(tail[0]) is not None:
            return k
        inner = tail[1:-1]
        if len(tail) < 2 or tail[0] not in special or tail[-1] not in special or any(t in special for t in inner) \
                or not re.fullmatch(r"\s*\w*\s*", text(inner)):
            return None
        return k

    def _whole_block(self, p: list[int], x: list[int]) -> bool:
        """x opens with the empty block whose closer alone ends the prompt p (`<think></think>` after `</think>`)."""
        return len(x) >= 2 and x[1] == p[-1] and x[0] == self._opener_of(p[-1])

    def _opener_of(self, closer: int) -> int | None:
        """The special token `<name>` of a special token `</name>`, if the tokenizer has both."""
        name = re.fullmatch(r"</([A-Za-z_][\w-]*)>", self.renderer.text([closer]))
        return None if name is None else self.renderer.added.get(f"<{name[1]}>")

    @staticmethod
    def _prompt_tail(p: list[int], x: list[int], gen: list[int]) -> int | None:
        """Where x, rendered from the same history as the prompt p, departs from it, when that is within the
        generation prompt `gen` (None: the history differs too, or there is no generation prompt)."""
        k = common_prefix(p, x)
        return None if not gen or k < len(p) - len(gen) else k

    def _reasoning_opener(self, p: list[int], x: list[int], gen: list[int]) -> tuple[re.Match[str], int] | None:
        """(the opener's match: tag, name, its trailing space; k) where the end of the generation prompt, p[k:], opens
        a reasoning block (`<think>`, its closer in the template) that x, rendered from the same history, lacks
        (or has without the whitespace after it: Nemotron-3 prompts `<think>\n`, renders `<think></think>`)."""
        k = self._prompt_tail(p, x, gen)
        if k is None:
            return None
        if k > len(p) - len(gen) and not self.renderer.text(p[k:]).strip() and p[k - 1] in self.renderer.special_ids():
            k -= 1
        opener = self.renderer.text(p[k:])
        tag = re.fullmatch(r"\s*(<([A-Za-z_][\w-]*)>)(\s*)", opener)
        return None if tag is None or f"</{tag[2]}>" not in self.renderer.template else (tag, k)

    def _opened_reasoning(self, conv: Conversation, j: int, p: list[int], e: list[int], gen: list[int]
                          ) -> tuple[list[int], TurnSpan] | None:
        """Turn j where the generation prompt opens a reasoning block (`<think>`) that no rendered assistant turn
        has (DeepSeek-R1 and QwQ cut everything up to `</think>` from the content; DeepSeek-V3.1 with `thinking`
        renders `</think>` + content): after the prompt the model wrote its reasoning, the closer and the answer.
        The reasoning is `reasoning_content`, or the content's own text before the closer; the closer and the
        answer are the turn as the template renders it. A template that never writes the closer gets it as those
        models write it: reasoning, newline, closer, blank line (unless the data's own text says otherwise).
        A turn without reasoning is the closer and the answer where the template renders such a turn so
        (GLM-4.7: `</think>` right after the header): the model wrote that closer after the prompt's opener, so
        it is trained as the reasoning block it ends (`closes_prompt_block`; `encode` does the same where
        `split_turns: never` locates the turn in the whole rendering); where it does not (R1, QwQ), nothing
        tells what the model wrote: refused.
        `gen`: the generation prompt (`_generation_prompt`). None when the turn is not such a case."""
        rd, m = self.renderer, conv.messages[j]
        opened = self._reasoning_opener(p, e, gen)
        if opened is None:
            return None
        tag, k = opened
        closer, content = f"</{tag[2]}>", m.get("content") or ""
        reasoning: str | None = None
        if m.get("reasoning_content"):
            reasoning, after = m["reasoning_content"], None
        elif closer in content:
            reasoning, after = content.split(closer, 1)
            if reasoning.lstrip().startswith(tag[1]):  # the raw text repeats the opener the prompt ends with
                reasoning = reasoning.lstrip()[len(tag[1]):].removeprefix(tag[3])
        held = p[len(p) - len(gen):k]  # the part of the generation prompt the turn rendered last has
        sp = find_turn(rd, conv.messages[:j + 1], conv.tools, j, e, None, held, last=True, prompt=p[:k])
        sp = None if sp is None else self._after_prompt_opener(sp, e, p[k])
        region = [] if sp is None else e[sp.prompt_end:sp.content_start]
        writes_closer = closer in self.renderer.text(region)
        if reasoning is None and writes_closer:  # the model closed the prompt's block at once: its own closer
            ids, span = self._put_back(p, region, e, sp)
            return ids, replace(span, reasoning_rendered=False, reasoning_inserted=False, filler_trained=False,
                                closes_prompt_block=True)
        if reasoning is None:
            raise TemplateError(
                f"assistant turn {j}: the generation prompt opens a reasoning block ({tag[1]!r}) that the template "
                f"never renders for an assistant turn, and this turn has no reasoning to fill it: give it "
                f"`reasoning_content`, or its raw text with {closer!r} in `content` (or regenerate the responses "
                f"with this model)", reason=NOT_PREFIX_STABLE)
        if sp is None:
            return None
        if writes_closer:
            return self._put_back(p, rd.ids(reasoning) + region, e, sp)
        if after is None:
            reasoning, after = reasoning.rstrip("\n") + "\n", "\n\n"
        answer = self.renderer.text(e[sp.content_start:sp.stop if sp.stop is not None else sp.end])
        gap = after[:len(after) - len(after.lstrip())]
        if answer.startswith(gap):  # the template keeps the blank line the model wrote (R1), or there is none
            gap = ""
        return self._put_back(p, rd.ids(reasoning + closer + gap), e, sp)

    @staticmethod
    def _after_prompt_opener(sp: TurnSpan, x: list[int], opener: int) -> TurnSpan:
        """sp, found in x after the part of the generation prompt x holds, starting after the reasoning opener the
        prompt ends with where x writes it there too (Nemotron-3: the prompt's `<think>\n`, the rendering's
        `<think></think>`): the prompt holds it, the model did not write it."""
        if x[sp.prompt_end:sp.prompt_end + 1] != [opener] or sp.reasoning_rendered:
            return sp
        at = sp.prompt_end + 1
        return replace(sp, prompt_end=at, header_start=max(sp.header_start, at),
                       content_start=max(sp.content_start, at))

    def _refuse_stop_tokens_inside(self, msgs: list[dict[str, Any]]) -> None:
        """An assistant turn whose own text holds a token that ends a turn (`<|im_end|>`, GLM's `<|user|>`, eos)
        was not generated as one turn: the model stops at that token. Runaway generations copied into datasets
        (an answer, `<|im_end|>`, a made-up next user turn) look like this; trained, they would teach the
        drafter to go on after the stop."""
        if self._stop_texts is None:  # once per masker: the template's stop ids, as the text they are written
            stop_ids = self.renderer.facts().stop_ids
            self._stop_texts = [t for t, i in self.renderer.added.items() if i in stop_ids]
        for j, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            for key in ("reasoning_content", "content"):
                text = m.get(key)
                hits = sorted((text.index(t), t) for t in self._stop_texts if isinstance(text, str) and t in text)
                if not hits:
                    continue
                at, hit = hits[0]
                if key == "content" and not text[at:].removeprefix(hit).strip():  # exported with its stop token
                    raise TemplateError(
                        f"assistant turn {j}: its {key} ends with {hit!r}, a token that ends a turn, which the "
                        f"template writes itself: strip it from the data", reason=STOP_TOKEN_IN_TURN)
                raise TemplateError(
                    f"assistant turn {j}: its {key} holds {hit!r} (at character {at}), a token that ends a turn: "
                    f"the model stops there, so this is not one generated turn (a runaway generation?). Cut the "
                    f"text at it, or regenerate the responses with this model", reason=STOP_TOKEN_IN_TURN)

    def _refuse_unrendered_tool_calls(self, msgs: list[dict[str, Any]], tools: Any) -> None:
        """A template without tool calls (Phi-3) renders a tool-call turn as if it had none: its sample would
        train an empty turn (the stop token right after the prompt) or the content without the calls."""
        rd = self.renderer
        for j, m in enumerate(msgs):
            if m["role"] != "assistant" or not m.get("tool_calls"):
                continue
            try:
                without = rd.render(msgs[:j] + [{k: v for k, v in m.items() if k != "tool_calls"}], tools)
            except Exception:  # noqa: BLE001 - the template needs the calls to render this turn: it renders them
                continue
            if without == rd.render(msgs[:j + 1], tools):
                what = "the content without them" if (m.get("content") or "").strip() else "an empty turn"
                raise TemplateError(
                    f"assistant turn {j}: the chat template does not render its tool calls, so its sample would "
                    f"train {what}: set a `chat_template` that renders tool calls, or leave conversations with "
                    f"tool calls out", reason=TOOL_CALLS_NOT_RENDERED)

    def _refuse_unrendered_tool_results(self, msgs: list[dict[str, Any]]) -> None:
        """A template that drops tool messages (Phi-3) trains the turns after one without the result in their
        context: the drafter learns answers that seem to come from nowhere."""
        if self.renderer.facts().renders_tool_results:
            return
        for j, m in enumerate(msgs):
            if m["role"] == "tool":
                raise TemplateError(
                    f"message {j} (tool): the chat template does not render tool messages, so the turns after it "
                    f"would be trained without the tool result in their context: set a `chat_template` that "
                    f"renders them, or leave conversations with tool messages out", reason=TOOL_RESULTS_NOT_RENDERED)

    def encode(self, conv: Conversation) -> list[MaskedSample]:
        """The samples of one conversation: one, or one per assistant turn (see `split_turns`)."""
        msgs, tools, rd = conv.messages, conv.tools, self.renderer
        self._refuse_stop_tokens_inside(msgs)
        self._refuse_unrendered_tool_calls(msgs, tools)
        self._refuse_unrendered_tool_results(msgs)
        r_text = rd.render(msgs, tools)
        r = rd.verify(r_text)
        turns = [(j, *self._turn(conv, j, r_text)) for j, m in enumerate(msgs) if m["role"] == "assistant"]
        self.stats["conversations"] += 1
        self.stats["turns"] += len(turns)
        stable = [is_prefix(t, r) for _, t, _, _ in turns]
        if turns and (self.split_turns == "always" or (self.split_turns == "auto" and not all(stable))):
            self.stats["split_conversations"] += 1
            self.stats["samples"] += len(turns)
            split = [(j, *self._with_next_stop(msgs, j, t, sp), e_text) for j, t, e_text, sp in turns]
            self._count_reasoning(msgs, [sp for _, _, sp, _ in split])
            return [MaskedSample(t, self._mask(len(t), [sp]), e_text, j, [sp]) for j, t, sp, e_text in split]
        spans: list[TurnSpan] = []
        facts = rd.facts()
        for (j, _, _, sp), ok in zip(turns, stable, strict=True):
            if not ok:
                p = self._prompt_ids(conv, j)
                lo = spans[-1].end if spans else 0
                gen = self._generation_prompt(conv, j, p)
                got = find_turn(rd, msgs, tools, j, r, len(p) if is_prefix(p, r) else None, gen, lo, prompt=p)
                if got is None and (k := self._closed_block(p, r, gen)) is not None:
                    got = find_turn(rd, msgs, tools, j, r, None, p[len(p) - len(gen):k], lo, prompt=p[:k])
                    got = got if got is not None and got.prompt_end == k else None
                    if got is not None and self._whole_block(p, r[k:k + 2]):  # not the model's: the prompt's closer
                        c = k + 2
                        got = replace(got, prompt_end=c, header_start=max(got.header_start, c),
                                      content_start=max(got.content_start, c))
                if got is None and (opened := self._reasoning_opener(p, r, gen)) is not None:
                    # the prompt opens reasoning no rendering has (R1, QwQ): the turn follows what R holds of it;
                    # a closer R writes there is the model's, trained as in the turn's own sample
                    k = opened[1]
                    got = find_turn(rd, msgs, tools, j, r, None, p[len(p) - len(gen):k], lo, prompt=p[:k])
                    got = None if got is None else self._after_prompt_opener(got, r, p[k])
                    if got is not None and not got.reasoning_rendered and \
                            f"</{opened[0][2]}>" in rd.text(r[got.prompt_end:got.header_start]):
                        got = replace(got, closes_prompt_block=True)
                if got is None:
                    self.stats["turns_unlocated"] += 1
                    continue
                sp = got
                self.stats["turns_history_fallback"] += 1
            if sp.stop is None and not facts.writes_stop and sp.end < len(r) and r[sp.end] in facts.stop_ids:
                sp = replace(sp, stop=sp.end, end=sp.end + 1)  # the next message's header ends the turn (GLM)
            if spans and sp.prompt_end < spans[-1].end:
                raise TemplateError(f"assistant turn {j}: found at token {sp.prompt_end}, inside the previous "
                                    f"turn (which ends at token {spans[-1].end}); the template renders turns in an "
                                    f"order this masker cannot follow")
            spans.append(sp)
        self.stats["samples"] += 1
        self._count_reasoning(msgs, spans)
        return [MaskedSample(r, self._mask(len(r), spans), r_text, None, spans)]

    def _with_next_stop(self, msgs: list[dict[str, Any]], j: int, ids: list[int], sp: TurnSpan
                        ) -> tuple[list[int], TurnSpan]:
        """Turn j's own sample, ending with the stop token the model wrote after it where the template writes
        none (GLM-4.5: the header of the next message, `<|user|>` or `<|observation|>`, by its role)."""
        facts = self.renderer.facts()
        nxt = dict(facts.next_stops).get(msgs[j + 1]["role"]) if j + 1 < len(msgs) else None
        if sp.stop is not None or nxt is None or sp.end != len(ids):
            return ids, sp
        return ids + [nxt], replace(sp, stop=sp.end, end=sp.end + 1)

    def _count_reasoning(self, msgs: list[dict[str, Any]], stored: list[TurnSpan]) -> None:
        """Of the turns stored: those with reasoning put back, and those whose reasoning is not in the sample."""
        for sp in stored:
            if sp.reasoning_inserted:
                self.stats["reasoning_inserted"] += 1
            elif msgs[sp.index].get("reasoning_content") and not sp.reasoning_rendered:  # dropped, even when last
                self.stats["reasoning_not_rendered"] += 1


__all__ = ["NOT_PREFIX_STABLE", "REASONING_LEFT_OPEN", "SPLIT_MODES", "STOP_TOKEN_IN_TURN", "TOOL_CALLS_NOT_RENDERED",
           "TOOL_RESULTS_NOT_RENDERED", "ChatMasker", "MaskedSample", "TemplateError"]
