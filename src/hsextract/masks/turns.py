"""Where one assistant turn lies in a rendering, on token ids (no character offsets: any tokenizer works).

A *frame* is a message list M rendered to ids X, with the assistant turn at index j and `p` = the length of
the ids of render(M[:j], add_generation_prompt=True), which must be a prefix of X (checked by the caller):
X[:p] is what the server saw before it generated the turn. Within X the turn is split as:

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

from hsextract.masks.rendering import SENT, TemplateError, TemplateFacts, TemplateRenderer, common_prefix, common_suffix

TOOL_CALLS_AFTER_STOP = "tool_calls_after_stop"


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
    reasoning_inserted: bool = False  # X[p:hdr] is reasoning no rendering has, put back (ChatMasker)
    # X[p:hdr] closes the reasoning block the generation prompt opened, with no reasoning before it in the frame
    # (DeepSeek-V3.1 `thinking: true`, GLM-4.7: `</think>` + content after a prompt ending `<think>`): the model
    # wrote that closer, so it is trained as the reasoning block it ends (ChatMasker)
    closes_prompt_block: bool = False

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


def _names_calls(renderer: TemplateRenderer, ids: list[int], calls: list[dict[str, Any]]) -> bool:
    """Whether the text of `ids` names every tool call's function (it holds the calls' markup)."""
    text = renderer.text(ids)
    return all(str((c.get("function") or c).get("name", "")) in text for c in calls)


def _content_sentinel(m: dict[str, Any]) -> dict[str, Any]:
    return {**m, "content": SENT[0] if m.get("content") != SENT[0] else SENT[1]}


def _header_len(region: list[int], facts: TemplateFacts, special: set[int]) -> int:
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


def shifted(sp: TurnSpan, by: int) -> TurnSpan:
    return replace(sp, prompt_end=sp.prompt_end + by, header_start=sp.header_start + by,
                   content_start=sp.content_start + by, stop=None if sp.stop is None else sp.stop + by,
                   end=sp.end + by)


def _last_occurrence(x: list[int], g: list[int], lo: int, hi: int) -> int | None:
    """End of the last occurrence of g in x[lo:hi], or None."""
    n = len(g)
    for k in range(hi, lo + n - 1, -1):
        if x[k - n:k] == g:
            return k
    return None


def _after_longest_suffix(x: list[int], prompt: list[int], lo: int, hi: int) -> int | None:
    """End of the longest suffix of `prompt` found in x[lo:hi] (the last such place on a tie), or None."""
    best, at = 0, None
    for k in range(lo + 1, hi + 1):
        n = 0
        while n < len(prompt) and k - n > lo and x[k - 1 - n] == prompt[-1 - n]:
            n += 1
        if n and n >= best:
            best, at = n, k
    return at


def find_turn(renderer: TemplateRenderer, msgs: list[dict[str, Any]], tools: Any, j: int, x: list[int],
              p: int | None, gen: list[int] | None = None, lo: int = 0, last: bool = False,
              prompt: list[int] | None = None) -> TurnSpan | None:
    """The span of assistant turn j in the frame `msgs` rendered to ids `x` (see the module docstring).

    `p` None: the frame's history differs from the prompt the server saw, `prompt` (a template that rewrites
    earlier turns, or puts the system prompt in the last user message as Mistral's do); the turn then starts,
    in x[lo:] before the turn's content, after the last occurrence of the generation prompt `gen`, or, for a
    template without one, after the longest suffix of `prompt` found there. None when it is not found.
    `last`: turn j is the frame's last message."""
    facts = renderer.facts()
    m = msgs[j]

    def variant(new: dict[str, Any], at: int = j) -> list[int] | None:
        alt = list(msgs)
        alt[at] = new
        try:
            return renderer.render_ids(alt, tools)
        except Exception:  # noqa: BLE001 - a template that refuses the variant (e.g. content with thinking)
            return None

    def end_of_previous() -> int:
        """One past the last token of message j - 1's own text in x (0 when it cannot be told)."""
        if j == 0 or not isinstance(msgs[j - 1].get("content"), str):
            return 0
        xs = variant(_content_sentinel(msgs[j - 1]), j - 1)
        return 0 if xs is None or xs == x else len(x) - common_suffix(x, xs)

    if last and p is not None and not facts.renders_reasoning and not m.get("reasoning_content") and \
            not m.get("tool_calls"):
        # A template without reasoning, the turn rendered last: it ends with the stop token and the fixed text
        # the probe saw after it; everything from the generation prompt on is the turn's own text. (The first
        # such token: the text after a Phi-3 turn's `<|end|>` holds eos, a stop token as well.) Not for a turn
        # with calls, which a template may render after the stop (checked below).
        for i in range(p, len(x)):
            if x[i] in facts.stop_ids and tuple(x[i + 1:]) in facts.after_stop:
                return TurnSpan(j, p, p, p, i, i + 1, False, True)
    xc = variant(_content_sentinel(m))
    xn = variant({k: v for k, v in m.items() if k != "reasoning_content"}) if m.get("reasoning_content") else None
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
    def start_of_next() -> int:
        """Where message j + 1's own text starts in x (len(x) when it cannot be told): the turn starts before."""
        if j + 1 >= len(msgs) or not isinstance(msgs[j + 1].get("content"), str):
            return len(x)
        xs = variant(_content_sentinel(msgs[j + 1]), j + 1)
        return len(x) if xs is None or xs == x else common_prefix(x, xs)

    if p is None:
        # before the turn's content, its rendered reasoning and the next message: a turn whose content cannot be
        # varied (harmony refuses content beside reasoning in a call) is not looked for in a later turn
        limit = c if c is not None else start_of_next()
        if xn is not None and xn != x:
            limit = min(limit, common_prefix(x, xn))
        p = _last_occurrence(x, gen, lo, limit) if gen else \
            _after_longest_suffix(x, prompt, lo, limit) if prompt else None
        if p is None or p < end_of_previous():  # found inside the context (a short tail matched early)
            return None
    if reasoning_rendered:
        assert xn is not None
        tail = common_suffix(x, xn, min(len(x), len(xn)) - p)
        ends.append(len(x) - tail)
        if c is None:
            c = len(x) - tail
    if c is None:  # the template does not render the content (Llama renders tool calls instead)
        c = p
    c = max(c, p)
    xt = variant({k: v for k, v in m.items() if k != "tool_calls"}) if m.get("tool_calls") else None
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
    if last and stop is not None and xt is not None and xt != x and len(x) - common_suffix(x, xt) > end:
        raise TemplateError(
            f"assistant turn {j}: the chat template renders its tool calls after the turn's stop token, as a "
            f"message of their own, so its sample would train a turn without them: set a `chat_template` that "
            f"renders tool calls in the assistant turn, or leave conversations with tool calls out",
            reason=TOOL_CALLS_AFTER_STOP)
    special = renderer.special_ids()
    if reasoning_rendered:
        hdr = c - _header_len(x[p:c], facts, special)
        filler = False
    else:
        hdr = c
        f = x[p:c]
        ch = list(facts.content_header)
        filler = not facts.renders_reasoning or (len(f) <= len(ch) and ch[len(ch) - len(f):] == f)
    return TurnSpan(j, p, hdr, c, stop, end, reasoning_rendered, filler)


__all__ = ["TOOL_CALLS_AFTER_STOP", "TurnSpan", "find_turn", "shifted"]
