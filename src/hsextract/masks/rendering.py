"""Rendering conversations with a tokenizer's chat template, and what the template itself tells about turns.

`TemplateRenderer` renders message lists to text and token ids (any tokenizer: fast, slow, tiktoken or
sentencepiece based; no offset mappings are used). It passes each message the way the template reads it:

- reasoning under the field names the template's source mentions (`reasoning_content`, `thinking`,
  `reasoning`; `reasoning_content` when it mentions none), so a template that reads `message.thinking`
  sees the reasoning our normalised records carry as `reasoning_content`;
- an assistant message with empty content and tool calls or reasoning is first rendered as normalised
  (`content: ""`), and when the template refuses that, without the `content` key (as the record may have
  been written), so a record the template accepts is never refused because of our normalisation;
- tool-call arguments written as a JSON-object string (the OpenAI format) as that object, as SGLang and vLLM
  pass them to the template: GLM's template iterates them, Llama's and Qwen's serialise the object with
  `tojson`, so the string itself would render unlike anything the server renders (or not at all).
- content given as a list of text parts as SGLang passes it (`content_format`): to a template that takes a
  string, the texts joined with a space (the record's `content`); to one that iterates parts or mentions
  media (the multimodal ones, Kimi-K2.5's among them), the list, which the template renders its own way;
- one time to a template that writes the date or the time (`strftime_now`): the moment the renderer was
  made (`_clock_at`).

Once per template (`probe()`), a two-message conversation with private-use sentinels shows:
- `stop_ids`: tokens that end a turn: the tokenizer's eos ids and the special token the template writes after
  the message (the first after a plain turn, the last after a tool-call turn), and `after_stop`, the text that
  follows it there (Phi-3: `\n` + eos);
- `writes_stop`: whether the template writes a special token after a plain turn at all. GLM-4.5's does not:
  the model stops by writing the next message's header (`<|user|>`, `<|observation|>`, stop ids in its
  generation config), so the special token closing a tool call (`</tool_call>`) is markup, not a stop, and
  `next_stops` holds, per role of the next message, the header token that ends the turn before it;
- `content_header`: text the template writes between a reasoning block and the content that the model
  writes itself (harmony's `<|start|>assistant<|channel|>final<|message|>`), empty for think-tag templates;
- `renders_reasoning`: whether any probe renders reasoning at all;
- `reasoning_slot`: (opener, closer) around reasoning, when both are special tokens and a turn without
  reasoning keeps exactly them (Kimi: `<think>` ending the generation prompt, `</think>`);
- `renders_tool_results`: false when a tool message's content is nowhere in the rendering (Phi-3 drops
  the `tool` role); true when it is, or when the template refuses the probe (its own error comes first).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import threading
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jinja2
import transformers.utils.chat_template_utils as hf_templates
from jinja2 import nodes
from transformers.utils.chat_template_utils import _compile_jinja_template

from hsextract.conversations import as_openai
from hsextract.errors import ConfigError
from hsextract.masks.kwargs import check_kwargs

# Private-use characters: never in templates, never equal to real text at a diff boundary. The two of a pair
# differ in their first and last UTF-8 byte (EE.. vs EF..; ..80 vs ..81), so their first and last tokens differ
# under any byte-level tokenizer and a token-level common prefix or suffix stops exactly at the sentinel.
SENT = ("\ue000\ue000", "\uf001\uf001")
SENT_REASONING = ("\ue002\ue002", "\uf003\uf003")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


TEMPLATE_ERROR = "template_error"  # the reason a conversation is dropped under when nothing names another
TOOL_ARGUMENTS_AS_STRING = "tool_arguments_as_string"  # a template that joins tool-call arguments as text


class TemplateError(ConfigError):
    """The chat template cannot give a consistent mask for a conversation (names the turn and the text).

    `reason` is the counter name prepare drops the conversation under when `strict` is false."""

    def __init__(self, message: str, reason: str = TEMPLATE_ERROR) -> None:
        super().__init__(message)
        self.reason = reason


def failure(e: BaseException) -> str:
    """What went wrong in encoding one conversation, said so that its source is plain: our TemplateError as it
    is; an error raised inside the chat template (a `raise_exception`, or a field it reads that the record lacks)
    named as the template's; anything else as raised."""
    if isinstance(e, TemplateError):
        return str(e)
    if type(e) is jinja2.exceptions.TemplateError:  # the template's raise_exception: its own words
        return f"the chat template refused it: {e}"
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, jinja2.exceptions.TemplateError) or any(f.filename == "<template>" for f in frames):
        return (f"the chat template failed on it ({type(e).__name__}: {e}); a field it reads may be missing from "
                "the record (a tool message's name, a tool call's id) or hold another type")
    return f"{type(e).__name__}: {e}"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def common_suffix(a: list[int], b: list[int], limit: int | None = None) -> int:
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    i = 0
    while i < n and a[-1 - i] == b[-1 - i]:
        i += 1
    return i


def is_prefix(p: list[int], x: list[int]) -> bool:
    return len(p) <= len(x) and x[:len(p)] == p


def _reads_field(template: str, name: str) -> bool:
    pat = rf"(\.{name}\b|\[\s*['\"]{name}['\"]\s*\]|['\"]{name}['\"]\s+(not\s+)?in\s+\w+|get\(\s*['\"]{name}['\"])"
    return re.search(pat, template) is not None


def content_format(template: str) -> str:
    """`openai` when the server passes this template a message's content parts as a list, else `string`.
    SGLang's rule (`detect_jinja_template_content_format`, after vLLM's): a template that mentions media
    (`image`, `audio`, `video`, `vision`), or loops over `message.content` (or `msg.content`, `m.content`,
    through filters, tests and slices), takes the list."""
    if any(w in template for w in ("image", "audio", "video", "vision")):
        return "openai"
    try:  # parsed in the environment apply_chat_template renders with (it knows `{% generation %}`)
        tree = _compile_jinja_template(template).environment.parse(template)
    except jinja2.TemplateError:
        return "string"
    return "openai" if any(_message_content(loop.iter) for loop in tree.find_all(nodes.For)) else "string"


def _message_content(node: nodes.Node | None) -> bool:
    while isinstance(node, (nodes.Filter, nodes.Test)) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if isinstance(node, nodes.Getattr):
        owner, key = node.node, node.attr
    elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        owner, key = node.node, node.arg.value
    else:
        return False
    return key == "content" and isinstance(owner, nodes.Name) and owner.name in ("message", "msg", "m")


_CLOCK_LOCK = threading.Lock()


@contextlib.contextmanager
def _clock_at(instant: datetime.datetime) -> Iterator[None]:
    """transformers' `strftime_now` (templates that write today's date or the time: gpt-oss, Llama-3.2,
    Hunyuan to the second) reads the clock at `instant`: every rendering of one renderer writes the same time,
    so a prompt and its turn, rendered a moment apart, still share their prefix. (A template cannot be given
    its own clock: transformers turns callables passed to a template into text.)"""
    real = getattr(hf_templates, "datetime", None)
    if not (isinstance(real, type) and issubclass(real, datetime.datetime)):
        yield  # a transformers without that clock: nothing to hold
        return

    class Held(real):  # type: ignore[misc, valid-type]
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> datetime.datetime:
            return instant if tz is None else instant.astimezone(tz)

    with _CLOCK_LOCK:
        hf_templates.datetime = Held
        try:
            yield
        finally:
            hf_templates.datetime = real


def _object_arguments(call: Any) -> Any:
    """The tool call with arguments given as a JSON-object string parsed into the object (module docstring)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the text as written
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


def _string_arguments(m: dict[str, Any]) -> dict[str, Any]:
    """The message with its tool calls' object arguments written as JSON strings (the OpenAI format)."""
    calls = m.get("tool_calls") if m.get("role") == "assistant" else None
    if not calls:
        return m
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        out.append({**c, "function": {**fn, "arguments": json.dumps(args, ensure_ascii=False)}}
                   if isinstance(fn, dict) and isinstance(args, dict) else c)
    return {**m, "tool_calls": out}


def _template_words(e: BaseException, template: str) -> str:
    """The error raised inside the template, with the template's line it was raised at."""
    lines = template.splitlines()
    at = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == "<template>" and f.lineno]
    if not at or at[-1] > len(lines):
        return f"{type(e).__name__}: {e}"
    line = lines[at[-1] - 1].strip()
    return f"{type(e).__name__}: {e}, at template line {at[-1]}: `{line[:200]}{' ...' if len(line) > 200 else ''}`"


@dataclass
class TemplateFacts:
    """What the probe learned about a template (see the module docstring)."""

    stop_ids: frozenset[int]
    content_header: tuple[int, ...] = ()
    renders_reasoning: bool = False
    generation_prompt: tuple[int, ...] = ()
    notes: list[str] = field(default_factory=list)
    after_stop: frozenset[tuple[int, ...]] = frozenset()  # what a last turn's stop token is followed by
    reasoning_slot: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (opener, closer) of reasoning
    writes_stop: bool = True
    next_stops: tuple[tuple[str, int], ...] = ()  # (role of the next message, its header's stop token)
    renders_tool_results: bool = True


class TemplateRenderer:
    """Renders with one tokenizer, template and `chat_template_kwargs`; caches token ids per text."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConfigError("the tokenizer has no chat_template: set one (tokenizer_config.json or `chat_template`)")
        if isinstance(template, dict):  # several named templates: the default one renders chats
            template = template.get("default") or next(iter(template.values()))
        self.tokenizer = tokenizer
        self.template: str = template
        self.content_format = content_format(template)
        self._clock = datetime.datetime.now() if "strftime_now" in template else None  # see `_clock_at`
        self.kwargs = dict(chat_template_kwargs or {})
        self.reasoning_fields = tuple(f for f in REASONING_FIELDS if _reads_field(template, f)) or (
            "reasoning_content",)
        self.variables = check_kwargs(template, self.kwargs, self._probe_renderings)  # a key it never reads: error
        self._ids: dict[str, list[int]] = {}
        self._facts: TemplateFacts | None = None
        self._special: frozenset[int] | None = None
        self._slot: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.notes: list[str] = []
        added = {str(t): i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self.added = added  # text of each added token -> its id (the tokenizer splits these out of any text)
        self._split: re.Pattern[str] | None = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
            if added else None)

    # ------------------------------------------------------------------------------------------- text

    def _prepare(self, m: dict[str, Any], drop_empty_content: bool) -> dict[str, Any]:
        if "content_parts" in m:  # the content's parts (conversations.py); not once a probe replaced the content
            m = as_openai(m) if self.content_format == "openai" else \
                {k: v for k, v in m.items() if k != "content_parts"}
        if m.get("role") != "assistant":
            return m
        out = {k: v for k, v in m.items() if k != "reasoning_content"}
        if m.get("tool_calls"):
            out["tool_calls"] = [_object_arguments(c) for c in m["tool_calls"]]
        r = m.get("reasoning_content")
        if r is not None:
            for f in self.reasoning_fields:
                out[f] = r
        if drop_empty_content and out.get("content") == "" and (m.get("tool_calls") or r):
            del out["content"]
        return out

    def _apply(self, msgs: list[dict[str, Any]], tools: Any, gen: bool, kwargs: Mapping[str, Any] | None = None
               ) -> str:
        with _clock_at(self._clock) if self._clock else contextlib.nullcontext():
            out = self.tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False,
                                                     **(self.kwargs if kwargs is None else kwargs))
        if not isinstance(out, str):
            raise TemplateError(f"apply_chat_template returned {type(out).__name__}, expected a string")
        return out

    def render(self, messages: list[dict[str, Any]], tools: Any = None, add_generation_prompt: bool = False) -> str:
        try:
            return self._apply([self._prepare(m, False) for m in messages], tools, add_generation_prompt)
        except Exception as e:
            alt = [self._prepare(m, True) for m in messages]
            if alt == [self._prepare(m, False) for m in messages]:
                self._refuse_string_arguments(e, alt, tools, add_generation_prompt)
                raise
            try:
                return self._apply(alt, tools, add_generation_prompt)
            except Exception as again:
                self._refuse_string_arguments(again, alt, tools, add_generation_prompt)
                raise

    def _refuse_string_arguments(self, e: Exception, msgs: list[dict[str, Any]], tools: Any, gen: bool) -> None:
        """A template that fails on tool-call arguments given as an object, and renders them as a JSON string, joins
        them as a string: SGLang passes them as the object (`serving_chat.normalize_assistant_tool_call_arguments`
        parses the string), as `_prepare` does, so the server fails on this conversation too. Raises a
        TemplateError saying so, with the template's own words; returns when that is not the cause."""
        as_text = [_string_arguments(m) for m in msgs]
        if as_text == msgs:
            return
        try:
            self._apply(as_text, tools, gen)
        except Exception:  # noqa: BLE001 - it fails with string arguments too: another cause, its own error
            return
        raise TemplateError(
            f"the chat template fails on tool-call arguments given as an object ({_template_words(e, self.template)}) "
            f"and renders them given as a JSON string: it joins them to text as a string. SGLang passes a history "
            f"tool call's arguments to the template as the object (serving_chat.normalize_assistant_tool_call_"
            f"arguments parses a JSON string), as hsextract does, so the server fails on this conversation as well: "
            f"set a `chat_template` that serialises them (`arguments | tojson`, or `arguments if arguments is string "
            f"else arguments | tojson`)", reason=TOOL_ARGUMENTS_AS_STRING) from e

    def _probe_renderings(self, kwargs: Mapping[str, Any]) -> list[str]:
        """A few conversations (a prompt, a reasoning turn, a tool call and its result) rendered under `kwargs`,
        each as its text or its error: where a template's variables cannot all be listed, a kwarg that changes
        none of these is taken as unread (`template_kwargs.check_kwargs`)."""
        user = {"role": "user", "content": "hi"}
        call = {"type": "function", "id": "call00001", "function": {"name": "f", "arguments": {"x": "1"}}}
        convs = [([user], True),
                 ([user, {"role": "assistant", "content": "a", "reasoning_content": "r"}], False),
                 ([{"role": "system", "content": "s"}, user, {"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "content": "t", "tool_call_id": "call00001", "name": "f"},
                   {"role": "assistant", "content": "a", "reasoning_content": "r"}, user], True)]
        out = []
        for msgs, gen in convs:
            try:
                out.append(self._apply([self._prepare(m, False) for m in msgs], None, gen, kwargs))
            except Exception as e:  # noqa: BLE001 - a kwarg that changes the template's refusal is read too
                out.append(f"{type(e).__name__}: {e}")
        return out

    # ------------------------------------------------------------------------------------------ tokens

    def _full_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _piece_ids(self, piece: str) -> list[int]:
        got = self._ids.get(piece)
        if got is None:
            if len(self._ids) > 65536:
                self._ids.clear()
            got = self._full_ids(piece)
            self._ids[piece] = got
        return got

    def text(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens and spacing as they are."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def ids(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added). The renders of one conversation share most of their
        text, so the text is cut at added tokens (which tokenizers split out before anything else) and each
        piece is tokenized once. `verify` checks that against a whole tokenization; a tokenizer for which it
        does not hold (added tokens that strip spaces, a prefix space per piece) is then tokenized whole."""
        if self._split is None:
            return self._full_ids(text)
        out: list[int] = []
        for k, piece in enumerate(self._split.split(text)):
            if not piece:
                continue
            out.extend([self.added[piece]] if k % 2 else self._piece_ids(piece))
        return out

    def verify(self, text: str) -> list[int]:
        """Whole tokenization of `text`; turns piecewise tokenization off for good if it differs."""
        full = self._full_ids(text)
        if self._split is not None and self.ids(text) != full:
            self._split = None
            self.notes.append("piecewise tokenization differs from whole tokenization: tokenizing whole texts")
        return full

    def render_ids(self, messages: list[dict[str, Any]], tools: Any = None, add_generation_prompt: bool = False
                   ) -> list[int]:
        return self.ids(self.render(messages, tools, add_generation_prompt))

    # ------------------------------------------------------------------------------------------- probe

    def special_ids(self) -> frozenset[int]:
        """The tokenizer's special and added token ids (fixed per tokenizer: found once, asked for per turn)."""
        if self._special is None:
            tok = self.tokenizer
            self._special = frozenset(getattr(tok, "all_special_ids", []) or []) | frozenset(
                (getattr(tok, "added_tokens_decoder", None) or {}).keys())
        return self._special

    def facts(self) -> TemplateFacts:
        if self._facts is None:
            self._facts = self._probe()
        return self._facts

    def _probe(self) -> TemplateFacts:
        special = self.special_ids()
        eos = self.tokenizer.eos_token_id
        stop = {t for t in (eos if isinstance(eos, list) else [eos]) if t is not None}
        user = [{"role": "user", "content": "hi"}]
        notes: list[str] = []
        try:
            p = self.render_ids(user, None, True)
        except Exception as e:  # noqa: BLE001 - a template that cannot render a lone user turn has no probe
            return TemplateFacts(frozenset(stop), notes=[f"probe failed: {e}"])
        b = self.render_ids(user)
        gen = tuple(p[len(b):]) if is_prefix(b, p) else ()
        header: tuple[int, ...] = ()
        renders_reasoning = False
        after: set[tuple[int, ...]] = set()
        slot: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._slot = None
        variants = [{"content": SENT[0]},
                    {"content": SENT[0], "tool_calls": [{"type": "function", "function": {
                        "name": "f", "arguments": {"x": SENT[0]}}}]}]
        writes_stop = True
        next_stops: list[tuple[str, int]] = []
        for v in variants:
            try:
                turn = [self.render_ids(user + [{"role": "assistant", **v, "content": s}]) for s in SENT]
            except Exception as e:  # noqa: BLE001 - e.g. a template without tool calls
                notes.append(f"probe {sorted(v)} failed: {e}")
                continue
            tail = turn[0][len(turn[0]) - common_suffix(turn[0], turn[1]):]
            at = [k for k, t in enumerate(tail) if t in special]
            if "tool_calls" not in v and turn[0] != turn[1]:  # (equal: the tokenizer cannot show the sentinels)
                writes_stop = bool(at)
            if at and writes_stop:
                # a plain turn's stop is the first special token after it (Phi-3 appends eos after its `<|end|>`);
                # a tool call's own markup closes before the stop, the last one (DeepSeek's calls end)
                k = at[-1] if "tool_calls" in v else at[0]
                stop.add(tail[k])
                after.add(tuple(tail[k + 1:]))
            if "tool_calls" not in v:  # a turn in history: its stop token is the first special one after it
                nexts = [("user", user)] + ([] if writes_stop else [("tool", [{"role": "tool", "content": "r"}])])
                for role, nxt in nexts:
                    try:
                        hist = [self.render_ids(user + [{"role": "assistant", "content": s}] + nxt) for s in SENT]
                    except Exception as e:  # noqa: BLE001 - templates that require alternation end here
                        notes.append(f"history probe ({role}) failed: {e}")
                        continue
                    if writes_stop:
                        first = [t for t in hist[0][common_prefix(hist[0], hist[1]):] if t in special]
                        stop.update(first[:1])
                        continue
                    # no stop written: the next message's header, right after the turn, is what ends it
                    after_turn = hist[0][len(hist[0]) - common_suffix(hist[0], hist[1]):]
                    if after_turn[:1] and after_turn[0] in special:
                        stop.add(after_turn[0])
                        next_stops.append((role, after_turn[0]))
            h = self._probe_header(user, v, p, gen)
            slot = slot or self._slot
            if h is not None:
                renders_reasoning = True
                header = header or h
        return TemplateFacts(frozenset(stop), header, renders_reasoning, gen, notes, frozenset(after), slot,
                             writes_stop, tuple(next_stops), self._renders_tool_results(user))

    def _renders_tool_results(self, user: list[dict[str, Any]]) -> bool:
        call = {"type": "function", "id": "call00001", "function": {"name": "f", "arguments": {"x": "1"}}}
        msgs = user + [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "content": SENT[0], "tool_call_id": "call00001", "name": "f"}]
        try:
            return SENT[0] in self.render(msgs, None, True)
        except Exception:  # noqa: BLE001 - the template refuses tool messages, in its own words, when they come
            return True

    def _probe_header(self, user: list[dict[str, Any]], v: dict[str, Any], p: list[int], gen: tuple[int, ...]
                      ) -> tuple[int, ...] | None:
        """The content header of a reasoning turn (see module docstring); None if reasoning is not rendered."""
        def turn(content: str, reasoning: str | None) -> list[int]:
            m = {"role": "assistant", **v, "content": content}
            if reasoning is not None:
                m["reasoning_content"] = reasoning
            return self.render_ids(user + [m])

        try:
            plain = [turn(s, None) for s in SENT]
            with_r = [turn(SENT[0], r) for r in SENT_REASONING] + [turn(SENT[1], SENT_REASONING[0])]
        except Exception:  # noqa: BLE001 - the template refuses reasoning here
            return None
        if with_r[0] == plain[0] or not is_prefix(p, with_r[0]):
            return None
        if not is_prefix(p, plain[0]):  # rendered, but a turn without it drops the prompt's opener (GLM-4.7)
            return ()
        r_end = len(with_r[0]) - common_suffix(with_r[0], with_r[1])
        closer = with_r[0][r_end:common_prefix(with_r[0], with_r[2])]
        f0 = plain[0][len(p):common_prefix(plain[0], plain[1])]
        special = self.special_ids()
        opener = with_r[0][len(p):common_prefix(with_r[0], with_r[1])]
        # Reasoning between special tokens, and a turn without it that keeps only their markup (Kimi:
        # `<think>` in the prompt, `</think>` after): the reasoning of a turn the template never renders with
        # its reasoning can be put back there (`reasoning_slot`).
        before = (list(p) + opener)[-1:]
        if f0 == opener + closer and closer and closer[0] in special and before and before[0] in special:
            self._slot = (tuple(opener), tuple(closer))
        for h in (list(gen) + f0, f0):
            if h and len(closer) > len(h) and closer[len(closer) - len(h):] == h \
                    and closer[len(closer) - len(h) - 1] in special:
                return tuple(h)
        return ()


__all__ = ["REASONING_FIELDS", "SENT", "SENT_REASONING", "TEMPLATE_ERROR", "TOOL_ARGUMENTS_AS_STRING", "TemplateError",
           "TemplateFacts", "TemplateRenderer", "common_prefix", "content_format", "common_suffix", "failure",
           "is_prefix"]
