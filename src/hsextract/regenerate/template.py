"""Chat-template logic of regeneration: the stop tokens a template implies, and the messages a generated text
may be rendered back from."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hsextract.config.model_info import hub_id
from hsextract.config.settings import RegenerateSettings
from hsextract.errors import ConfigError
from hsextract.masks.masker import ChatMasker


def end_of_turn_ids(tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None,
                    model_dir: str | os.PathLike[str] | None = None) -> list[int]:
    """Stop tokens: the first token of the text the template writes after an assistant message (when it is
    a special/added token: <|eot_id|>, <|im_end|>, <｜end▁of▁sentence｜>), or, for a template that writes none
    (GLM-4.5), the headers of the messages that follow a turn (`<|user|>`, `<|observation|>`); then eos; then
    the eos ids of `model_dir`'s generation_config.json, which SGLang and transformers stop at too (gpt-oss's
    `<|call|>`, Llama 3.1's `<|eom_id|>`: the turns that end in a tool call)."""
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
    for t in (eos if isinstance(eos, list) else [eos]) + generation_eos_ids(model_dir, len(tokenizer)):
        if t is not None and t not in out:
            out.append(t)
    if not out:
        raise ConfigError("regenerate: the chat template writes no special end-of-turn token and the tokenizer has "
                          "no eos_token: set `regenerate.stop_token_ids`")
    return out


def _generation_config(model: str | os.PathLike[str]) -> Path | None:
    """The checkpoint's generation_config.json: in its folder, or, for a hub id (`org/name`), from the hub's cache
    or the hub, as its tokenizer is read; None where it has none."""
    path = Path(model) / "generation_config.json"
    if path.is_file():
        return path
    if (name := hub_id(model)) is None:
        return None
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        cached = try_to_load_from_cache(name, "generation_config.json")
        if isinstance(cached, str):
            return Path(cached)
        if cached is not None:  # the cache knows the repo has none
            return None
        return Path(hf_hub_download(name, "generation_config.json"))
    except Exception as e:  # noqa: BLE001 - the hub unreachable, or the repo without one: say so, go on
        if type(e).__name__ != "EntryNotFoundError":
            print(f"WARNING: regenerate: generation_config.json of {name!r} not read ({type(e).__name__}): its eos "
                  "ids are not among the stop ids; set `regenerate.stop_token_ids` if the model stops at others",
                  file=sys.stderr, flush=True)
        return None


def generation_eos_ids(model_dir: str | os.PathLike[str] | None, vocab_size: int) -> list[int]:
    """`eos_token_id` (an id or a list) of the checkpoint's generation_config.json; [] without one."""
    path = _generation_config(model_dir) if model_dir is not None else None
    if path is None:
        return []
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{path}: not a JSON object ({e}); it gives the ids generation stops at. Repair it, or set "
                          "`regenerate.stop_token_ids`") from e
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ConfigError(f"{path}: eos_token_id = {eos!r} is not a token id or a list of them. Repair it, or set "
                          "`regenerate.stop_token_ids`")
    if any(t >= vocab_size for t in ids):
        raise ConfigError(f"{path}: eos_token_id = {eos!r} is outside the tokenizer's vocabulary (ids 0.."
                          f"{vocab_size - 1}): the tokenizer is not this model's (config keys `tokenizer`, `model`)")
    return ids


def tool_call_opener(masker: ChatMasker) -> int | None:
    """The special token that opens the tool calls of an assistant turn (Kimi's `<|tool_calls_section_begin|>`,
    DeepSeek's `<｜tool▁calls▁begin｜>`, Qwen's `<tool_call>`): the first the template writes in a turn with calls
    and not in a plain one. A generated turn holding it called a tool. None for a template that writes calls as
    plain text (Llama 3) or has none."""
    tok = masker.tokenizer
    user = [{"role": "user", "content": "hi"}]
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": "y"}}}
    try:
        with_call, plain = (tok(masker.render(user + [{"role": "assistant", "content": "ok", **extra}]),
                                add_special_tokens=False)["input_ids"] for extra in ({"tool_calls": [call]}, {}))
    except Exception:  # noqa: BLE001 - a template without tool calls: no markup to find
        return None
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    return next((t for t in with_call if t in special and t not in plain), None)


def split_candidates(text: str, s: RegenerateSettings) -> list[dict[str, str]]:
    """Messages the generated text may be rendered from, most faithful first (a text still inside the reasoning
    block its generation prompt opened never comes here: the regenerator cuts such a turn)."""
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
