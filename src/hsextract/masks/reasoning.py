"""Reasoning blocks a rendering and the prompt the server saw disagree on, on token ids: what each shape looks
like, and what the model wrote there.

- **A block the template never renders with its reasoning, keeping its markup** (Kimi's final answer:
  `<think></think>`; `TemplateFacts.reasoning_slot`): the turn's reasoning is put back between the markup
  (`slot_reasoning`).
- **An empty block closing the generation prompt that no rendering has** (Gemma-4 with thinking off:
  `<|channel>thought\\n<channel|>`; `<think></think>`; a closer alone, `</think>`, where the rendering writes the
  whole block): the model wrote the turn after that block (`closed_block`, `whole_block`).
- **An opener ending the generation prompt that no rendered turn has** (`<think>`: DeepSeek-R1 and QwQ cut
  everything up to `</think>` from the content; DeepSeek-V3.1 with `thinking` renders `</think>` + content;
  Nemotron-3 prompts `<think>\\n` and renders `<think></think>`): after it the model wrote its reasoning, the
  closer and the answer (`prompt_opener`, `opened_reasoning`).
- **A turn without reasoning that starts with the closer of the block the prompt opened**, whichever locator
  finds it (DeepSeek-V3.1 with `thinking` and GLM-4.7 render `</think>` + content; Kimi-K2.5, whose prompt is a
  prefix of its rendering, and Nemotron-3 render `<think></think>` + content): the model closed the prompt's
  block at once, and that closer is trained as the reasoning block it ends (`closed_at_once`).
- **A block written into the content** (`<think>...</think>answer`, as raw generations and R1-style exports hold
  it): moved to the reasoning field where the template renders both alike (Qwen3 cuts it out of the content
  itself), left where the template expects it there (DeepSeek-R1), refused where the template would render it as
  answer text beside a block of its own (Kimi-K2.5), as is a closer alone there (`reasoning_from_content`).
- **An opener the turn as rendered never closes** (a template that reads no reasoning field and renders the
  content right after `<think>`): refused (`refuse_open_block`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from hsextract.masks.ids import common_prefix
from hsextract.masks.refusals import (
    NOT_PREFIX_STABLE,
    REASONING_IN_CONTENT,
    REASONING_LEFT_OPEN,
    REASONING_NAMES,
    TemplateError,
)
from hsextract.masks.rendering import TemplateRenderer
from hsextract.masks.turns import Frame, TurnSample, TurnSpan

# the closers of reasoning blocks (`</think>`: Kimi, Qwen3, DeepSeek, GLM, MiniMax); tool-call markup such as
# Qwen's `</tool_call>` is a pair of added tokens too, and may stand in a content more than once
REASONING_CLOSER = re.compile(rf"</({REASONING_NAMES})>")
REASONING_OPENER = re.compile(rf"<({REASONING_NAMES})>")


def reasoning_from_content(rd: TemplateRenderer, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each assistant content that holds a reasoning block's closer (`<think>X</think>Y`, or
    `X</think>Y` after a prompt that opened it) and no reasoning field given as reasoning X and content Y, where the
    template renders a reasoning field (TemplateFacts.renders_reasoning) and the two alike (it cuts the block out
    of the content itself, as Qwen3's does), so the masker knows where the reasoning is. Where it renders no
    reasoning field (DeepSeek-R1 drops it; a template that reads none expects the block in the content), left.
    Where the template writes a reasoning block of its own for the turn (writes_own_block; Kimi-K2.5: `<think>` +
    field + `</think>` before the content), a whole block in the content would train two blocks, which the model
    never writes: refused; so is a closer alone there (a raw generation, which goes on from the prompt's opener,
    or an answer that names the tag: the tokenizer reads it as the added token, a second closer after the
    template's). Where the template writes no block of its own, a closer alone in answer text is left as
    written."""
    user = {"role": "user", "content": "hi"}
    out = list(msgs)
    for j, m in enumerate(msgs):
        content = m.get("content") if m["role"] == "assistant" else None
        names = dict.fromkeys(REASONING_CLOSER.findall(content)) if isinstance(content, str) else {}
        closer = next((f"</{n}>" for n in names if f"</{n}>" in rd.added), None)
        if closer is None:
            refuse_opener_alone(rd, user, j, m)
            continue
        opener = f"<{closer[2:]}"
        try:  # the turn alone, as the last message: the template writes its reasoning block for it, if any
            text = rd.render([user, m])
        except Exception:  # noqa: BLE001 - a template that needs more context: judged on the data later
            continue
        head, _, tail = content.partition(closer)
        if rd.facts().renders_reasoning and not m.get("reasoning_content"):
            reasoning = head.split(opener, 1)[-1]
            for r, c in ((reasoning, tail), (reasoning.strip("\n"), tail.lstrip("\n"))):
                moved = {**m, "reasoning_content": r, "content": c}
                if r.strip() and rd.render([user, moved]) == text:
                    out[j] = moved
                    break
            if out[j] is not m:
                continue
        if not writes_own_block(rd, user, m, opener, closer):
            continue  # the content is the turn as the model wrote it (or the template cannot say: judged later)
        if opener in head:
            raise TemplateError(
                f"assistant turn {j}: its content holds a reasoning block (`{opener}` ... `{closer}` at character "
                f"{content.index(closer)}), which the chat template renders as answer text beside a reasoning "
                f"block of its own: the sample would train two blocks. Move the reasoning to "
                f"`reasoning_content` and keep the answer in `content` (as SGLang's reasoning parser returns "
                f"a generation)", reason=REASONING_IN_CONTENT)
        raise TemplateError(
            f"assistant turn {j}: its content holds `{closer}` (at character {content.index(closer)}), which the "
            f"tokenizer reads as the added token that ends the reasoning block the chat template writes of its own "
            f"before the content: the sample would train a second closer, and the text before it as answer. If "
            f"that text is reasoning (a raw generation, which goes on from the prompt's `{opener}`), move it to "
            f"`reasoning_content` and keep the rest in `content`; an answer that only names the tag cannot be "
            f"trained with this tokenizer, which reads it as the added token: leave such records out",
            reason=REASONING_IN_CONTENT)
    return out


def refuse_opener_alone(rd: TemplateRenderer, user: dict[str, Any], j: int, m: dict[str, Any]) -> None:
    """TemplateError for an assistant content that opens a reasoning block it never closes (a generation cut off in
    its reasoning) beside the template's own block: the sample would train that reasoning as answer text."""
    content = m.get("content") if m["role"] == "assistant" else None
    found = next((f for f in REASONING_OPENER.finditer(content) if f[0] in rd.added and f"</{f[1]}>" in rd.added),
                 None) if isinstance(content, str) else None
    if found is not None and writes_own_block(rd, user, m, found[0], f"</{found[1]}>"):
        raise TemplateError(
            f"assistant turn {j}: its content opens a reasoning block (`{found[0]}` at character {found.start()}) "
            f"that it never closes, beside the reasoning block the chat template writes of its own: a generation "
            f"cut off in its reasoning, whose sample would train that reasoning as answer text, or an answer that "
            f"names the tag, which the tokenizer reads as the added token. Leave the record out, or give it whole "
            f"(reasoning in `reasoning_content`, the answer in `content`)", reason=REASONING_LEFT_OPEN)


def writes_own_block(rd: TemplateRenderer, user: dict[str, Any], m: dict[str, Any], opener: str, closer: str) -> bool:
    """True when rendering [user, m], with the tags removed from m's content and reasoning and its tool calls
    dropped, gives more closers than rendering [user] alone: the extra closer is the template's own block. Closers
    in tool-call arguments, a default system prompt or the content are so not counted."""
    bare = {k: v.replace(opener, "").replace(closer, "") if k in ("content", "reasoning_content") and
            isinstance(v, str) else v for k, v in m.items() if k != "tool_calls"}
    try:
        return rd.render([user, bare]).count(closer) > rd.render([user]).count(closer)
    except Exception:  # noqa: BLE001 - a template that needs the turn's calls or more context: judged on the data later
        return False


@dataclass(frozen=True)
class Opener:
    """A reasoning block's opener ending the generation prompt from token `at` on (`<think>`, with `space` after it
    in the prompt), whose closer the template writes somewhere."""

    at: int
    tag: str  # `<think>`
    name: str  # think
    space: str

    @property
    def closer(self) -> str:
        return f"</{self.name}>"


def prompt_tail(p: list[int], x: list[int], gen: list[int]) -> int | None:
    """Where the frame x, rendered from the history of the prompt p, departs from it, when that is within the
    generation prompt `gen` (None: the history differs too, or there is no generation prompt)."""
    k = common_prefix(p, x)
    return None if not gen or k < len(p) - len(gen) else k


def closed_block(rd: TemplateRenderer, p: list[int], x: list[int], gen: list[int]) -> int | None:
    """k where the end of the generation prompt, p[k:], is an empty reasoning block that x, rendered from the
    same history, lacks: two special tokens around at most a word (Gemma-4 with thinking off writes
    `<|channel>thought\\n<channel|>` there, and never in a rendered turn; `<think></think>`), or a block's
    closer alone (`</think>`, where the rendering writes `<think></think>`); then at most whitespace. The
    model wrote the turn after that block, as the template renders the turn."""
    k = prompt_tail(p, x, gen)
    if k is None:
        return None
    special, text = rd.special_ids(), rd.text
    tail = p[k:]
    while tail and tail[-1] not in special and not text(tail[-1:]).strip():
        tail = tail[:-1]
    if len(tail) == 1 and tail[0] in special and opener_of(rd, tail[0]) is not None:
        return k
    inner = tail[1:-1]
    if len(tail) < 2 or tail[0] not in special or tail[-1] not in special or any(t in special for t in inner) \
            or not re.fullmatch(r"\s*\w*\s*", text(inner)):
        return None
    return k


def whole_block(rd: TemplateRenderer, p: list[int], x: list[int]) -> bool:
    """x opens with the empty block whose closer alone ends the prompt p (`<think></think>` after `</think>`)."""
    return len(x) >= 2 and x[1] == p[-1] and x[0] == opener_of(rd, p[-1])


def opener_of(rd: TemplateRenderer, closer: int) -> int | None:
    """The special token `<name>` of a special token `</name>`, if the tokenizer has both."""
    name = re.fullmatch(r"</([A-Za-z_][\w-]*)>", rd.text([closer]))
    return None if name is None else rd.added.get(f"<{name[1]}>")


def prompt_opener(rd: TemplateRenderer, p: list[int], x: list[int], gen: list[int]) -> Opener | None:
    """The opener where the end of the generation prompt opens a reasoning block (`<think>`, its closer in the
    template) that x, rendered from the same history, lacks (or has without the whitespace after it: Nemotron-3
    prompts `<think>\\n`, renders `<think></think>`)."""
    k = prompt_tail(p, x, gen)
    if k is None:
        return None
    if k > len(p) - len(gen) and not rd.text(p[k:]).strip() and p[k - 1] in rd.special_ids():
        k -= 1
    tag = re.fullmatch(r"\s*(<([A-Za-z_][\w-]*)>)(\s*)", rd.text(p[k:]))
    return None if tag is None or f"</{tag[2]}>" not in rd.template else Opener(k, tag[1], tag[2], tag[3])


def after_prompt_opener(span: TurnSpan, x: list[int], opener: int) -> TurnSpan:
    """The span, found in x after the part of the generation prompt x holds, starting after the reasoning opener
    the prompt ends with where x writes it there too (Nemotron-3: the prompt's `<think>\\n`, the rendering's
    `<think></think>`): the prompt holds it, the model did not write it."""
    if x[span.prompt_end:span.prompt_end + 1] != [opener] or span.reasoning_rendered:
        return span
    return span.starting_at(span.prompt_end + 1)


def slot_reasoning(rd: TemplateRenderer, m: dict[str, Any], x: list[int], span: TurnSpan) -> list[int] | None:
    """The turn's reasoning block where the template never renders it (Kimi's final answer) but keeps its
    markup, `reasoning_slot`, right before the content: the markup with the reasoning between; else None."""
    slot = rd.facts().reasoning_slot
    reasoning = m.get("reasoning_content")
    if not reasoning or span.reasoning_rendered or not slot or \
            tuple(x[span.prompt_end:span.content_start]) != slot[0] + slot[1]:
        return None
    return list(slot[0]) + rd.ids(reasoning) + list(slot[1])


def open_block_closer(rd: TemplateRenderer, p: list[int]) -> str | None:
    """The closer of the reasoning block the prompt p ends by opening (`</think>` after `<think>`, then at most
    whitespace), where the template writes that closer somewhere; else None."""
    tag = re.search(r"<([A-Za-z_][\w-]*)>\s*$", rd.text(p[-4:]))
    return None if tag is None or f"</{tag[1]}>" not in rd.template else f"</{tag[1]}>"


def closed_at_once(rd: TemplateRenderer, p: list[int], ids: list[int], span: TurnSpan, m: dict[str, Any]
                   ) -> TurnSpan:
    """The turn's span in ids (after the prompt p), marked `closes_prompt_block` where the prompt opens a
    reasoning block and the turn (message m), with no reasoning, starts with its closer: a turn without reasoning
    rendered `</think>` + content after `<think>` (DeepSeek-V3.1 with `thinking`, GLM-4.7), or `<think></think>` +
    content after a prompt holding that `<think>` (Kimi-K2.5, Nemotron-3). The model wrote that closer, so it is
    trained as the (empty) reasoning block it ends; the opener is the prompt's. A turn whose reasoning the
    rendering dropped (Kimi's and GLM-4.7's history, `split_turns: never`) is rendered the same way, but its
    closer was written after that reasoning, not there: not trained as one (it counts as `reasoning_not_rendered`).
    The one place this rule lives: the locator chain applies it to every turn, in its own sample and in the
    whole rendering alike."""
    if span.reasoning_rendered or m.get("reasoning_content"):
        return span
    closer = open_block_closer(rd, p)
    if closer is None or not rd.text(ids[span.prompt_end:span.header_start]).lstrip().startswith(closer):
        return span
    return replace(span, closes_prompt_block=True)


def refuse_open_block(rd: TemplateRenderer, j: int, p: list[int], turn: list[int]) -> None:
    """A prompt that ends by opening a reasoning block (`<think>\\n`) and a turn, as the template renders it,
    that never closes it (a template that reads no reasoning field and renders the content right there):
    the sample would train the answer as reasoning, and the model's `</think>` nowhere."""
    closer = open_block_closer(rd, p)
    if closer is None or closer in rd.text(turn):
        return
    raise TemplateError(
        f"assistant turn {j}: the generation prompt opens a reasoning block ('<{closer[2:]}') that the template "
        f"does not close in this turn, so its sample would train the answer as reasoning: give the turn its raw "
        f"text in `content` (reasoning, '{closer}', answer), or turn thinking off with "
        f"`chat_template_kwargs`", reason=REASONING_LEFT_OPEN)


def written_reasoning(m: dict[str, Any], opener: Opener) -> tuple[str | None, str | None]:
    """(the reasoning the model wrote after the prompt's opener, the text it wrote after the closer when the data
    says): `reasoning_content`, or the content's own text before the closer (without a repeated opener)."""
    content = m.get("content") or ""
    if m.get("reasoning_content"):
        return m["reasoning_content"], None
    if opener.closer not in content:
        return None, None
    reasoning, after = content.split(opener.closer, 1)
    if reasoning.lstrip().startswith(opener.tag):  # the raw text repeats the opener the prompt ends with
        reasoning = reasoning.lstrip()[len(opener.tag):].removeprefix(opener.space)
    return reasoning, after


def opened_reasoning(rd: TemplateRenderer, frame: Frame, prompt: list[int], opener: Opener, span: TurnSpan | None
                     ) -> TurnSample | None:
    """The turn's own sample after a prompt that ends with `opener`: what the model wrote after it, then the turn
    as the frame renders it from its content on (span in the frame, None where it was not found). The model wrote
    the reasoning, the closer and the blank line: as the template renders the closer, or as those models write
    it where the template never does (reasoning, newline, closer, blank line, unless the data's own text says
    otherwise). A turn without reasoning is the closer and the answer where the template renders such a turn so
    (GLM-4.7: `</think>` right after the header): the model wrote that closer after the prompt's opener (trained
    as the reasoning block it ends: `closed_at_once`); where it does not (R1, QwQ), nothing tells what the model
    wrote: refused. None when the turn is not found."""
    x = frame.ids
    reasoning, after = written_reasoning(frame.message, opener)
    region = [] if span is None else x[span.prompt_end:span.content_start]
    writes_closer = opener.closer in rd.text(region)
    if reasoning is None and writes_closer:  # the model closed the prompt's block at once: its own closer
        assert span is not None
        return TurnSample.put_back(prompt, region, x, span, inserted=False, filler_trained=False)
    if reasoning is None:
        raise TemplateError(
            f"assistant turn {frame.index}: the generation prompt opens a reasoning block ({opener.tag!r}) that the "
            f"template never renders for an assistant turn, and this turn has no reasoning to fill it: give it "
            f"`reasoning_content`, or its raw text with {opener.closer!r} in `content` (or regenerate the responses "
            f"with this model)", reason=NOT_PREFIX_STABLE)
    if span is None:
        return None
    if writes_closer:
        return TurnSample.put_back(prompt, rd.ids(reasoning) + region, x, span)
    if after is None:
        reasoning, after = reasoning.rstrip("\n") + "\n", "\n\n"
    answer = rd.text(x[span.content_start:span.stop if span.stop is not None else span.end])
    gap = after[:len(after) - len(after.lstrip())]
    if answer.startswith(gap):  # the template keeps the blank line the model wrote (R1), or there is none
        gap = ""
    return TurnSample.put_back(prompt, rd.ids(reasoning + opener.closer + gap), x, span)

__all__ = ["Opener", "after_prompt_opener", "closed_at_once", "closed_block", "open_block_closer", "opened_reasoning",
           "opener_of", "prompt_opener", "prompt_tail", "refuse_open_block", "slot_reasoning", "whole_block",
           "written_reasoning"]
