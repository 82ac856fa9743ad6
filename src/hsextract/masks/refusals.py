"""Why a conversation gets no mask: `TemplateError`, the reason codes prepare drops conversations under (its
`dropped` counters, `strict: false`), and the checks on a whole conversation made before any turn is located.

Reason codes, each raised where its case is told apart:

    template_error             anything not named otherwise (the template's own `raise_exception` among them)
    not_prefix_stable          the template cannot render the prompt the server saw before a turn (locators)
    stop_token_in_turn         a turn's own text holds a token that ends a turn (below)
    markup_in_turn             a turn's own text holds the template's markup around messages (below)
    tool_calls_not_rendered    a tool-call turn rendered as if it had no calls (below)
    tool_results_not_rendered  the template drops tool messages (below)
    tool_calls_after_stop      the calls rendered after the turn's stop token, as a message of their own (turns)
    tool_arguments_as_string   the template joins tool-call arguments to text as a string (rendering)
    reasoning_left_open        a reasoning block the turn never closes (opened by the prompt or content) (reasoning)
    reasoning_in_content       a reasoning block, or its closer alone, in the content beside the template's own;
                               a reasoning field holding the tags (reasoning)
    empty_turn                 no turn rendered but as its stop token (masker: such a turn alone is not trained)
"""

from __future__ import annotations

import json
import re
import traceback
from typing import TYPE_CHECKING, Any

import jinja2

from hsextract.errors import ConfigError

if TYPE_CHECKING:
    from hsextract.masks.rendering import TemplateRenderer

# the names of reasoning blocks' tags (`<think>`, `</think>`: Kimi, Qwen3, DeepSeek, GLM, MiniMax)
REASONING_NAMES = "think|thinking|thought|reasoning"
REASONING_TAG = re.compile(rf"</?({REASONING_NAMES})>")

TEMPLATE_ERROR = "template_error"
NOT_PREFIX_STABLE = "not_prefix_stable"
STOP_TOKEN_IN_TURN = "stop_token_in_turn"
MARKUP_IN_TURN = "markup_in_turn"
TOOL_CALLS_NOT_RENDERED = "tool_calls_not_rendered"
TOOL_RESULTS_NOT_RENDERED = "tool_results_not_rendered"
TOOL_CALLS_AFTER_STOP = "tool_calls_after_stop"
TOOL_ARGUMENTS_AS_STRING = "tool_arguments_as_string"
REASONING_LEFT_OPEN = "reasoning_left_open"
REASONING_IN_CONTENT = "reasoning_in_content"
EMPTY_TURN = "empty_turn"


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


def opening_assistant_turn() -> TemplateError:
    """An assistant message first: no prompt came before it (chat templates refuse an empty conversation)."""
    return TemplateError("messages[0] is an assistant turn: nothing comes before it for the model to have answered "
                         "(a conversation opens with a user or system message). Remove the opening assistant "
                         "message, or set `strict: false` to drop such records")


def not_prefix_stable(renderer: TemplateRenderer, j: int, prompt: list[int], turn: list[int],
                      message: dict[str, Any] | None = None) -> TemplateError:
    """No locator finds turn j after the prompt the server saw: the first token where the two differ."""
    k = next(i for i in range(len(prompt)) if i >= len(turn) or prompt[i] != turn[i])
    dec = renderer.tokenizer.decode
    at = f"first difference at token {k}: prompt {dec(prompt[k:k + 4])!r} vs turn {dec(turn[k:k + 4])!r}"
    if dec(turn[k:]).startswith(dec(prompt[k:])):  # the same text, cut into other tokens across the boundary
        return TemplateError(
            f"assistant turn {j}: the turn rendered holds the generation prompt the server saw as text, but the "
            f"tokenizer joins the prompt's last characters to the turn's first ones into other tokens ({at}): the "
            f"turn does not start at a token boundary of the prompt, so its tokens are not the ones the model "
            f"generated after it. The template and the tokenizer do not fit (a prompt that ends in a special token "
            f"or in text the tokenizer keeps apart does); neither chat_template_kwargs nor the data can change that",
            reason=NOT_PREFIX_STABLE)
    name = (message or {}).get("name")
    if isinstance(name, str) and name and name in dec(turn[k:]) and name not in dec(prompt[k:]):
        return TemplateError(
            f"assistant turn {j}: the template writes its `name` field ({name!r}) where the generation prompt the "
            f"server saw has the plain assistant header ({at}): the model never wrote a turn after that header. "
            f"Remove `name` from assistant messages", reason=NOT_PREFIX_STABLE)
    return TemplateError(
        f"assistant turn {j}: the template is not prefix-stable: the turn rendered does not start with the "
        f"generation prompt the server saw ({at}). Set `chat_template_kwargs` (e.g. enable_thinking / thinking) to "
        f"match the data, or fix the data's reasoning fields", reason=NOT_PREFIX_STABLE)


def refuse_unmaskable(renderer: TemplateRenderer, msgs: list[dict[str, Any]], tools: Any) -> None:
    """The checks on a whole conversation, in this order: stop tokens inside a turn, tool calls the template does
    not render, tool messages it drops."""
    _refuse_stop_tokens_inside(renderer, msgs)
    _refuse_unrendered_tool_calls(renderer, msgs, tools)
    _refuse_unrendered_tool_results(renderer, msgs)


def _fields(m: dict[str, Any]) -> list[tuple[str, str]]:
    """An assistant message's own text, (where, text): what the model wrote, the tool calls' names and arguments
    (as the JSON a call's object arguments are written in) included."""
    out = [(k, m[k]) for k in ("reasoning_content", "content") if isinstance(m.get(k), str)]
    for c, call in enumerate(m.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        for key in ("name", "arguments") if isinstance(fn, dict) else ():
            v = fn.get(key)
            text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) if v is not None else None
            if text is not None:
                out.append((f"tool_calls[{c}].function.{key}", text))
    return out


def _first(text: str, tokens: list[str]) -> tuple[int, str] | None:
    """(where, which) of the first of `tokens` written in `text`, else None."""
    return min(((text.index(t), t) for t in tokens if t in text), default=None)


def _refuse_stop_tokens_inside(renderer: TemplateRenderer, msgs: list[dict[str, Any]]) -> None:
    """An assistant turn whose own text holds a token that ends a turn (`<|im_end|>`, GLM's `<|user|>`, eos)
    was not generated as one turn: the model stops at that token. Runaway generations copied into datasets
    (an answer, `<|im_end|>`, a made-up next user turn) look like this; trained, they would teach the
    drafter to go on after the stop. So does one that holds the template's markup around messages (Kimi's
    `<|im_user|>`, ChatML's `<|im_start|>`, Llama 3's `<|start_header_id|>`): a made-up turn whose stop was cut."""
    stop_texts = renderer.stop_texts()
    markup = renderer.markup_texts()
    for j, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        for key, text in _fields(m):
            if found := _first(text, stop_texts):
                at, hit = found
                if key == "content" and not text[at:].removeprefix(hit).strip():  # exported with its stop token
                    raise TemplateError(
                        f"assistant turn {j}: its {key} ends with {hit!r}, a token that ends a turn, which the "
                        f"template writes itself: strip it from the data", reason=STOP_TOKEN_IN_TURN)
                raise TemplateError(
                    f"assistant turn {j}: its {key} holds {hit!r} (at character {at}), a token that ends a turn: "
                    f"the model stops there, so this is not one generated turn (a runaway generation?). Cut the "
                    f"text at it, or regenerate the responses with this model", reason=STOP_TOKEN_IN_TURN)
            if key == "reasoning_content" and renderer.facts().renders_reasoning:
                _refuse_tags_in_reasoning(renderer, j, text)
            if found := _first(text, markup):
                at, hit = found
                raise TemplateError(
                    f"assistant turn {j}: its {key} holds {hit!r} (at character {at}), the template's own markup "
                    f"around messages, which the tokenizer reads as that special token wherever it is written: the "
                    f"model writes it only between turns, so the turn was not generated as written (a made-up next "
                    f"turn, or text that quotes the markup). Cut or rewrite the text there, or regenerate the "
                    f"responses with this model", reason=MARKUP_IN_TURN)


def _refuse_tags_in_reasoning(renderer: TemplateRenderer, j: int, text: str) -> None:
    """A reasoning field the template renders, holding a think tag that is an added token: exported with the tags
    the template writes around it itself (it would train two of each), or holding the closer inside (the model's
    reasoning ends at the first: the rest was not generated as reasoning)."""
    tags = renderer.reasoning_tag_texts()
    found = _first(text, tags)
    if found is None:
        return
    at, hit = found
    inner = text.strip()
    if any(inner.startswith(t) and not t.startswith("</") or inner.endswith(t) and t.startswith("</") for t in tags):
        raise TemplateError(
            f"assistant turn {j}: its reasoning_content is written with the tag {hit!r}, which the template writes "
            f"around it itself: strip the tags from the data", reason=REASONING_IN_CONTENT)
    if hit.startswith("</"):
        raise TemplateError(
            f"assistant turn {j}: its reasoning_content holds {hit!r} (at character {at}), the token that ends a "
            f"reasoning block: the model's reasoning ends at the first, so the rest was not generated as "
            f"reasoning. Move the text after it to the content, or cut it", reason=REASONING_IN_CONTENT)


def empty_turn(msgs: list[dict[str, Any]], j: int) -> TemplateError:
    """Every assistant turn renders as nothing but its stop token (turn j the first): trained, a turn would teach
    the model to stop at once, so none is, and the conversation has nothing to train (prepare refuses an empty
    content without reasoning before any rendering; this is the template's case)."""
    why = ("its content is empty and the chat template does not render its reasoning (with these "
           "`chat_template_kwargs`)" if msgs[j].get("reasoning_content") else "the chat template renders none of it")
    return TemplateError(
        f"assistant turn {j}: {why}, so its sample would train only the stop token right after the prompt, and the "
        f"conversation has no other turn to train. Give the turn content, have its reasoning rendered "
        f"(`chat_template_kwargs`, e.g. thinking on), or leave it out", reason=EMPTY_TURN)


def _refuse_unrendered_tool_calls(renderer: TemplateRenderer, msgs: list[dict[str, Any]], tools: Any) -> None:
    """A template without tool calls (Phi-3) renders a tool-call turn as if it had none: its sample would
    train an empty turn (the stop token right after the prompt) or the content without the calls."""
    for j, m in enumerate(msgs):
        if m["role"] != "assistant" or not m.get("tool_calls"):
            continue
        try:
            without = renderer.render(msgs[:j] + [{k: v for k, v in m.items() if k != "tool_calls"}], tools)
        except Exception:  # noqa: BLE001 - the template needs the calls to render this turn: it renders them
            continue
        if without == renderer.render(msgs[:j + 1], tools):
            what = "the content without them" if (m.get("content") or "").strip() else "an empty turn"
            raise TemplateError(
                f"assistant turn {j}: the chat template does not render its tool calls, so its sample would "
                f"train {what}: set a `chat_template` that renders tool calls, or leave conversations with "
                f"tool calls out", reason=TOOL_CALLS_NOT_RENDERED)


def _refuse_unrendered_tool_results(renderer: TemplateRenderer, msgs: list[dict[str, Any]]) -> None:
    """A template that drops tool messages (Phi-3) trains the turns after one without the result in their
    context: the drafter learns answers that seem to come from nowhere."""
    if renderer.facts().renders_tool_results:
        return
    for j, m in enumerate(msgs):
        if m["role"] == "tool":
            raise TemplateError(
                f"message {j} (tool): the chat template does not render tool messages, so the turns after it "
                f"would be trained without the tool result in their context: set a `chat_template` that "
                f"renders them, or leave conversations with tool messages out", reason=TOOL_RESULTS_NOT_RENDERED)


__all__ = ["EMPTY_TURN", "MARKUP_IN_TURN", "NOT_PREFIX_STABLE", "REASONING_IN_CONTENT", "REASONING_LEFT_OPEN",
           "REASONING_NAMES", "REASONING_TAG", "STOP_TOKEN_IN_TURN", "TEMPLATE_ERROR", "TOOL_ARGUMENTS_AS_STRING",
           "TOOL_CALLS_AFTER_STOP", "TOOL_CALLS_NOT_RENDERED", "TOOL_RESULTS_NOT_RENDERED", "TemplateError",
           "empty_turn", "failure", "not_prefix_stable", "opening_assistant_turn", "refuse_unmaskable"]
