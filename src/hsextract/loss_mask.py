"""Loss masks from the chat template itself: which tokens of the rendered conversation are trained.

What is stored is the FULL rendering R = template(conversation), tokenized once (no special tokens added:
the template writes BOS itself). Masks are computed per character of R and mapped to tokens through the
tokenizer's offsets: a token is trained when any of its characters is trained.

For each assistant message j (index in the conversation), the template is rendered a few more times and
the renders are compared as strings with R:

1. Prefix stability. B = template(conv[:j]), P = template(conv[:j], add_generation_prompt=True),
   F = template(conv[:j+1]). P must extend B (the generation prompt G = P[len(B):] is appended) and F must
   extend P (what the engine sees as prompt is a prefix of the turn as it is trained). Otherwise the
   template is not prefix-stable for this conversation (e.g. a thinking generation prompt with a template
   that renders the turn without it, SpecForge#296): TemplateError, with the first differing characters.
   When P is a prefix of R, its tokens must also equal the first tokens of R, and the end of G must never
   fall inside a token of R.
2. Material span [s, e) in R: R is re-rendered with message j replaced by two sentinel messages (content
   and tool-call names/arguments replaced by private-use characters, same number of tool calls, with a
   sentinel reasoning in one of them when j has reasoning). The characters of R that differ from both
   renders (longest common prefix / suffix) are the ones that depend on message j. This works whatever
   the template does to earlier turns (Kimi-K2.5, Qwen3, DeepSeek-V3.1 drop earlier turns' reasoning):
   only what is present in R is ever marked.
3. Header end h: the end of the last occurrence of G (or its longest prefix found) in R between the end
   of the previous turn and s. Text before h (role header, generation prompt) is context: 0.
4. Reasoning: present in R when rendering without message j's reasoning changes R. Then [h, c) is the
   reasoning block, delimiters included (c = where the content starts, found with a content sentinel):
   trained iff `train_on_reasoning`, and [c, e) is trained. When no reasoning is present, [h, s) is
   template filler, e.g. an empty `<think></think>` the template inserts: NOT trained; [s, e) is trained.
5. End of turn: the fixed text the template writes after the last message-dependent character (rendered
   with j as the last message, as the common suffix of the two sentinel renders; matched against R after
   e). Trained iff `train_on_eot`. For a tool-call turn this includes the template's closing markers after
   the last arguments (e.g. `<|tool_calls_section_end|>`), since they do not depend on the message.
System, user and tool messages are never trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hsextract.conversations import Conversation
from hsextract.errors import ConfigError

# Private-use characters: never in templates, never equal to a real character at a diff boundary.
_SENT = ("\ue000", "\ue001")
_SENT_REASONING = "\ue002"


class TemplateError(ConfigError):
    """The chat template cannot give a consistent mask for a conversation (names the turn and the text)."""


@dataclass
class MaskedSample:
    input_ids: list[int]
    loss_mask: list[int]
    text: str  # the full rendering the ids were tokenized from
    offsets: list[tuple[int, int]]  # character span of each token in `text`


@dataclass(frozen=True)
class TurnSpans:
    """Character spans of one assistant turn in the full rendering (for tests and debugging)."""

    index: int
    header_end: int
    start: int  # first message-dependent char (reasoning or content)
    content_start: int
    end: int  # end of message-dependent text
    eot_end: int
    reasoning_present: bool
    prompt_len: int  # length of the generation-prompt render of conv[:index] (0 for index 0)
    prompt_is_prefix: bool  # that render is a prefix of the full rendering


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: renders are long and share most text.
    step = 256
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_suffix(a: str, b: str, limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    step = 256
    while i + step <= n and a[len(a) - i - step:len(a) - i] == b[len(b) - i - step:len(b) - i]:
        i += step
    while i < n and a[len(a) - 1 - i] == b[len(b) - 1 - i]:
        i += 1
    return i


def _diff_span(r: str, v: str) -> tuple[int, int]:
    """[start, end) of r that differs from v (minimal, prefix first)."""
    p = _common_prefix(r, v)
    s = _common_suffix(r, v, min(len(r), len(v)) - p)
    return p, len(r) - s


def _sentinel(msg: dict[str, Any], k: int, reasoning: bool, args_as_str: bool = True) -> dict[str, Any]:
    sent = _SENT[k]
    out: dict[str, Any] = {"role": "assistant", "content": sent}
    if msg.get("tool_calls"):
        out["tool_calls"] = [
            {"type": "function", "id": f"{sent}{i}",
             "function": {"name": f"{sent}f", "arguments": sent if args_as_str else {sent: sent}}}
            for i, _ in enumerate(msg["tool_calls"])
        ]
    if reasoning:
        out["reasoning_content"] = _SENT_REASONING
    return out


def _snippet(s: str, at: int) -> str:
    return repr(s[max(0, at - 20):at + 30])


class ChatMasker:
    """Renders conversations with a tokenizer's chat template and returns ids + loss mask.

    `chat_template_kwargs` are passed to every render (e.g. {"enable_thinking": False} for Qwen3,
    {"thinking": True} for Kimi-K2.5 / DeepSeek-V3.1).
    """

    def __init__(self, tokenizer: Any, *, train_on_eot: bool = True, train_on_reasoning: bool = True,
                 chat_template_kwargs: dict[str, Any] | None = None, check_token_prefix: bool = True) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("the tokenizer must be a fast (Rust) tokenizer: loss masks need offset mappings")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat_template: set one (tokenizer_config.json or `chat_template`)")
        self.tokenizer = tokenizer
        self.train_on_eot = train_on_eot
        self.train_on_reasoning = train_on_reasoning
        self.kwargs = dict(chat_template_kwargs or {})
        self.check_token_prefix = check_token_prefix

    # -------------------------------------------------------------------------------------- rendering

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
               add_generation_prompt: bool = False) -> str:
        out = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **self.kwargs)
        if not isinstance(out, str):
            raise TemplateError(f"apply_chat_template returned {type(out).__name__}, expected a string")
        return out

    def _render_with(self, conv: Conversation, j: int, msg: dict[str, Any]) -> str:
        msgs = list(conv.messages)
        msgs[j] = msg
        return self.render(msgs, conv.tools)

    def _render_sentinel(self, conv: Conversation, j: int, k: int, reasoning: bool, upto: bool) -> str:
        """Render with message j replaced by sentinel k (whole conversation, or conv[:j+1] if upto)."""
        m = conv.messages[j]
        base = Conversation(conv.messages[:j + 1] if upto else conv.messages, conv.tools)
        try:
            return self._render_with(base, j, _sentinel(m, k, reasoning))
        except Exception:
            if not m.get("tool_calls"):
                raise
            # Templates that iterate `arguments.items()` need an object.
            return self._render_with(base, j, _sentinel(m, k, reasoning, args_as_str=False))

    # ---------------------------------------------------------------------------------------- spans

    def char_labels(self, conv: Conversation) -> tuple[str, bytearray, list[TurnSpans]]:
        """Full rendering, a 0/1 label per character, and the spans found for each assistant turn."""
        msgs = conv.messages
        r = self.render(msgs, conv.tools)
        labels = bytearray(len(r))
        spans: list[TurnSpans] = []
        prev_end = 0
        for j, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            p, g = self._generation_prompt(conv, j)
            filler, tail0 = self._plain_turn(conv, j, g)
            has_reasoning = bool(m.get("reasoning_content"))
            s, e = _diff_span(r, self._render_sentinel(conv, j, 0, False, upto=False))
            if has_reasoning or m.get("tool_calls"):
                s2, e2 = _diff_span(r, self._render_sentinel(conv, j, 1, has_reasoning, upto=False))
                s, e = min(s, s2), max(e, e2)
            if s < prev_end:
                raise TemplateError(
                    f"assistant turn {j}: its rendering starts at character {s}, inside the previous turn "
                    f"(which ends at {prev_end}); the template renders turns in an order this masker cannot "
                    f"follow")
            if e <= s:  # the template renders nothing of this message
                continue
            h = self._header_end(r, g, prev_end, s)
            reasoning_present = False
            c = s
            if has_reasoning:
                plain = {k: v for k, v in m.items() if k != "reasoning_content"}
                if self._render_with(conv, j, plain) != r:
                    reasoning_present = True
                    c = _common_prefix(r, self._render_with(conv, j, dict(m, content=_SENT[0])))
                    if not h <= c <= e:
                        raise TemplateError(
                            f"assistant turn {j}: content starts at character {c}, outside the turn "
                            f"[{h}, {e}); the template renders reasoning after content?")
            # Fixed text after the message: tool-call closers (trained) then the end of turn.
            tail = self._tool_tail(conv, j) if m.get("tool_calls") else tail0
            fixed = _common_prefix(r[e:e + len(tail)], tail)
            closers = len(tail) - len(tail0) if tail0 and tail.endswith(tail0) else 0
            body_end = e + min(closers, fixed)
            eot_end = e + fixed
            if reasoning_present:
                if self.train_on_reasoning:
                    labels[h:c] = b"\x01" * (c - h)
                labels[c:body_end] = b"\x01" * (body_end - c)
            else:
                # Template text the turn always opens with (an empty think block) is not trained.
                start = min(s, h + _common_prefix(r[h:s], filler))
                labels[start:body_end] = b"\x01" * (body_end - start)
            if self.train_on_eot:
                labels[body_end:eot_end] = b"\x01" * (eot_end - body_end)
            spans.append(TurnSpans(j, h, s, c, body_end, eot_end, reasoning_present, len(p),
                                   j > 0 and r.startswith(p)))
            prev_end = eot_end
        return r, labels, spans

    def _generation_prompt(self, conv: Conversation, j: int) -> tuple[str, str]:
        """(P, G): the generation-prompt render of conv[:j] and the generation prompt G itself.

        F = render(conv[:j+1]) must continue P. A difference inside the earlier turns is allowed (templates
        that rewrite history, e.g. drop reasoning once a later turn exists) as long as F still holds G
        after it; a difference at or after the generation prompt is a real inconsistency."""
        if j == 0:
            return "", ""
        head = conv.messages[:j]
        b = self.render(head, conv.tools)
        p = self.render(head, conv.tools, add_generation_prompt=True)
        f = self.render(conv.messages[:j + 1], conv.tools)
        if not p.startswith(b):
            k = _common_prefix(p, b)
            raise TemplateError(
                f"assistant turn {j}: add_generation_prompt=True does not extend the rendering of the "
                f"conversation before it (first difference at character {k}: {_snippet(b, k)} vs "
                f"{_snippet(p, k)})")
        g = p[len(b):]
        if not f.startswith(p):
            k = _common_prefix(p, f)
            if k >= len(b) or (g and f.rfind(g, k) < 0):
                raise TemplateError(
                    f"assistant turn {j}: the template is not prefix-stable: rendering the turn does not "
                    f"start with the generation prompt the engine would see (first difference at character "
                    f"{k}: prompt {_snippet(p, k)} vs turn {_snippet(f, k)}). Set `chat_template_kwargs` "
                    f"(e.g. enable_thinking / thinking) to match the data, or fix the data's reasoning fields")
        return p, g

    @staticmethod
    def _header_end(r: str, g: str, lo: int, hi: int) -> int:
        for k in range(len(g), 0, -1):
            at = r.rfind(g[:k], lo, hi)
            if at >= 0:
                return at + k
        return hi

    def _plain_turn(self, conv: Conversation, j: int, g: str) -> tuple[str, str]:
        """(filler, end of turn) of a content-only turn j rendered last: the text between the generation
        prompt and the content (e.g. `<think>\\n\\n</think>\\n\\n`), and the text after the content."""
        t = self.render(conv.messages[:j] + [{"role": "assistant", "content": _SENT[0]}], conv.tools)
        at = t.rfind(_SENT[0])
        if at < 0:
            return "", ""
        filler = t[self._header_end(t, g, 0, at):at] if g else ""
        return filler, t[at + 1:]

    def _tool_tail(self, conv: Conversation, j: int) -> str:
        """Fixed text after the last tool call's arguments, end of turn included."""
        a = self._render_sentinel(conv, j, 0, False, upto=True)
        b = self._render_sentinel(conv, j, 1, False, upto=True)
        n = _common_suffix(a, b, min(len(a), len(b)))
        return a[len(a) - n:] if n else ""

    # ---------------------------------------------------------------------------------------- tokens

    def encode(self, conv: Conversation) -> MaskedSample:
        r, labels, spans = self.char_labels(conv)
        enc = self.tokenizer(r, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        offsets = enc["offset_mapping"]
        mask = [0] * len(ids)
        for t, (a, b) in enumerate(offsets):
            if b > a and any(labels[a:b]):
                mask[t] = 1
        self._check_boundaries(conv, r, ids, offsets, spans)
        return MaskedSample(input_ids=ids, loss_mask=mask, text=r, offsets=[(int(a), int(b)) for a, b in offsets])

    def _check_boundaries(self, conv: Conversation, r: str, ids: list[int], offsets: Any,
                          spans: list[TurnSpans]) -> None:
        for sp in spans:
            h = sp.header_end
            for t, (a, b) in enumerate(offsets):
                if a < h < b:
                    raise TemplateError(
                        f"assistant turn {sp.index}: the generation prompt ends at character {h}, inside token "
                        f"{t} ({r[a:b]!r}); the stored ids would differ from what the engine sees at "
                        f"generation time (tokenizer/template not prefix-stable)")
                if a >= h:
                    break
            if not self.check_token_prefix or sp.index == 0:
                continue
            if sp.prompt_is_prefix:
                p = r[:sp.prompt_len]
                pids = list(self.tokenizer(p, add_special_tokens=False)["input_ids"])
                if pids != ids[:len(pids)]:
                    k = _common_prefix_list(pids, ids)
                    raise TemplateError(
                        f"assistant turn {sp.index}: the prompt tokenized alone differs from the stored ids at "
                        f"token {k} ({pids[k:k + 3]} vs {ids[k:k + 3]}): not prefix-stable at token level")



def _common_prefix_list(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


__all__ = ["ChatMasker", "MaskedSample", "TemplateError", "TurnSpans"]
