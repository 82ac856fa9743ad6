"""Conversations: each raw record of a source (hsextract.prepare.sources reads them) normalized to one message type,
and the mixture of the sources' records.
One module, over 400 lines: every record format's normalization, whose branches share the message checks.

Normalized conversation: a list of messages, each a dict with
  role: "system" | "user" | "assistant" | "tool"
  content: str                      (may be "" only for an assistant turn that has tool_calls or reasoning, and
                                     a tool's result given as "")
  content_parts: list[str]          (only where the record gave content as a list of text parts: their texts;
                                     `content` is then they joined with a space, the text SGLang renders for a
                                     template that takes a string; see `masks.rendering.content_format`)
  reasoning_content: str            (assistant only, optional; from `reasoning_content`, `thinking` or `reasoning`,
                                     else from `thinking` content parts, as Mistral writes reasoning)
  tool_calls: list[{"type": "function", "function": {"name": str, "arguments": str | dict}, "id"?: str}]
                                    (an assistant's legacy OpenAI `function_call: {name, arguments}` is the one
                                    tool call it makes; refused beside `tool_calls`)
  tool_call_id: str, name: str      (optional, carried through)
Keys that a record does not have are absent (templates test `'tool_calls' in message`).
Record-level `tools` (function definitions) are carried in `Conversation.tools` for the template.

Input formats (`format:` of a source; `auto` picks per file and record):
  messages   JSONL / JSON list / parquet rows with `messages: [{role, content, ...}]` (OpenAI; an assistant's
             legacy `function_call` is its tool call, the `function` role a tool result)
  sharegpt   rows with `conversations: [{from, value}]` (human/gpt/system/tool/function_call/observation...), or
             OpenAI messages `[{role, content, ...}]` under `conversations` (as many Hugging Face datasets write
             them; the record's first entry says which: `role` without `from`)
  ultrachat  rows with `messages` or `data`: a list of strings alternating user/assistant, or role dicts
  hf_disk    a directory written by `datasets.save_to_disk` (Dataset, or DatasetDict with `split:`), rows
             of any of the formats above
In every format an optional top-level `system` string is the conversation's system message (refused where
the messages open with another one).
A malformed record is a MalformedRecordError naming its location (hsextract.prepare.sources) and reason; a
string the record gives the template (any depth) that holds a lone UTF-16 surrogate (JSON's `\\ud83c` without its
pair: text cut inside an emoji) is `non_utf8`, as no UTF-8 text holds it.

Mixture: source i contributes k_i = min(max_records, round(weight_i * n_i)) records, where n_i is its
number of input records (malformed ones included: chunks are cut over input records). weight < 1
takes a seeded random subset, weight > 1 repeats the source (whole passes, then a seeded subset); the
contributions are then shuffled together with `numpy.random.default_rng(seed)`. Counting needs no
parsing of JSONL or parquet content, so `count_records` is cheap.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsextract.config.settings import Source
from hsextract.errors import ConfigError
from hsextract.prepare.sources import (
    BAD_JSON,
    EMPTY_CONTENT,
    MISSING_MESSAGES,
    MISSING_ROLE,
    NON_UTF8,
    UNKNOWN_ROLE,
    WRONG_TYPE,
    MalformedRecordError,
    Reader,
    SourceEntry,
    open_reader,
    parse_sources,
)

_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                 "tool": "tool", "function": "tool"}
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "model": "assistant",
                   "tool": "tool", "function_response": "tool", "observation": "tool", "ipython": "tool",
                   "function_call": "assistant"}
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Bad(Exception):
    """Internal: a record-level problem, turned into MalformedRecordError or a lenient count."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    # indices of assistant messages given `weight: 0` (OpenAI's fine-tuning format): context, never trained
    untrained: frozenset[int] = frozenset()


def conversation_hash(conv: Conversation) -> str:
    """What `dedup` compares: the messages and tools, key order aside."""
    body: dict[str, Any] = {"messages": conv.messages, "tools": conv.tools}
    if conv.untrained:  # only then: the hashes of records without weights stay what they were
        body["untrained"] = sorted(conv.untrained)
    payload = json.dumps(body, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class MixtureEntry:
    """One input record in mixture order."""

    source: int  # index into the source list
    index: int  # record index inside its source (0-based)
    repeat: int  # 0 for the first use, >0 when weight > 1 repeats it
    sample_id: str


# ------------------------------------------------------------------------------------------ normalization


def _check_text(value: Any, where: str) -> None:
    """Refuse a string of `value` (at any depth, keys too) that holds a lone UTF-16 surrogate: JSON's `\\ud83c`
    without its other half (scraped text cut inside an emoji) decodes to a code point that is no text, which
    UTF-8 cannot encode: the record's hash, the template and the tokenizer would fail on it."""
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        if m:
            raise _Bad(NON_UTF8, f"{where} holds a lone UTF-16 surrogate (\\u{ord(m.group()):04x} at character "
                                 f"{m.start()}: half of a character cut in two, such as an emoji), which is not text "
                                 "UTF-8 can encode")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_text(k, f"{where} (a key)")
            _check_text(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{where}[{i}]")


def _text(value: Any, where: str) -> str:
    """Content as a string: str or None -> "" (OpenAI content parts: `_parts`)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    raise _Bad(WRONG_TYPE, f"{where}: content must be a string or a list of text parts, got {type(value).__name__}")


def _parts(value: list[Any], where: str, role: str) -> tuple[list[str], list[str]]:
    """The texts of OpenAI content parts (`text`, or `input_text` as the Responses API writes it), and of an
    assistant's `thinking` parts (Mistral's reasoning chunks: `{"type": "thinking", "thinking": str}`)."""
    texts, thinking = [], []
    for p in value:
        if isinstance(p, Mapping) and p.get("type", "text") in ("text", "input_text") and \
                isinstance(p.get("text"), str):
            texts.append(p["text"])
        elif role == "assistant" and isinstance(p, Mapping) and p.get("type") == "thinking" and \
                isinstance(p.get("thinking"), str):
            thinking.append(p["thinking"])
        else:
            raise _Bad(WRONG_TYPE, f"{where}: only text content parts are supported, got {p!r:.80}")
    return texts, thinking


def as_openai(msg: dict[str, Any]) -> dict[str, Any]:
    """A normalized message as a record writes it: content parts as the list they came as."""
    parts = msg.get("content_parts")
    out = {k: v for k, v in msg.items() if k != "content_parts"}
    if parts is not None and msg.get("content") == " ".join(parts):
        out["content"] = [{"type": "text", "text": p} for p in parts]
    return out


def _tool_call(tc: Any, at: str, fn_path: str = "function.") -> dict[str, Any]:
    """One tool call (at `at`: `fn_path` is where its name and arguments are, as the error messages say)."""
    if not isinstance(tc, Mapping):
        raise _Bad(WRONG_TYPE, f"{at} must be an object")
    _check_text(tc, at)
    fn = tc.get("function", tc)  # also accept the flat {name, arguments} form
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _Bad(WRONG_TYPE, f"{at} needs {fn_path}name (a string)")
    args = fn.get("arguments", {})
    if not isinstance(args, (str, Mapping)):
        raise _Bad(WRONG_TYPE, f"{at}.{fn_path}arguments must be a string or an object")
    if isinstance(args, str):  # the template gets a JSON-object string as the object (masks.rendering)
        try:
            _check_text(json.loads(args), f"{at}.{fn_path}arguments (parsed as JSON)")
        except ValueError:
            pass  # not JSON: the template gets the text, checked above
    call: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    given = tc.get("id")
    if given is not None:  # a number is its text, as the tool message that answers it names it
        if isinstance(given, bool) or not isinstance(given, (str, int)):
            raise _Bad(WRONG_TYPE, f"{at}.id must be a string, got {type(given).__name__}")
        call["id"] = str(given)
    return call


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise _Bad(WRONG_TYPE, f"{where}: tool_calls must be a list, got {type(value).__name__}")
    return [_tool_call(tc, f"{where}.tool_calls[{k}]") for k, tc in enumerate(value)]


def _message(raw: Any, role_map: Mapping[str, str], role_key: str, content_key: str, where: str) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise _Bad(WRONG_TYPE, f"{where} must be an object, got {type(raw).__name__}")
    if role_key not in raw or raw[role_key] is None:
        raise _Bad(MISSING_ROLE, f"{where} has no `{role_key}`")
    src_role = raw[role_key]
    if not isinstance(src_role, str):
        raise _Bad(WRONG_TYPE, f"{where}.{role_key} must be a string, got {type(src_role).__name__}")
    if src_role not in role_map:
        raise _Bad(UNKNOWN_ROLE, f"{where} has unknown role {src_role!r}; known: {sorted(role_map)}")
    role = role_map[src_role]
    msg: dict[str, Any] = {"role": role}
    _check_text(raw.get(content_key), f"{where}.{content_key}")
    if src_role == "function_call":
        # ShareGPT function_call: the value is a JSON object {name, arguments}.
        try:
            call = json.loads(raw.get(content_key) or "")
        except (json.JSONDecodeError, TypeError):
            raise _Bad(WRONG_TYPE, f"{where}: a function_call value must be a JSON object {{name, arguments}}") \
                from None
        _check_text(call, f"{where}.{content_key} (parsed as JSON)")
        msg["content"] = ""
        msg["tool_calls"] = _tool_calls([call], where)
    elif isinstance(raw.get(content_key), list):
        parts, thinking = _parts(raw[content_key], f"{where}.{content_key}", role)
        msg["content"] = " ".join(parts)
        if parts:
            msg["content_parts"] = parts
        if "".join(thinking) and not any(raw.get(k) for k in _REASONING_KEYS):
            msg["reasoning_content"] = "".join(thinking)
    else:
        msg["content"] = _text(raw.get(content_key), f"{where}.{content_key}")
    if "tool_calls" in raw and raw["tool_calls"] is not None and role == "assistant":
        calls = _tool_calls(raw["tool_calls"], where)
        if calls:
            msg["tool_calls"] = calls
    elif raw.get("tool_calls"):  # a table's empty column (None, []) is no call
        raise _Bad(WRONG_TYPE, f"{where} ({role}) has tool_calls: only assistant messages call tools")
    if raw.get("function_call") is not None:  # OpenAI's legacy form of one tool call: {name, arguments}
        if role != "assistant":
            raise _Bad(WRONG_TYPE, f"{where} ({role}) has function_call: only assistant messages call tools")
        if msg.get("tool_calls"):
            raise _Bad(WRONG_TYPE, f"{where} has both `function_call` (the legacy form of one tool call) and "
                                   "`tool_calls`: which calls the assistant made is not known; keep one")
        if not isinstance(raw["function_call"], Mapping):
            raise _Bad(WRONG_TYPE, f"{where}.function_call must be an object {{name, arguments}}, got "
                                   f"{type(raw['function_call']).__name__}")
        msg["tool_calls"] = [_tool_call(raw["function_call"], f"{where}.function_call", fn_path="")]
    if role == "assistant":
        for key in _REASONING_KEYS:
            r = raw.get(key)
            if r is None:
                continue
            if not isinstance(r, str):
                raise _Bad(WRONG_TYPE, f"{where}.{key} must be a string, got {type(r).__name__}")
            _check_text(r, f"{where}.{key}")
            if r:  # an empty one (a table's column for a message without it, say) gives way to the next key
                msg["reasoning_content"] = r
                break
    for key in ("tool_call_id", "name"):
        v = raw.get(key)
        if v is not None:
            if not isinstance(v, str):
                raise _Bad(WRONG_TYPE, f"{where}.{key} must be a string, got {type(v).__name__}")
            _check_text(v, f"{where}.{key}")
            msg[key] = v
    # a tool's empty result given as such ("": a command that printed nothing) is what the model saw; a missing,
    # null or empty-list content, and any other empty message, is a column read wrong, more likely than nothing
    if not msg["content"].strip() and not msg.get("tool_calls") and not msg.get("reasoning_content") \
            and not (role == "tool" and isinstance(raw.get(content_key), str)):
        raise _Bad(EMPTY_CONTENT, f"{where} ({role}) has empty content")
    weight = raw.get("weight")
    if weight is not None and (isinstance(weight, bool) or not (isinstance(weight, int | float) and weight in (0, 1))):
        raise _Bad(WRONG_TYPE, f"{where}.weight must be 0 or 1 (whether the message is trained, as in OpenAI's "
                               f"fine-tuning format), got {weight!r}")
    return msg


def _weight_zero(raw: Any) -> bool:
    """A message given `weight: 0` (checked by _message)."""
    return isinstance(raw, Mapping) and raw.get("weight") is not None and raw["weight"] == 0


def _alternating(items: list[Any], key: str) -> list[dict[str, Any]]:
    msgs = []
    for k, text in enumerate(items):
        where = f"{key}[{k}]"
        if not isinstance(text, str):
            raise _Bad(WRONG_TYPE, f"{where} must be a string (alternating user/assistant turns)")
        if not text.strip():
            raise _Bad(EMPTY_CONTENT, f"{where} is empty")
        _check_text(text, where)
        msgs.append({"role": "user" if k % 2 == 0 else "assistant", "content": text})
    return msgs


def normalize_record(obj: Any, fmt: str = "auto") -> Conversation:
    """One decoded record -> Conversation. Raises _Bad(reason, detail) (internal) when malformed."""
    if not isinstance(obj, Mapping):
        raise _Bad(WRONG_TYPE, f"a record must be a JSON object, got {type(obj).__name__}")
    if obj.get("messages") == [] and isinstance(obj.get("malformed"), str) and obj["malformed"]:
        # regenerate's line for an input record it left out: counted under the reason it gives, as without it
        raise _Bad(obj["malformed"], "regenerate left this input record out for that reason (its regenerate chunk's "
                                     "stats say more)")
    if fmt == "auto" or fmt == "hf_disk":
        if "conversations" in obj:
            fmt = "sharegpt"
        elif "messages" in obj or "data" in obj:
            items = obj.get("messages", obj.get("data"))
            fmt = "ultrachat" if isinstance(items, list) and items and isinstance(items[0], str) else \
                ("messages" if "messages" in obj else "ultrachat")
        else:
            raise _Bad(MISSING_MESSAGES, f"no `messages`, `conversations` or `data` key (keys: {sorted(obj)[:8]})")
    if fmt == "sharegpt":
        key = "conversations"
        items = obj.get(key)
    elif fmt == "messages":
        key = "messages"
        items = obj.get(key)
    else:
        key = "messages" if "messages" in obj else "data"
        items = obj.get(key)
    if items is None:  # the source's format names another layout than its records': say which reads them
        other = next((f"; it has `{k}`: the source's `format: {f}` (or `auto`) reads them" for k, f in
                      (("conversations", "sharegpt"), ("messages", "messages"), ("data", "ultrachat"))
                      if k != key and k in obj), "")
        raise _Bad(MISSING_MESSAGES, f"no `{key}` list in the record{other}")
    if not isinstance(items, list):
        raise _Bad(WRONG_TYPE, f"`{key}` must be a list, got {type(items).__name__}")
    if not items:
        raise _Bad(MISSING_MESSAGES, f"`{key}` is empty")
    # by value, not key: a table mixing both kinds gives every message both keys, the unused one null
    openai = isinstance(items[0], Mapping) and items[0].get("role") is not None and items[0].get("from") is None
    if fmt == "sharegpt" and not openai:
        msgs = [_message(m, _SHAREGPT_ROLES, "from", "value", f"{key}[{k}]") for k, m in enumerate(items)]
    elif fmt == "ultrachat" and isinstance(items[0], str):
        msgs = _alternating(items, key)
    else:
        msgs = [_message(m, _OPENAI_ROLES, "role", "content", f"{key}[{k}]") for k, m in enumerate(items)]
    untrained = [k for k, m in enumerate(items) if _weight_zero(m) and msgs[k]["role"] == "assistant"]
    system = obj.get("system")  # a record's system prompt beside its messages, in any format
    if system is not None:
        if not isinstance(system, str):
            raise _Bad(WRONG_TYPE, f"`system` must be a string, got {type(system).__name__}")
        _check_text(system, "system")
        if system.strip() and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": system})
            untrained = [k + 1 for k in untrained]
        elif system.strip() and msgs[0]["content"] != system:
            raise _Bad(WRONG_TYPE, f"`system` and `{key}[0]`, a system message, differ: which one the target saw "
                                   "is not known; keep one")
    tools = obj.get("tools")
    if isinstance(tools, str):  # some datasets store the tool list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise _Bad(WRONG_TYPE, "`tools` is a string that is not JSON") from None
    if tools is not None and not isinstance(tools, list):
        raise _Bad(WRONG_TYPE, f"`tools` must be a list, got {type(tools).__name__}")
    _check_text(tools, "tools")
    return Conversation(messages=msgs, tools=tools or None, untrained=frozenset(untrained))


def decode_raw(raw: Any) -> Any:
    """JSONL bytes -> object; dict rows pass through. Raises _Bad for non-UTF-8 and bad JSON."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Bad(NON_UTF8, f"the line is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})") \
                from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise _Bad(BAD_JSON, f"invalid JSON: {e.msg} at column {e.colno}") from None
    return raw


# ---------------------------------------------------------------------------------------------- sources


@dataclass
class OpenSource:
    """A source (its name resolved by parse_sources) and the reader of its records."""

    spec: Source
    reader: Reader = field(repr=False)

    def __len__(self) -> int:
        return len(self.reader)

    def read(self, i: int) -> tuple[str, Conversation]:
        """(location, conversation) of record i; MalformedRecordError (file, line, reason) when malformed."""
        location, raw = self.reader.raw(i)
        try:
            return location, normalize_record(decode_raw(raw), self.spec.format)
        except _Bad as b:
            raise MalformedRecordError(location, b.reason, b.detail) from None


def open_sources(sources: Sequence[SourceEntry]) -> list[OpenSource]:
    return [OpenSource(spec, _open(i, spec)) for i, spec in enumerate(parse_sources(sources))]


def _open(i: int, spec: Source) -> Reader:
    """Source i's reader; an error opening it names its key (`sources[i].path`) before what was wrong."""
    try:
        return open_reader(spec)
    except MalformedRecordError:
        raise
    except ConfigError as e:
        if str(e).startswith(("sources[", "config key `sources[")):
            raise
        key = "split" if "split" in str(e) else "path"  # a DatasetDict's split missing or not there
        raise ConfigError(f"sources[{i}].{key}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any reader error means this source is unusable: say which
        raise ConfigError(f"sources[{i}].path: cannot read the records of {spec.path} "
                          f"({type(e).__name__}: {e})") from None


def source_contribution(n: int, spec: Source) -> int:
    k = int(math.floor(spec.weight * n + 0.5))
    return k if spec.max_records is None else min(k, spec.max_records)


def _pick(n: int, k: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """k (index, repeat) pairs from n records: whole passes, then a seeded subset, each in file order."""
    out: list[tuple[int, int]] = []
    if n == 0:
        return out
    full, rest = divmod(k, n)
    for rep in range(full):
        out.extend((i, rep) for i in range(n))
    if rest:
        out.extend((int(i), full) for i in np.sort(rng.permutation(n)[:rest]))
    return out


def mixture(sources: Sequence[OpenSource], seed: int) -> list[MixtureEntry]:
    """All selected records of all sources, shuffled together; reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    entries: list[MixtureEntry] = []
    for s_idx, src in enumerate(sources):
        n = len(src)
        for i, rep in _pick(n, source_contribution(n, src.spec), rng):
            sid = f"{src.spec.name}:{i}" + (f"#{rep}" if rep else "")
            entries.append(MixtureEntry(source=s_idx, index=i, repeat=rep, sample_id=sid))
    order = rng.permutation(len(entries))
    return [entries[int(j)] for j in order]


def count_records(sources: Sequence[SourceEntry]) -> int:
    """Number of input records the mixture holds (caps and weights applied), without parsing JSONL/parquet
    content. This is what chunks are cut over: ceil(count_records / prompts_per_chunk) chunks."""
    return sum(taken for _, _, taken in source_records(sources))


def source_records(sources: Sequence[SourceEntry]) -> list[tuple[str, int, int]]:
    """Per source, in order: its path, the records it holds, the records the mixture takes from it."""
    out = []
    for i, spec in enumerate(parse_sources(sources)):  # one spec per entry, in order
        n = len(_open(i, spec))
        out.append((str(spec.path), n, source_contribution(n, spec)))
    return out


def no_records(sources: Sequence[SourceEntry]) -> str:
    """Why the mixture is empty, source by source (for the error that says so)."""
    return "; ".join(f"sources[{i}].path {path}: {n} records" + ("" if taken == n else f", {taken} taken (weight, "
                                                                  "max_records)")
                     for i, (path, n, taken) in enumerate(source_records(sources)))


def iter_conversations(sources: Sequence[SourceEntry], seed: int = 0, strict: bool = True,
                       counts: dict[str, int] | None = None) -> Iterator[tuple[MixtureEntry, Conversation | None]]:
    """Mixture-ordered (entry, conversation). Malformed: strict raises MalformedRecordError; lenient yields
    (entry, None) and adds 1 to `counts[reason]`."""
    opened = open_sources(sources)
    for entry in mixture(opened, seed):
        try:
            _, conv = opened[entry.source].read(entry.index)
        except MalformedRecordError as e:
            if strict:
                raise
            if counts is not None:
                counts[e.reason] = counts.get(e.reason, 0) + 1
            yield entry, None
            continue
        yield entry, conv


# MalformedRecordError (hsextract.prepare.sources) is what OpenSource.read and iter_conversations raise
__all__ = [
    "Conversation", "MalformedRecordError", "MixtureEntry", "OpenSource", "as_openai", "conversation_hash",
    "count_records", "iter_conversations", "mixture", "normalize_record", "open_sources",
]
