"""The tiny model's tokenizer packaged the way Kimi-K2.5 ships its own (custom code, tiktoken, slow).

Kimi-K2.5's checkpoint has no tokenizer.json: tokenizer_config.json maps AutoTokenizer (`auto_map`) to
`tokenization_kimi.TikTokenTokenizer`, a module in the checkpoint, a slow `PreTrainedTokenizer` over a
tiktoken BPE file `tiktoken.model`, with the special tokens in the ids after the base vocabulary. This
module writes a tokenizer of that packaging into a model directory:

    tiktoken.model          BPE ranks learned here from the shipped conversations (no download)
    tokenization_kimi.py    our tokenizer class (hsextract/resources/tokenization_kimi.py)
    tokenizer_config.json   auto_map, special tokens (added_tokens_decoder), bos/eos/pad/unk
    chat_template.jinja     a Kimi-K2.5-shaped template with a `thinking` switch that drops earlier
                            turns' reasoning (hsextract/resources/kimi_chat_template.jinja)

Loading it needs `trust_remote_code=True` and the `tiktoken` package. Deterministic: the same corpus and
size write byte-identical files.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RESOURCES = Path(__file__).resolve().parents[1] / "resources"
MODULE_FILE = "tokenization_kimi.py"
CLASS_REF = "tokenization_kimi.TikTokenTokenizer"
TEMPLATE_FILE = "kimi_chat_template.jinja"
NUM_RESERVED_SPECIAL_TOKENS = 256
# Offsets after the base vocabulary, in the spirit of Kimi-K2.5 (its [BOS] is the first id after the
# 163584 base tokens, [EOS] the next, [PAD] the last); the other reserved ids are <|reserved_token_N|>.
SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|im_system|>": 5,
    "<|im_middle|>": 6,
    "<think>": 7,
    "</think>": 8,
    "<|tool_calls_section_begin|>": 9,
    "<|tool_calls_section_end|>": 10,
    "<|tool_call_begin|>": 11,
    "<|tool_call_argument_begin|>": 12,
    "<|tool_call_end|>": 13,
    "[UNK]": 14,
    # Kimi-K2.5's media tokens (its processor expands <|media_pad|>, config.json's media_placeholder_token_id)
    "<|media_begin|>": 15,
    "<|media_content|>": 16,
    "<|media_end|>": 17,
    "<|media_pad|>": 18,
    "[PAD]": NUM_RESERVED_SPECIAL_TOKENS - 1,
}
ROLE_TOKENS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
# Words the template writes around the messages: part of the BPE corpus so they are few tokens.
TEMPLATE_WORDS = ("system", "user", "assistant", "tool", "tool_declare", "functions", "## Return of",
                  "You are Kimi, an AI assistant created by Moonshot AI.")


def pat_str() -> str:
    """The pre-tokenizer regex of tokenization_kimi.py (read from the module's text, one source of truth)."""
    import ast

    tree = ast.parse((RESOURCES / MODULE_FILE).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pat_str" for t in node.targets):
            call = node.value
            if isinstance(call, ast.Call) and isinstance(call.args[0], ast.List):
                return "|".join(ast.literal_eval(e) for e in call.args[0].elts)
    raise RuntimeError(f"{RESOURCES / MODULE_FILE}: no `pat_str = '|'.join([...])`")


def chat_template() -> str:
    return (RESOURCES / TEMPLATE_FILE).read_text(encoding="utf-8")


def train_ranks(texts: Iterable[str], num_base_tokens: int) -> dict[bytes, int]:
    """Byte-level BPE ranks (tiktoken's `mergeable_ranks`) learned from `texts`: the 256 bytes, then merges.

    The `tokenizers` trainer learns the merges (pre-split with the tokenizer's own regex); merge k makes the
    token of rank 256 + k, so tiktoken, which merges the pair whose concatenation has the lowest rank,
    replays them in the order learned. A merge that recreates an existing token adds nothing.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if num_base_tokens < 257:
        raise ValueError(f"num_base_tokens={num_base_tokens}: at least the 256 bytes and one merge")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pat_str()), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=num_base_tokens, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(char_to_byte[c] for c in a + b)
        if token not in ranks:
            ranks[token] = len(ranks)
    return ranks


def tiktoken_file_text(ranks: dict[bytes, int]) -> str:
    return "".join(f"{base64.b64encode(t).decode('ascii')} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1]))


def special_ids(num_base_tokens: int) -> dict[str, int]:
    return {name: num_base_tokens + off for name, off in SPECIAL_OFFSETS.items()}


def tokenizer_config(num_base_tokens: int, model_max_length: int) -> dict[str, Any]:
    ids = special_ids(num_base_tokens)
    added = {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for name, i in sorted(ids.items(), key=lambda x: x[1])}
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": list(ROLE_TOKENS),
        "auto_map": {"AutoTokenizer": [CLASS_REF, None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": model_max_length,
        "num_reserved_special_tokens": NUM_RESERVED_SPECIAL_TOKENS,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


def write_kimi_tokenizer(out_dir: str | os.PathLike[str], ranks: dict[bytes, int], model_max_length: int) -> None:
    """Write the four tokenizer files into `out_dir` (an existing directory, e.g. a model being built)."""
    out = Path(out_dir)
    (out / "tiktoken.model").write_text(tiktoken_file_text(ranks), encoding="ascii")
    shutil.copyfile(RESOURCES / MODULE_FILE, out / MODULE_FILE)
    cfg = tokenizer_config(len(ranks), model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").write_text(chat_template(), encoding="utf-8")


def vocab_size(num_base_tokens: int) -> int:
    """The model's vocabulary: base tokens and every reserved special id."""
    return num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS


__all__ = ["CLASS_REF", "NUM_RESERVED_SPECIAL_TOKENS", "ROLE_TOKENS", "SPECIAL_OFFSETS", "TEMPLATE_WORDS",
           "chat_template", "pat_str", "special_ids", "tiktoken_file_text", "tokenizer_config", "train_ranks",
           "vocab_size", "write_kimi_tokenizer"]
