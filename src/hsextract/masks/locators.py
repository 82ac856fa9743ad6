"""The locator chain: the ways an assistant turn is found in a frame after the prompt the server saw, tried in
order (`LOCATORS`), written once for both places a turn is looked for:

- its own frame, the conversation up to the turn rendered with the turn last (`own_sample`: the turn's own
  sample, `split_turns`; no locator finds it: refused as `not_prefix_stable`);
- the whole rendering, for a turn that template rewrites once later turns follow (`in_rendering`: where the
  turn is trained in the one sample `split_turns: never` or `auto` stores; none finds it: left untrained).

Each locator says whether its case applies and where it finds the turn (`locate`), what the turn's own sample is
then (`own_sample`, None to let the next locator try), and what is trained in the whole rendering
(`in_rendering`). Whichever finds it, a turn that closes the reasoning block the prompt opened at once has that
closer trained as the block it ends (`reasoning.closed_at_once`, applied here to both). A template family whose
turns none of them finds costs one more locator here (and its golden fixture); one whose reasoning block takes
another shape, one more shape in reasoning.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from hsextract.masks.ids import is_prefix
from hsextract.masks.reasoning import (
    Opener,
    after_prompt_opener,
    closed_at_once,
    closed_block,
    opened_reasoning,
    prompt_opener,
    refuse_open_block,
    slot_reasoning,
    whole_block,
)
from hsextract.masks.refusals import TemplateError, not_prefix_stable, opening_assistant_turn
from hsextract.masks.rendering import TemplateRenderer
from hsextract.masks.turns import After, Frame, TurnSample, TurnSpan, find_turn
from hsextract.prepare.conversations import Conversation


class PromptedTurn:
    """Assistant turn j of a conversation and the prompt the server saw before it, rendered once for both places
    the turn is looked for."""

    def __init__(self, renderer: TemplateRenderer, conv: Conversation, j: int) -> None:
        self.renderer, self.conv, self.index = renderer, conv, j
        if j == 0:
            raise opening_assistant_turn()
        try:
            self.prompt = renderer.render_ids(conv.messages[:j], conv.tools, add_generation_prompt=True)
        except Exception as e:
            raise TemplateError(f"assistant turn {j}: the template cannot render the conversation before it with "
                                f"a generation prompt: {e}") from e

    @cached_property
    def generation(self) -> list[int]:
        """The generation prompt at the prompt's end ([] where the template has none or it cannot be told)."""
        b = self.renderer.render_ids(self.conv.messages[:self.index], self.conv.tools)
        return self.prompt[len(b):] if is_prefix(b, self.prompt) else []

    @property
    def message(self) -> dict[str, Any]:
        return self.conv.messages[self.index]

    def after(self, at: int) -> After:
        """Look for the turn after the prompt's first `at` tokens: after the part of the generation prompt they
        hold, or, without one, after their longest tail."""
        p = self.prompt
        return After(p[len(p) - len(self.generation):at], p[:at])


@dataclass(frozen=True)
class Found:
    """A locator's case applies: the turn's span in the frame (None: not found there), and the case's shape."""

    span: TurnSpan | None
    block_at: int = 0  # ClosedBlock: where the prompt's empty block starts
    opener: Opener | None = None  # OpenedBlock: the opener ending the prompt


class Locator:
    """One case of where a turn starts after the prompt the server saw (see the module docstring)."""

    name: ClassVar[str]
    counted: ClassVar[str | None] = None  # the masker's counter of turns it finds in their own frame

    def locate(self, rd: TemplateRenderer, turn: PromptedTurn, frame: Frame) -> Found | None:
        """Where the turn is in the frame, when this locator's case applies (else None)."""
        raise NotImplementedError

    def own_sample(self, rd: TemplateRenderer, turn: PromptedTurn, frame: Frame, found: Found) -> TurnSample | None:
        """The turn's own sample from its own frame (None: not this locator's)."""
        raise NotImplementedError

    def in_rendering(self, rd: TemplateRenderer, turn: PromptedTurn, frame: Frame, found: Found) -> TurnSpan:
        """The turn's span as trained in the whole rendering (found.span is set)."""
        assert found.span is not None
        return found.span


def _as_rendered(rd: TemplateRenderer, turn: PromptedTurn, frame: Frame, span: TurnSpan | None) -> TurnSample | None:
    """The server's prompt, then the turn as rendered; reasoning the template never renders put back where it keeps
    the block's markup (`slot_reasoning`); refused where the prompt's block is left open."""
    if span is None:
        return None
    block = slot_reasoning(rd, frame.message, frame.ids, span)
    if block is not None:
        return TurnSample.put_back(turn.prompt, block, frame.ids, span)
    refuse_open_block(rd, frame.index, turn.prompt, frame.ids[span.prompt_end:span.end])
    return TurnSample.cut(turn.prompt, frame.ids, span)


class Prefix(Locator):
    """The prompt the server saw is a prefix of the frame: the turn starts where it ends."""

    name = "prefix"

    def locate(self, rd: TemplateRenderer, turn: PromptedTurn, frame: Frame) -> Found | None:
        if not is_prefix(turn.prompt, frame.ids):
            return None
        return Found(find_turn(rd, frame, len(turn.prompt)))

    def own_sample(self, rd: TemplateRenderer, turn: PromptedTurn, frame: Frame, found: Found) -> TurnSample | None:
        return _as_rendered(rd, turn, frame, found.span)


class RewrittenHistory(Locator):
    """The template rewrote earlier turns (Qwen3 and Kimi drop their reasoning; Mistral's put the system prompt in
    the last user message only): the turn starts after the generation prompt found after them, or, for a
    template without one, after the longest tail of the prompt."""

    name = "rewritten_history"
    counted = "turns_after_rewritten_history"

    def locate(self, rd: TemplateRenderer, turn: PromptedTurn, frame: Frame) -> Found | None:
        if is_prefix(turn.prompt, frame.ids):
            return None
        return Found(find_turn(rd, frame, turn.after(len(turn.prompt))))

    def own_sample(self, rd: TemplateRenderer, turn: PromptedTurn, frame: Frame, found: Found) -> TurnSample | None:
        return _as_rendered(rd, turn, frame, found.span)


class ClosedBlock(Locator):
    """The prompt ends with an empty reasoning block no rendering has (Gemma-4 with thinking off; a closer alone
    where the rendering writes the whole block): the turn starts right after it. Its own sample is the prompt,
    block included, then the turn from its content on, where the rendering writes nothing, the block's closer
    again, or the whole block before the content; in the whole rendering, a whole block there is not the model's."""

    name = "closed_block"

    def locate(self, rd: TemplateRenderer, turn: PromptedTurn, frame: Frame) -> Found | None:
        k = closed_block(rd, turn.prompt, frame.ids, turn.generation)
        if k is None:
            return None
        span = find_turn(rd, frame, turn.after(k))
        return Found(span if span is not None and span.prompt_end == k else None, block_at=k)

    def own_sample(self, rd: TemplateRenderer, turn: PromptedTurn, frame: Frame, found: Found) -> TurnSample | None:
        span, p = found.span, turn.prompt
        if span is None or span.reasoning_rendered:
            return None
        before = frame.ids[span.prompt_end:span.content_start]
        if before != p[len(p) - len(before):] and not whole_block(rd, p, before):
            return None
        return TurnSample.put_back(p, [], frame.ids, span, inserted=False)

    def in_rendering(self, rd: TemplateRenderer, turn: PromptedTurn, frame: Frame, found: Found) -> TurnSpan:
        assert found.span is not None
        k = found.block_at
        if whole_block(rd, turn.prompt, frame.ids[k:k + 2]):  # not the model's: the prompt's closer was
            return found.span.starting_at(k + 2)
        return found.span


class OpenedBlock(Locator):
    """The prompt ends by opening a reasoning block no rendered turn has (R1, QwQ, DeepSeek-V3.1 with thinking,
    Nemotron-3): the turn follows what the frame holds of the generation prompt. Its own sample puts back what
    the model wrote after the opener (`reasoning.opened_reasoning`); the whole rendering is trained as found."""

    name = "opened_block"

    def locate(self, rd: TemplateRenderer, turn: PromptedTurn, frame: Frame) -> Found | None:
        opener = prompt_opener(rd, turn.prompt, frame.ids, turn.generation)
        if opener is None:
            return None
        span = find_turn(rd, frame, turn.after(opener.at))
        return Found(None if span is None else after_prompt_opener(span, frame.ids, turn.prompt[opener.at]),
                     opener=opener)

    def own_sample(self, rd: TemplateRenderer, turn: PromptedTurn, frame: Frame, found: Found) -> TurnSample | None:
        assert found.opener is not None
        return opened_reasoning(rd, frame, turn.prompt, found.opener, found.span)


LOCATORS: tuple[Locator, ...] = (Prefix(), RewrittenHistory(), ClosedBlock(), OpenedBlock())


def own_sample(rd: TemplateRenderer, turn: PromptedTurn, frame: Frame, stats: Counter[str]) -> TurnSample:
    """The turn's own sample from its own frame (the turn rendered last): the first locator's that gives one."""
    for loc in LOCATORS:
        found = loc.locate(rd, turn, frame)
        if found is None:
            continue
        if found.span is not None and loc.counted:
            stats[loc.counted] += 1
        sample = loc.own_sample(rd, turn, frame, found)
        if sample is not None:
            return TurnSample(sample.ids, closed_at_once(rd, turn.prompt, sample.ids, sample.span, turn.message))
    raise not_prefix_stable(rd, frame.index, turn.prompt, frame.ids, frame.message)


def in_rendering(rd: TemplateRenderer, turn: PromptedTurn, frame: Frame) -> TurnSpan | None:
    """The turn's span in the whole rendering: the first locator's that finds it there; None if none does."""
    for loc in LOCATORS:
        found = loc.locate(rd, turn, frame)
        if found is not None and found.span is not None:
            return closed_at_once(rd, turn.prompt, frame.ids, loc.in_rendering(rd, turn, frame, found), turn.message)
    return None


__all__ = ["LOCATORS", "ClosedBlock", "Found", "Locator", "OpenedBlock", "Prefix", "PromptedTurn",
           "RewrittenHistory", "in_rendering", "own_sample"]
