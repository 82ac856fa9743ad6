"""Chat-template logic of regeneration: the stop tokens a template implies, and the messages a generated text
may be rendered back from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hsextract.config.settings import RegenerateSettings
from hsextract.errors import ConfigError
from hsextract.masks.masker import ChatMasker


def end_of_turn_ids(tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Stop tokens: the first token of the text the template writes after an assistant message (when it is
    a special/added token: <|eot_id|>, <|im_end|>, <｜end▁of▁sentence｜>), or, for a template that writes none
    (GLM-4.5), the headers of the messages that follow a turn (`<|user|>`, `<|observation|>`); then eos."""
    masker = ChatMasker(tokenizer, chat_template_kwargs=dict(chat_template_kwargs or {}))
    sent = "\ue000"
    text = masker.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": sent}])
    tail = text[text.rfind(sent) + 1:]
    out: list[int] = []
    if tail:
        first = tokenizer(tail, add_special_tokens=False)["input_ids"][:1]
        special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        if first and first[0] in special:
            out.append(first[0])
    for _, t in masker.renderer.facts().next_stops:
        if t not in out:
            out.append(t)
    eos = tokenizer.eos_token_id
    for t in eos if isinstance(eos, list) else [eos]:
        if t is not None and t not in out:
            out.append(t)
    if not out:
        raise ConfigError("regenerate: the chat template writes no special end-of-turn token and the tokenizer has "
                          "no eos_token: set `regenerate.stop_token_ids`")
    return out


def split_candidates(text: str, s: RegenerateSettings, in_reasoning: bool = False) -> list[dict[str, str]]:
    """Messages the generated text may be rendered from, most faithful first. `in_reasoning`: the generation
    prompt opened a reasoning block that the text never closed (a turn that ended there): all of it is
    reasoning, none an answer."""
    if in_reasoning:
        return [{"reasoning_content": text.strip("\n"), "content": ""}, {"reasoning_content": text, "content": ""}]
    cands: list[dict[str, str]] = []
    if s.think_end in text:
        reasoning, content = text.split(s.think_end, 1)
        r = reasoning.lstrip()
        if r.startswith(s.think_start):
            reasoning = r[len(s.think_start):]
        # Stripped first (clean messages; templates such as Qwen3 strip these newlines themselves), then raw.
        cands.append({"reasoning_content": reasoning.strip("\n"), "content": content.lstrip("\n")})
        cands.append({"reasoning_content": reasoning, "content": content})
    cands.append({"content": text})
    return cands
