"""Rendering conversations with a tokenizer's chat template, to text and to token ids.

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

What the template tells about turns is learned once per template: `facts()` (probe.py).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import threading
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import jinja2
import transformers.utils.chat_template_utils as hf_templates
from jinja2 import nodes
from transformers.utils.chat_template_utils import _compile_jinja_template

from hsextract.errors import ConfigError
from hsextract.masks.kwargs import check_kwargs
from hsextract.masks.probe import TemplateFacts, probe
from hsextract.masks.refusals import REASONING_TAG, TOOL_ARGUMENTS_AS_STRING, TemplateError
from hsextract.prepare.conversations import as_openai

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
PIECE_CACHE_TOKENS = 1_000_000  # the renderer's piece cache, in token ids (~36 bytes each as Python ints)


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


# A chat template's special markers: `<|im_end|>`, `<|eot_id|>`, DeepSeek's full-width `<｜end▁of▁sentence｜>`.
MARKER = re.compile(r"<[|｜][^|｜\s<>]{1,64}[|｜]>")


class TemplateRenderer:
    """Renders with one tokenizer, template and `chat_template_kwargs`; caches token ids per text.

    A tokenizer of several named templates (`default` and `tool_use`: Hermes, Command-R): `name` picks one
    (None: `default`), passed to every rendering; its kwargs are checked against all of them."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None,
                 name: str | None = None) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConfigError("the tokenizer has no chat_template: set `chat_template` (a file, or its text), or "
                              "put the model's template in the tokenizer folder's chat_template.jinja")
        named = dict(template) if isinstance(template, dict) else None
        if named is not None:
            template = named.get(name or "default") or next(iter(named.values()))
        self.tokenizer = tokenizer
        self.template: str = template
        self._named_arg = {"chat_template": template} if named is not None else {}
        self.content_format = content_format(template)
        self._clock = datetime.datetime.now() if "strftime_now" in template else None  # see `_clock_at`
        self.kwargs = dict(chat_template_kwargs or {})
        self.reasoning_fields = tuple(f for f in REASONING_FIELDS if _reads_field(template, f)) or (
            "reasoning_content",)
        # a key it never reads (none of the named templates): error
        self.variables = check_kwargs(named or template, self.kwargs, self._probe_renderings)
        self._ids: dict[str, list[int]] = {}  # piece -> its ids (`ids`)
        self._cached_tokens = 0
        self._facts: TemplateFacts | None = None
        self._special: frozenset[int] | None = None
        self._stop_texts: list[str] | None = None
        self._markup_texts: list[str] | None = None
        self._reasoning_tags: list[str] | None = None
        self.notes: list[str] = []
        added = {str(t): i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self.added = added  # text of each added token -> its id (the tokenizer splits these out of any text)
        self._split: re.Pattern[str] | None = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
            if added else None)
        self._refuse_foreign_markers()

    def _refuse_foreign_markers(self) -> None:
        """A template of another model family (ChatML's `<|im_end|>` over a Llama 3 tokenizer) renders its markers
        as plain text the tokenizer cuts into pieces: no turn then ends in a stop token, and the masks would train
        none, silently. Every `<|...|>` marker a plain chat renders must be one token of this tokenizer."""
        chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]
        try:
            text = self.render(chat, None, True)
        except Exception:  # noqa: BLE001 - a template that refuses this chat is judged on the data, in its words
            return
        vocab = getattr(self.tokenizer, "get_vocab", dict)()
        foreign = sorted({m for m in MARKER.findall(text) if m not in self.added and m not in vocab})
        if foreign:
            raise ConfigError(
                f"the chat template writes {', '.join(foreign)}, which the tokenizer does not have as tokens (it "
                f"cuts each into plain pieces): a template of another model's tokenizer, whose turns would end in no "
                f"stop token. Use this model's own template (`chat_template`, or the tokenizer folder's)")

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
                                                     **self._named_arg, **(self.kwargs if kwargs is None else kwargs))
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
        none of these is taken as unread (`kwargs.check_kwargs`)."""
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
            got = self._full_ids(piece)
            # bounded by tokens, not pieces (a piece may be an 8k-token tool output): at most ~40 MB of ids,
            # enough to keep a repeated tool declaration and one conversation's renders
            if self._cached_tokens + len(got) > PIECE_CACHE_TOKENS:
                self._ids.clear()
                self._cached_tokens = 0
            self._ids[piece] = got
            self._cached_tokens += len(got)
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

    # ------------------------------------------------------------------------------------------- facts

    def special_ids(self) -> frozenset[int]:
        """The tokenizer's special and added token ids (fixed per tokenizer: found once, asked for per turn)."""
        if self._special is None:
            tok = self.tokenizer
            self._special = frozenset(getattr(tok, "all_special_ids", []) or []) | frozenset(
                (getattr(tok, "added_tokens_decoder", None) or {}).keys())
        return self._special

    def facts(self) -> TemplateFacts:
        if self._facts is None:
            self._facts = probe(self)
        return self._facts

    def stop_texts(self) -> list[str]:
        """The template's stop tokens (`facts().stop_ids`) as the text they are written (once per renderer)."""
        if self._stop_texts is None:
            stop_ids = self.facts().stop_ids
            self._stop_texts = [t for t, i in self.added.items() if i in stop_ids]
        return self._stop_texts

    def markup_texts(self) -> list[str]:
        """The added tokens the template writes around the messages of a plain exchange (with and without a system
        message: role headers, separators), less its stop tokens, think tags and begin-of-text, as text (once per
        renderer): markup that a generated turn's fields never hold. (Tool-call markup is not among them: data
        that writes its calls as text in the content renders as the model generates them.)"""
        if self._markup_texts is None:
            seen: set[int] = set()
            exchange = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
            for msgs in (exchange, [{"role": "system", "content": "s"}, *exchange]):
                try:
                    seen |= set(self.render_ids(msgs))
                except Exception:  # noqa: BLE001 - a template that refuses one is judged on the data, in its words
                    continue
            facts = self.facts()
            skip = set(facts.stop_ids) | {i for part in (facts.reasoning_slot or ()) for i in part}
            skip.add(getattr(self.tokenizer, "bos_token_id", None))
            self._markup_texts = [t for t, i in self.added.items()
                                  if i in seen and i not in skip and not REASONING_TAG.fullmatch(t)]
        return self._markup_texts

    def reasoning_tag_texts(self) -> list[str]:
        """The think tags (`<think>`, `</think>`) that are added tokens (once per renderer)."""
        if self._reasoning_tags is None:
            self._reasoning_tags = [t for t in self.added if REASONING_TAG.fullmatch(t)]
        return self._reasoning_tags


__all__ = ["REASONING_FIELDS", "TemplateRenderer", "content_format"]
