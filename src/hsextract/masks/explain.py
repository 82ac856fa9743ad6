"""`hsextract masks --explain`: a conversation's samples as text, trained spans marked, to check a template by eye.

Each sample is printed as its decoded tokens with every run of trained tokens between ⟦ and ⟧ (with
`--color`, in colour instead: reasoning blue, eot yellow, the rest green), characters that do not print (control,
format) as their escapes. Nothing is tokenized back: the
marks sit exactly on token boundaries, as the mask does. A record prepare would drop is shown with its reason
and the error's words, and the next one is explained. The first line names the variables the template reads
that `chat_template_kwargs` can set (kwargs.py), and the kwargs given.
"""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

from hsextract.errors import ConfigError
from hsextract.masks.masker import ChatMasker, MaskedSample
from hsextract.masks.refusals import TEMPLATE_ERROR, failure
from hsextract.prepare.conversations import MalformedRecordError, open_sources

OPEN, CLOSE = "⟦", "⟧"
_COLORS = {"reasoning": "\x1b[34m", "eot": "\x1b[33m", "header": "\x1b[32m", "body": "\x1b[32m"}
_RESET = "\x1b[0m"


def _decode(tokenizer: Any, ids: list[int]) -> str:
    # Slow tokenizers of transformers 4.x put a space around special tokens unless told not to.
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False,
                            spaces_between_special_tokens=False)
    return "".join(_escaped(c) if c in (OPEN, CLOSE) or c not in "\n\t" and unicodedata.category(c) in _HIDDEN
                   else c for c in text)


# control, format, line and paragraph separators, private use: what a terminal acts on or hides (NUL, an escape
# sequence's ESC, a bidi override, a zero-width joiner); spaces (NBSP, CJK's U+3000) and the rest print as they
# are; the data's own ⟦ and ⟧ are escaped, so that the marks are ours alone
_HIDDEN = ("Cc", "Cf", "Zl", "Zp", "Co")


def _escaped(c: str) -> str:
    """The character as an escape (`\\x1b`, `\\u27e6`): the data's own bytes never recolour or reorder the view."""
    return repr(c)[1:-1] if not c.isprintable() else f"\\u{ord(c):04x}"


def marked(sample: MaskedSample, tokenizer: Any) -> str:
    """The sample's text with each run of trained tokens between ⟦ and ⟧."""
    out: list[str] = []
    start = 0
    mask = sample.loss_mask
    for t in range(1, len(mask) + 1):
        if t == len(mask) or mask[t] != mask[start]:
            text = _decode(tokenizer, sample.input_ids[start:t])
            out.append(OPEN + text + CLOSE if mask[start] else text)
            start = t
    return "".join(out)


def colored(sample: MaskedSample, tokenizer: Any, masker: ChatMasker) -> str:
    kinds = sample.kinds(masker.train_on_reasoning, masker.train_on_eot)
    out: list[str] = []
    start = 0
    for t in range(1, len(kinds) + 1):
        if t == len(kinds) or kinds[t] != kinds[start] or sample.loss_mask[t] != sample.loss_mask[start]:
            text = _decode(tokenizer, sample.input_ids[start:t])
            color = _COLORS.get(kinds[start]) if sample.loss_mask[start] else None
            out.append(color + text + _RESET if color else text)
            start = t
    return "".join(out)


# the source's errors name config keys; the CLI's user gave options
_CLI_WORDS = (("config key `sources[0].path`", "--explain"), ("sources[0].path: ", ""), ("sources[0].split: ", ""),
              ("config key `sources[0].split`", "--split"), ("set `split:` on this source", "pass --split NAME"),
              ("remove `split`", "leave out --split"))


def explain(path: str | Path, masker: ChatMasker, color: bool = False, split: str | None = None) -> str:
    """Every conversation of a file prepare reads (JSONL, JSON, parquet, a saved Dataset or, with `split`, one
    split of a DatasetDict; any record format), explained."""
    try:
        (src,) = open_sources([{"path": str(path), "format": "auto", "weight": 1.0, "max_records": None,
                                "name": None, "split": split}])
    except ConfigError as e:
        msg = str(e)
        for config_words, cli_words in _CLI_WORDS:
            msg = msg.replace(config_words, cli_words)
        raise ConfigError(msg) from None
    rd = masker.renderer  # first, what the template reads that chat_template_kwargs can set (a key it does not
    # read is refused when the masker is made)
    lines = [f"== the chat template {rd.variables.describe()}; chat_template_kwargs: {json.dumps(rd.kwargs)}"]
    refused: Counter[str] = Counter()
    for i in range(len(src)):
        try:
            location, conv = src.read(i)
        except MalformedRecordError as e:  # its message names the record
            refused[e.reason] += 1  # (without its advice, which names config keys)
            lines.append(f"== refused: {e.location}: malformed record ({e.reason}): {e.detail}")
            continue
        try:
            samples = masker.encode(conv)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception, or a TemplateError
            # shown and counted as prepare drops it (strict: false); the next conversation is explained
            reason = getattr(e, "reason", TEMPLATE_ERROR)
            refused[reason] += 1
            lines.append(f"== {location}: refused ({reason}): {failure(e)}")
            continue
        for k, s in enumerate(samples):
            title = f"== {location}" + (f" sample {k + 1}/{len(samples)} (the turn at message {s.turn})"
                                        if s.turn is not None else "")
            lines.append(f"{title}: {len(s.input_ids)} tokens, {sum(s.loss_mask)} trained")
            lines.append(colored(s, masker.tokenizer, masker) if color else marked(s, masker.tokenizer))
    counts = [f"{k} {v}" for k, v in sorted(masker.stats.items())]
    counts += [f"refused {k} {v}" for k, v in sorted(refused.items())]
    lines.append("== " + ", ".join(counts))
    return "\n".join(lines) + "\n"


__all__ = ["CLOSE", "OPEN", "explain", "marked"]
