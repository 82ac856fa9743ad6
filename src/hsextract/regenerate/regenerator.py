"""The regenerator: every assistant turn of a conversation rewritten, in rounds over a chunk, by a generator
(engines.base.Generator). See the package docstring for the contract."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from hsextract.config.settings import RegenerateSettings
from hsextract.engines.base import Generator
from hsextract.errors import EngineError
from hsextract.masks.masker import ChatMasker
from hsextract.masks.refusals import TEMPLATE_ERROR, TemplateError, failure, opening_assistant_turn
from hsextract.prepare.conversations import Conversation
from hsextract.regenerate.template import end_of_turn_ids, split_candidates, tool_call_opener

# Outcomes counted in the stats.
EMPTY_GENERATION = "empty_generation"
TRUNCATED = "max_new_tokens"
# max_new_tokens reached inside the reasoning block the generation prompt opened: no answer exists, and the turn
# rendered back would close the reasoning and end the turn where the model did neither. Cut whatever
# drop_truncated says.
TRUNCATED_IN_REASONING = "max_new_tokens_in_reasoning"
# the stop token inside that block: no answer either, and rendered back the turn would close the reasoning where
# the model did not (Kimi: `</think>` trained before `<|im_end|>`). Cut.
STOPPED_IN_REASONING = "stopped_in_reasoning"
NO_ASSISTANT_TURN = "no_assistant_turn"
# the target called a tool where the recorded turn did not: the recorded messages after it answer no such call,
# and the call, markup in a plain message's content, would not render back as the target wrote it (a template that
# keeps reasoning only in tool-call turns, Kimi's, drops it). Cut.
TOOL_CALL_GENERATED = "tool_call_generated"
# the context of a turn reaches `max_context` tokens (prepare's max_seq_len): its sample could hold no generated
# token (dropped or truncated by prepare either way), and an engine given it may run out of memory or positions.
CONTEXT_TOO_LONG = "context_too_long"


def sample_seed(seed: int, sample_id: str, turn: int) -> int:
    """A 63-bit seed per (sample, turn): independent of chunking, batching and order."""
    digest = hashlib.sha256(f"{seed}\x00{sample_id}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass
class _Turn:
    conv: int  # index in the chunk
    j: int  # message index
    prompt_text: str
    prompt_ids: list[int]
    seed: int
    append: bool  # a new final turn (the conversation ended with a user/tool message)


@dataclass
class RegenStats:
    conversations: int = 0
    malformed: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)  # reason -> conversations the chat template refused
    turns_regenerated: int = 0
    turns_appended: int = 0
    turns_kept_tool_calls: int = 0
    turns_hit_max_new_tokens: int = 0
    conversations_cut: Counter = field(default_factory=Counter)  # reason -> conversations cut short
    generated_tokens: int = 0
    roundtrip: Counter = field(default_factory=Counter)  # tokens | text | none

    def as_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting the pairs.
        return {f.name: dict(sorted(v.items())) if isinstance(v := getattr(self, f.name), Counter) else v
                for f in fields(self)}


class Regenerator:
    """Regenerates the assistant turns of conversations with one tokenizer/template and one generator."""

    def __init__(self, tokenizer: Any, generator: Generator, settings: RegenerateSettings,
                 chat_template_kwargs: Mapping[str, Any] | None = None, max_context: int | None = None) -> None:
        self.masker = ChatMasker(tokenizer, chat_template_kwargs=dict(chat_template_kwargs or {}))
        self.tokenizer = tokenizer
        self.generator = generator
        self.settings = settings
        self.stop_ids = list(settings.stop_token_ids or end_of_turn_ids(tokenizer, chat_template_kwargs))
        self.tool_call = tool_call_opener(self.masker)
        self.max_context = max_context

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _next_turn(self, msgs: list[dict[str, Any]], start: int, stats: RegenStats) -> tuple[int, bool] | None:
        """(message index, append) of the next turn to generate at or after `start`, or None when done.
        Cuts the conversation in place under tool_turns=truncate."""
        j = start
        while j < len(msgs):
            m = msgs[j]
            if m["role"] == "assistant":
                if not m.get("tool_calls"):
                    return j, False
                if self.settings.tool_turns == "truncate":
                    del msgs[j:]
                    break
                stats.turns_kept_tool_calls += 1
            j += 1
        if self.settings.complete_last_turn and msgs and msgs[-1]["role"] in ("user", "tool"):
            return len(msgs), True
        return None

    def _in_reasoning(self, prompt: _Turn, text: str) -> bool:
        """Whether the generated text is still inside the reasoning block its generation prompt opened."""
        s = self.settings
        return prompt.prompt_text.rstrip().endswith(s.think_start) and s.think_end not in text

    def _message(self, head: list[dict[str, Any]], tools: Any, prompt: _Turn, body: list[int], stop: int | None,
                 text: str, stats: RegenStats) -> dict[str, Any]:
        """The message the turn is stored as; `stop`: the stop token the generation ended with (None: none)."""
        cands = split_candidates(text, self.settings)
        want_text = prompt.prompt_text + text
        for cand in cands:
            msg = {"role": "assistant", **{k: v for k, v in cand.items() if v or k == "content"}}
            try:
                rendered = self.masker.render(head + [msg], tools)
            except Exception:  # noqa: BLE001 - a candidate the template refuses is just not the one
                continue
            if rendered.startswith(want_text):
                ids = self._ids(rendered)
                n = len(prompt.prompt_ids) + len(body)
                # and the stop token the model wrote, where the template writes one after the turn (GLM's writes
                # none: the next message's header, not rendered here, is the stop)
                exact = ids[:n] == prompt.prompt_ids + body and (stop is None or len(ids) == n or ids[n] == stop)
                stats.roundtrip["tokens" if exact else "text"] += 1
                return msg
        # No rendering holds the text as generated (the template cuts or moves reasoning: Kimi, R1, QwQ): the
        # sample prepare makes of the turn, which puts the reasoning back, is what must hold the generated ids.
        msgs = [{"role": "assistant", **{k: v for k, v in c.items() if v or k == "content"}} for c in cands]
        want = prompt.prompt_ids + body
        for msg in msgs:
            try:
                ids = self.masker.turn_ids(Conversation(head + [msg], tools), len(head))
            except Exception:  # noqa: BLE001 - a candidate the masker refuses is just not the one
                continue
            if ids[:len(want)] == want:
                exact = stop is None or len(ids) == len(want) or ids[len(want)] == stop
                stats.roundtrip["tokens" if exact else "text"] += 1
                return msg
        stats.roundtrip["none"] += 1
        return msgs[0]

    def regenerate(self, conversations: Sequence[Conversation | None], sample_ids: Sequence[str] | None = None,
                   stats: RegenStats | None = None, *, strict: bool = True,
                   locations: Sequence[str] | None = None) -> list[Conversation | None]:
        """Each conversation with its assistant turns regenerated (None stays None). Turns are generated in
        rounds: round r generates the next turn of every conversation, so a batch holds many samples.

        A conversation whose context the chat template refuses: TemplateError naming it (`locations`, else its
        sample id) when `strict`, else None, its reason in `self.refusals` (by index) and counted in
        `stats.refused` as prepare counts it."""
        self.refusals: dict[int, str] = {}
        stats = stats if stats is not None else RegenStats()
        ids = list(sample_ids) if sample_ids is not None else [str(k) for k in range(len(conversations))]
        where = list(locations) if locations is not None else [f"sample {i}" for i in ids]
        work: list[list[dict[str, Any]] | None] = [
            None if c is None else [dict(m) for m in c.messages] for c in conversations]
        tools = [None if c is None else c.tools for c in conversations]
        # the turns given weight 0 that stay as they were (kept tool-call turns): still untrained; a regenerated turn
        # is the target's own and trained
        untrained = [set() if c is None else set(c.untrained) for c in conversations]
        pos: dict[int, int] = {k: 0 for k, w in enumerate(work) if w is not None}
        stats.conversations += len(pos)
        while pos:
            turns: list[_Turn] = []
            for k in sorted(pos):
                msgs = work[k]
                assert msgs is not None
                nxt = self._next_turn(msgs, pos[k], stats)
                if nxt is None:
                    del pos[k]
                    continue
                j, append = nxt
                try:
                    if j == 0:
                        raise opening_assistant_turn()
                    text = self.masker.render(msgs[:j], tools[k], add_generation_prompt=True)
                except Exception as e:  # jinja errors (the template's raise_exception) and TemplateError
                    reason = getattr(e, "reason", TEMPLATE_ERROR)
                    if strict:
                        raise TemplateError(f"{where[k]}: regenerate: the context of messages[{j}]: {failure(e)}",
                                            reason) from e
                    stats.refused[reason] += 1
                    self.refusals[k] = reason
                    work[k] = None
                    del pos[k]
                    continue
                prompt_ids = self._ids(text)
                if self.max_context is not None and len(prompt_ids) >= self.max_context:
                    stats.conversations_cut[CONTEXT_TOO_LONG] += 1
                    del msgs[j:]
                    del pos[k]
                    continue
                turns.append(_Turn(k, j, text, prompt_ids, sample_seed(self.settings.seed, ids[k], j), append))
            if not turns:
                break
            outs = self.generator.generate([t.prompt_ids for t in turns], [t.seed for t in turns])
            if len(outs) != len(turns):
                raise EngineError(f"regenerate: the generator returned {len(outs)} outputs for {len(turns)} prompts")
            for t, out in zip(turns, outs, strict=True):
                msgs = work[t.conv]
                assert msgs is not None
                stopped = bool(out) and out[-1] in self.stop_ids
                body = out[:-1] if stopped else list(out)
                text = self.tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                stats.generated_tokens += len(out)
                if not stopped:
                    stats.turns_hit_max_new_tokens += 1
                reason = None
                if self._in_reasoning(t, text):
                    reason = STOPPED_IN_REASONING if stopped else TRUNCATED_IN_REASONING
                elif not stopped and self.settings.drop_truncated:
                    reason = TRUNCATED
                elif self.tool_call is not None and self.tool_call in out:  # gpt-oss: <|call|> also stops
                    reason = TOOL_CALL_GENERATED
                msg = None if reason is not None else self._message(
                    msgs[:t.j], tools[t.conv], t, body, out[-1] if stopped else None, text, stats)
                if msg is not None and not msg["content"].strip() and not msg.get("reasoning_content"):
                    reason = EMPTY_GENERATION
                if reason is not None:
                    stats.conversations_cut[reason] += 1
                    del msgs[t.j:]
                    del pos[t.conv]
                    continue
                assert msg is not None
                if t.append:
                    msgs.append(msg)
                    stats.turns_appended += 1
                else:
                    msgs[t.j] = msg
                    untrained[t.conv].discard(t.j)
                    stats.turns_regenerated += 1
                pos[t.conv] = t.j + 1
        out: list[Conversation | None] = []
        for k, w in enumerate(work):
            if w is None:
                out.append(None)
                continue
            if not any(m["role"] == "assistant" for m in w):
                stats.conversations_cut[NO_ASSISTANT_TURN] += 1
            out.append(Conversation(messages=w, tools=tools[k],
                                    untrained=frozenset(i for i in untrained[k] if i < len(w))))
        return out


def regenerate_chunk(conversations: Sequence[Conversation | None], generator: Generator, settings: RegenerateSettings,
                     *, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None,
                     sample_ids: Sequence[str] | None = None, stats: RegenStats | None = None,
                     strict: bool = True) -> list[Conversation | None]:
    """Conversations with every assistant turn regenerated by `generator` (see the module docstring)."""
    return Regenerator(tokenizer, generator, settings, chat_template_kwargs).regenerate(
        conversations, sample_ids, stats, strict=strict)
