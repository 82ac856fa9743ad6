"""Where one assistant turn lies in a rendering, on token ids (no character offsets: any tokenizer works).

A *frame* (`Frame`) is a message list M rendered to ids X, with the assistant turn at index j. The turn starts
where the prompt the server saw before it ends: at a known token p when render(M[:j], add_generation_prompt=True)
is a prefix of X, else after that prompt's end found in X (`After`, for a frame whose history the template
rewrote). Within X the turn is split as (`TurnSpan`):

    X[p:hdr]      reasoning block (delimiters included) when the template renders the turn's reasoning, or
                  the closer of the block the generation prompt opened (`closes_prompt_block`), else filler
                  the template writes before the content (see `filler_trained`)
    X[hdr:c]      content header the model writes after its reasoning (harmony: `<|start|>assistant
                  <|channel|>final<|message|>`), empty for think-tag templates
    X[c:stop]     the message: content, tool-call markup, and any closers before the stop token
    X[stop]       the stop token: the first token of the template's stop set (`TemplateFacts.stop_ids`) at or
                  after the last message-dependent token; for a template that writes none (GLM-4.5), the token
                  right after the message when it is a stop (the next message's header), else there is none
    X[stop+1:]    template text after the stop token (Qwen's `\\n` after `<|im_end|>`), never generated

c is where rendering the turn with its content replaced by a sentinel first differs from X; the end of the
message-dependent tokens is where those two renderings (and the one without reasoning) last differ.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hsextract.masks.ids import after_longest_suffix, common_prefix, common_suffix, last_occurrence
from hsextract.masks.probe import SENT, TemplateFacts
from hsextract.masks.refusals import TOOL_CALLS_AFTER_STOP, TemplateError
from hsextract.masks.rendering import TemplateRenderer


@dataclass(frozen=True)
class Frame:
    """A message list rendered to ids, and the assistant turn in it that is looked for."""

    messages: list[dict[str, Any]]
    tools: Any
    index: int  # message index of the turn
    ids: list[int]
    last: bool = False  # the turn is the frame's last message (the frame of a turn's own sample)
    lo: int = 0  # the turn is not looked for before this token (the end of the turn found before it)

    @property
    def message(self) -> dict[str, Any]:
        return self.messages[self.index]


@dataclass(frozen=True)
class After:
    """Where a turn starts in a frame whose history differs from the prompt the server saw (`prompt`): after the
    last occurrence of the generation prompt `generation`, or, for a template without one, after the longest
    tail of `prompt` found there; before the turn's content, its rendered reasoning and the next message."""

    generation: list[int]
    prompt: list[int]


@dataclass(frozen=True)
class TurnSpan:
    """Token positions of one assistant turn in a frame (see the module docstring)."""

    index: int  # message index of the turn
    prompt_end: int  # p
    header_start: int  # hdr
    content_start: int  # c
    stop: int | None  # index of the stop token; None: the template writes none (the turn ends at `end`)
    end: int  # one past the last generated token (stop + 1, or the end of the message text)
    reasoning_rendered: bool
    filler_trained: bool  # X[p:hdr] when no reasoning is rendered: text the model writes itself
    reasoning_inserted: bool = False  # X[p:hdr] is reasoning no rendering has, put back (TurnSample.put_back)
    # X[p:hdr] closes the reasoning block the generation prompt opened, with no reasoning before it in the frame
    # (DeepSeek-V3.1 `thinking: true`, GLM-4.7, Kimi-K2.5: `</think>` + content after a prompt ending `<think>`):
    # the model wrote that closer, so it is trained as the reasoning block it ends (reasoning.closed_at_once)
    closes_prompt_block: bool = False

    @property
    def generated_nothing(self) -> bool:
        """No token of the turn before its stop token."""
        return (self.stop if self.stop is not None else self.end) <= self.prompt_end

    def labels(self, train_on_reasoning: bool, train_on_eot: bool) -> list[tuple[int, int, str]]:
        """[(start, end, kind)] of the turn's tokens; kind is reasoning, header, body, eot or untrained."""
        out: list[tuple[int, int, str]] = []
        if self.reasoning_rendered or self.closes_prompt_block:
            out.append((self.prompt_end, self.header_start, "reasoning" if train_on_reasoning else "untrained"))
        else:
            out.append((self.prompt_end, self.header_start, "header" if self.filler_trained else "untrained"))
        out.append((self.header_start, self.content_start, "header"))
        body_end = self.stop if self.stop is not None else self.end
        out.append((self.content_start, body_end, "body"))
        if self.stop is not None:
            out.append((self.stop, self.stop + 1, "eot" if train_on_eot else "untrained"))
        return [(a, b, k) for a, b, k in out if b > a]

    def shifted(self, by: int) -> TurnSpan:
        """The same turn in ids with `by` more tokens before it."""
        return replace(self, prompt_end=self.prompt_end + by, header_start=self.header_start + by,
                       content_start=self.content_start + by, stop=None if self.stop is None else self.stop + by,
                       end=self.end + by)

    def starting_at(self, at: int) -> TurnSpan:
        """The turn starting at token `at`, after tokens of the frame it began with that the prompt holds."""
        return replace(self, prompt_end=at, header_start=max(self.header_start, at),
                       content_start=max(self.content_start, at))

    def stopped_by_next(self) -> TurnSpan:
        """The turn of a template that writes no stop token, ended by the token after it: the next message's
        header, which the model wrote to stop (GLM-4.5)."""
        return replace(self, stop=self.end, end=self.end + 1)


@dataclass(frozen=True)
class TurnSample:
    """A turn's own sample (`split_turns`): the prompt the server saw, then the turn; `span` its positions."""

    ids: list[int]
    span: TurnSpan

    @classmethod
    def cut(cls, prompt: list[int], x: list[int], span: TurnSpan) -> TurnSample:
        """The server's prompt, then the turn as the frame x renders it (span in x)."""
        return cls(prompt + x[span.prompt_end:span.end], span.shifted(len(prompt) - span.prompt_end))

    @classmethod
    def put_back(cls, prompt: list[int], block: list[int], x: list[int], span: TurnSpan, inserted: bool = True,
                 **flags: bool) -> TurnSample:
        """The server's prompt, the turn's reasoning `block` the frame x does not render (`inserted`; or the
        block's markup, or nothing), then the turn as rendered in x from its content on (span in x)."""
        body = x[span.content_start:span.end]
        start = len(prompt) + len(block)
        stop = None if span.stop is None else start + span.stop - span.content_start
        return cls(prompt + block + body, replace(
            span, prompt_end=len(prompt), header_start=start, content_start=start, stop=stop, end=start + len(body),
            reasoning_rendered=inserted, reasoning_inserted=inserted, **flags))


def _names_calls(renderer: TemplateRenderer, ids: list[int], calls: list[dict[str, Any]]) -> bool:
    """Whether the text of `ids` names every tool call's function (it holds the calls' markup)."""
    text = renderer.text(ids)
    return all(str((c.get("function") or c).get("name", "")) in text for c in calls)


def _content_sentinel(m: dict[str, Any]) -> dict[str, Any]:
    return {**m, "content": SENT[0] if m.get("content") != SENT[0] else SENT[1]}


def _without(m: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in m.items() if k != key}


def _header_len(region: list[int], facts: TemplateFacts, special: frozenset[int]) -> int:
    """Length of the content header that ends a rendered reasoning block (0 for think-tag templates)."""
    if not facts.content_header:
        return 0
    ch = list(facts.content_header)
    cands = [ch[k:] for k in range(len(ch))] + [list(facts.generation_prompt)]
    for h in sorted((h for h in cands if h), key=len, reverse=True):
        n = len(h)
        if len(region) > n and region[-n:] == h and region[-n - 1] in special:
            return n
    return 0


class _Variants:
    """The frame rendered with one message replaced (None where the template refuses that variant)."""

    def __init__(self, renderer: TemplateRenderer, frame: Frame) -> None:
        self.renderer, self.frame = renderer, frame

    def of(self, new: dict[str, Any], at: int | None = None) -> list[int] | None:
        msgs = list(self.frame.messages)
        msgs[self.frame.index if at is None else at] = new
        try:
            return self.renderer.render_ids(msgs, self.frame.tools)
        except Exception:  # noqa: BLE001 - a template that refuses the variant (e.g. content with thinking)
            return None

    def end_of_previous(self) -> int:
        """One past the last token of message j - 1's own text in the frame (0 when it cannot be told)."""
        j, x = self.frame.index, self.frame.ids
        if j == 0 or not isinstance(self.frame.messages[j - 1].get("content"), str):
            return 0
        xs = self.of(_content_sentinel(self.frame.messages[j - 1]), j - 1)
        return 0 if xs is None or xs == x else len(x) - common_suffix(x, xs)

    def start_of_next(self) -> int:
        """Where message j + 1's own text starts in the frame (its length when it cannot be told)."""
        j, x, msgs = self.frame.index, self.frame.ids, self.frame.messages
        if j + 1 >= len(msgs) or not isinstance(msgs[j + 1].get("content"), str):
            return len(x)
        xs = self.of(_content_sentinel(msgs[j + 1]), j + 1)
        return len(x) if xs is None or xs == x else common_prefix(x, xs)


def find_turn(renderer: TemplateRenderer, frame: Frame, start: int | After) -> TurnSpan | None:
    """The span of the frame's turn (see the module docstring), starting at token `start`, or found `After` the
    prompt's end; None when it is not found there (only with `After`)."""
    facts = renderer.facts()
    x, j, m = frame.ids, frame.index, frame.message
    if frame.last and isinstance(start, int) and not facts.renders_reasoning and not m.get("reasoning_content") \
            and not m.get("tool_calls"):
        # A template without reasoning, the turn rendered last: it ends with the stop token and the fixed text
        # the probe saw after it; everything from the generation prompt on is the turn's own text. (The first
        # such token: the text after a Phi-3 turn's `<|end|>` holds eos, a stop token as well.) Not for a turn
        # with calls, which a template may render after the stop (checked below).
        for i in range(start, len(x)):
            if x[i] in facts.stop_ids and tuple(x[i + 1:]) in facts.after_stop:
                return TurnSpan(j, start, start, start, i, i + 1, False, True)
    variants = _Variants(renderer, frame)
    xc = variants.of(_content_sentinel(m))
    xn = variants.of(_without(m, "reasoning_content")) if m.get("reasoning_content") else None
    reasoning_rendered = xn is not None and xn != x
    if m.get("reasoning_content") and xn is None:
        raise TemplateError(f"assistant turn {j}: the template refuses the turn without its reasoning, so the "
                            f"reasoning cannot be told apart from the content")
    # Last message-dependent token, and where the content starts.
    ends = []
    c = None
    if xc is not None and xc != x:
        c = common_prefix(x, xc)
        ends.append(len(x) - common_suffix(x, xc, len(x) - c))
    if isinstance(start, int):
        p = start
    else:
        # before the turn's content, its rendered reasoning and the next message: a turn whose content cannot be
        # varied (harmony refuses content beside reasoning in a call) is not looked for in a later turn
        limit = c if c is not None else variants.start_of_next()
        if reasoning_rendered:
            assert xn is not None
            limit = min(limit, common_prefix(x, xn))
        found = last_occurrence(x, start.generation, frame.lo, limit) if start.generation else \
            after_longest_suffix(x, start.prompt, frame.lo, limit) if start.prompt else None
        if found is None or found < variants.end_of_previous():  # inside the context (a short tail matched early)
            return None
        p = found
    if reasoning_rendered:
        assert xn is not None
        tail = common_suffix(x, xn, min(len(x), len(xn)) - p)
        ends.append(len(x) - tail)
        if c is None:
            c = len(x) - tail
    if c is None:  # the template does not render the content (Llama renders tool calls instead)
        c = p
    c = max(c, p)
    xt = variants.of(_without(m, "tool_calls")) if m.get("tool_calls") else None
    if xt is not None and xt != x:
        # Tool calls rendered before the content (Gemma-4): the message starts with them, after any reasoning.
        calls = max(common_prefix(x, xt), len(x) - common_suffix(x, xn) if reasoning_rendered and xn else p)
        if p <= calls < c and _names_calls(renderer, x[calls:c], m["tool_calls"]):
            c = calls
        if not facts.writes_stop:  # no stop token after the calls to end the turn at
            ends.append(len(x) - common_suffix(x, xt, len(x) - c))
    d = max([c] + ends)
    if facts.writes_stop:
        stop = next((i for i in range(max(d - 1, c), len(x)) if x[i] in facts.stop_ids), None)
    else:
        stop = d if d < len(x) and x[d] in facts.stop_ids else None
    end = stop + 1 if stop is not None else d
    c = min(c, end if stop is None else stop)
    if frame.last and stop is not None and xt is not None and xt != x and len(x) - common_suffix(x, xt) > end:
        raise TemplateError(
            f"assistant turn {j}: the chat template renders its tool calls after the turn's stop token, as a "
            f"message of their own, so its sample would train a turn without them: set a `chat_template` that "
            f"renders tool calls in the assistant turn, or leave conversations with tool calls out",
            reason=TOOL_CALLS_AFTER_STOP)
    if reasoning_rendered:
        hdr = c - _header_len(x[p:c], facts, renderer.special_ids())
        filler = False
    else:
        hdr = c
        f = x[p:c]
        ch = list(facts.content_header)
        filler = not facts.renders_reasoning or (len(f) <= len(ch) and ch[len(ch) - len(f):] == f)
    return TurnSpan(j, p, hdr, c, stop, end, reasoning_rendered, filler)


__all__ = ["After", "Frame", "TurnSample", "TurnSpan", "find_turn"]
