"""What a chat template tells about turns, learned once per template (`probe`) from a two-message conversation
rendered with private-use sentinels:

- `stop_ids`: tokens that end a turn: the tokenizer's eos ids and the special token the template writes after
  the message (the first after a plain turn, the last after a tool-call turn), and `after_stop`, the text that
  follows it there (Phi-3: `\\n` + eos);
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
  the `tool` role); true when it is, or when the template refuses the probe (its own error comes first);
- `renders_call_ids`: whether the template writes a tool call's id between Kimi's `<|tool_call_begin|>` and
  `<|tool_call_argument_begin|>` (Kimi-K2.5's: the model writes it there, `masks.tool_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hsextract.masks.ids import common_prefix, common_suffix, is_prefix

if TYPE_CHECKING:
    from hsextract.masks.rendering import TemplateRenderer

# Private-use characters: never in templates, never equal to real text at a diff boundary. The two of a pair
# differ in their first and last UTF-8 byte (EE.. vs EF..; ..80 vs ..81), so their first and last tokens differ
# under any byte-level tokenizer and a token-level common prefix or suffix stops exactly at the sentinel.
SENT = ("\ue000\ue000", "\uf001\uf001")
SENT_REASONING = ("\ue002\ue002", "\uf003\uf003")

Slot = tuple[tuple[int, ...], tuple[int, ...]]  # (opener, closer) of a reasoning block


@dataclass
class TemplateFacts:
    """What the probe learned about a template (see the module docstring)."""

    stop_ids: frozenset[int]
    content_header: tuple[int, ...] = ()
    renders_reasoning: bool = False
    generation_prompt: tuple[int, ...] = ()
    notes: list[str] = field(default_factory=list)
    after_stop: frozenset[tuple[int, ...]] = frozenset()  # what a last turn's stop token is followed by
    reasoning_slot: Slot | None = None
    writes_stop: bool = True
    next_stops: tuple[tuple[str, int], ...] = ()  # (role of the next message, its header's stop token)
    renders_tool_results: bool = True
    renders_call_ids: bool = False


def probe(rd: TemplateRenderer) -> TemplateFacts:
    special = rd.special_ids()
    eos = rd.tokenizer.eos_token_id
    stop = {t for t in (eos if isinstance(eos, list) else [eos]) if t is not None}
    user = [{"role": "user", "content": "hi"}]
    notes: list[str] = []
    try:
        p = rd.render_ids(user, None, True)
    except Exception as e:  # noqa: BLE001 - a template that cannot render a lone user turn has no probe
        return TemplateFacts(frozenset(stop), notes=[f"probe failed: {e}"])
    b = rd.render_ids(user)
    gen = tuple(p[len(b):]) if is_prefix(b, p) else ()
    header: tuple[int, ...] = ()
    renders_reasoning = False
    after: set[tuple[int, ...]] = set()
    slot: Slot | None = None
    variants = [{"content": SENT[0]},
                {"content": SENT[0], "tool_calls": [{"type": "function", "function": {
                    "name": "f", "arguments": {"x": SENT[0]}}}]}]
    writes_stop = True
    next_stops: list[tuple[str, int]] = []
    for v in variants:
        try:
            turn = [rd.render_ids(user + [{"role": "assistant", **v, "content": s}]) for s in SENT]
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
                    hist = [rd.render_ids(user + [{"role": "assistant", "content": s}] + nxt) for s in SENT]
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
        h, found_slot = _probe_header(rd, user, v, p, gen)
        slot = slot or found_slot
        if h is not None:
            renders_reasoning = True
            header = header or h
    return TemplateFacts(frozenset(stop), header, renders_reasoning, gen, notes, frozenset(after), slot,
                         writes_stop, tuple(next_stops), _renders_tool_results(rd, user),
                         _renders_call_ids(rd, user))


def _renders_tool_results(rd: TemplateRenderer, user: list[dict[str, Any]]) -> bool:
    call = {"type": "function", "id": "call00001", "function": {"name": "f", "arguments": {"x": "1"}}}
    msgs = user + [{"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "content": SENT[0], "tool_call_id": "call00001", "name": "f"}]
    try:
        return SENT[0] in rd.render(msgs, None, True)
    except Exception:  # noqa: BLE001 - the template refuses tool messages, in its own words, when they come
        return True


def _renders_call_ids(rd: TemplateRenderer, user: list[dict[str, Any]]) -> bool:
    begin, arguments = "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
    if begin not in rd.added or arguments not in rd.added:
        return False
    call = {"id": "call00001", "type": "function", "function": {"name": "f", "arguments": {}}}
    try:
        text = rd.render(user + [{"role": "assistant", "content": "", "tool_calls": [call]}])
    except Exception:  # noqa: BLE001 - a template that refuses the probe: its ids are left as they are
        return False
    return f"{begin}call00001{arguments}" in text


def _probe_header(rd: TemplateRenderer, user: list[dict[str, Any]], v: dict[str, Any], p: list[int],
                  gen: tuple[int, ...]) -> tuple[tuple[int, ...] | None, Slot | None]:
    """(the content header of a reasoning turn, None if reasoning is not rendered; the reasoning slot, if any)."""
    def turn(content: str, reasoning: str | None) -> list[int]:
        m = {"role": "assistant", **v, "content": content}
        if reasoning is not None:
            m["reasoning_content"] = reasoning
        return rd.render_ids(user + [m])

    try:
        plain = [turn(s, None) for s in SENT]
        with_r = [turn(SENT[0], r) for r in SENT_REASONING] + [turn(SENT[1], SENT_REASONING[0])]
    except Exception:  # noqa: BLE001 - the template refuses reasoning here
        return None, None
    if with_r[0] == plain[0] or not is_prefix(p, with_r[0]):
        return None, None
    if not is_prefix(p, plain[0]):  # rendered, but a turn without it drops the prompt's opener (GLM-4.7)
        return (), None
    r_end = len(with_r[0]) - common_suffix(with_r[0], with_r[1])
    closer = with_r[0][r_end:common_prefix(with_r[0], with_r[2])]
    f0 = plain[0][len(p):common_prefix(plain[0], plain[1])]
    special = rd.special_ids()
    opener = with_r[0][len(p):common_prefix(with_r[0], with_r[1])]
    # Reasoning between special tokens, and a turn without it that keeps only their markup (Kimi:
    # `<think>` in the prompt, `</think>` after): the reasoning of a turn the template never renders with
    # its reasoning can be put back there (`reasoning_slot`).
    before = (list(p) + opener)[-1:]
    slot = None
    if f0 == opener + closer and closer and closer[0] in special and before and before[0] in special:
        slot = (tuple(opener), tuple(closer))
    for h in (list(gen) + f0, f0):
        if h and len(closer) > len(h) and closer[len(closer) - len(h):] == h \
                and closer[len(closer) - len(h) - 1] in special:
            return tuple(h), slot
    return (), slot


__all__ = ["SENT", "SENT_REASONING", "TemplateFacts", "probe"]
