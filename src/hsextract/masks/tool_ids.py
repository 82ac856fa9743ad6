"""Tool-call ids as the model writes them, where the template renders them inside the turn (the probe's
`TemplateFacts.renders_call_ids`). Kimi-K2.5 writes each
call as `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>...`, IDX counting the conversation's
calls from 0 (SGLang's Kimi-K2 serving numbers them so: `serving_chat._process_tool_call_id`, history's calls
plus the call's place in its message). Data from another API holds OpenAI-style ids (`call_...`), or none, which
Kimi's template renders as they are: the sample would train a header the model never writes. Such ids are given
Kimi's own, and each tool message's `tool_call_id` follows its call (counted in the masks' stats:
`tool_call_ids_given`)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from hsextract.masks.refusals import MARKUP_IN_TURN, TemplateError


def kimi_call_ids(msgs: list[dict[str, Any]], added: Collection[str] = ()) -> tuple[list[dict[str, Any]], int]:
    """The messages with every call's id `functions.NAME:IDX` (IDX: the call's place among the conversation's
    calls), each tool message's `tool_call_id` renamed with its call's: the first call of the turn before still
    unanswered whose id it names (two calls of one id answered in order), else the call of an earlier turn that
    had it, else (none named) the turn's next unanswered call, as results follow their calls; and how many call
    ids were given. TemplateError for a function name holding an `added` token's text: in the id, the token
    would end the call (or the turn) early."""
    out: list[dict[str, Any]] = []
    earlier: dict[str, str] = {}  # an earlier turn's call id -> its Kimi id
    turn: list[tuple[str | None, str]] = []  # the last calling turn's calls: (id as written, Kimi id)
    unanswered: list[tuple[str | None, str]] = []  # those of them no result has answered yet
    k = given = 0
    for j, m in enumerate(msgs):
        if m["role"] == "assistant" and m.get("tool_calls"):
            earlier.update((a, b) for a, b in turn if a)
            calls, turn = [], []
            for c in m["tool_calls"]:
                name = c["function"]["name"]
                if marker := next((t for t in added if t and t in name), None):
                    raise TemplateError(
                        f"assistant turn {j}: the function name {name!r} holds {marker}, a token of the tokenizer's "
                        f"own: the template writes the name in the call's id, where that token would end the call "
                        f"early. Rename the function", reason=MARKUP_IN_TURN)
                want = f"functions.{name}:{k}"
                turn.append((c.get("id"), want))
                if c.get("id") != want:
                    c, given = {**c, "id": want}, given + 1
                calls.append(c)
                k += 1
            m, unanswered = {**m, "tool_calls": calls}, list(turn)
        elif m["role"] == "tool":
            named = m.get("tool_call_id")
            at = next((i for i, (a, b) in enumerate(unanswered) if named in (a, b)), None) if named else \
                (0 if unanswered else None)
            own = unanswered.pop(at)[1] if at is not None else earlier.get(named, named) if named else None
            if own is not None and own != named:
                m = {**m, "tool_call_id": own}
        out.append(m)
    return out, given


__all__ = ["kimi_call_ids"]
