"""Tokenizer of the hsextract tiny model, packaged the way Kimi-K2.5 ships its own.

This file is copied into the model directory next to `tiktoken.model` and named by the `auto_map` of
tokenizer_config.json, so transformers loads it only with `trust_remote_code=True`. It is a *slow*
tokenizer (a `PreTrainedTokenizer` subclass: no Rust backend, no offset mappings) over a tiktoken BPE:

- `tiktoken.model`: one line per base token, `base64(token bytes) rank`; rank = token id.
- Special tokens take the ids right after the base tokens, `num_reserved_special_tokens` of them; the
  ones named in tokenizer_config.json's `added_tokens_decoder` carry those names, the others are
  `<|reserved_token_{id}|>`.
- Text between special tokens is split by `pat_str` and merged by byte-level BPE (tiktoken); token
  strings are the byte-level alphabet of GPT-2 (`bytes_to_unicode`), as slow BPE tokenizers use.

Written by the hsextract project for its tests and embedded default; needs `tiktoken`.
"""

from __future__ import annotations

import base64
import os
import shutil
from typing import Any

import tiktoken
from transformers import PreTrainedTokenizer

# Where both transformers 4 and 5 keep it (transformers 5 removed it from models.gpt2.tokenization_gpt2).
from transformers.convert_slow_tokenizer import bytes_to_unicode

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}


def read_ranks(path: str) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken.model file (read here: tiktoken's loader caches files by path name)."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not a `base64 rank` line ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    # Han runs; words with an optional leading non-letter and an English contraction; 1-3 digits;
    # punctuation runs; newlines; other whitespace.
    pat_str = "|".join([
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?\p{L}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ])

    def __init__(self, vocab_file: str, bos_token: Any = "[BOS]", eos_token: Any = "[EOS]", unk_token: Any = None,
                 pad_token: Any = None, num_reserved_special_tokens: int = 256,
                 added_tokens_decoder: dict[int, Any] | None = None, **kwargs: Any) -> None:
        self.vocab_file = vocab_file
        ranks = read_ranks(vocab_file)
        self.num_base_tokens = len(ranks)
        names = {int(i): str(getattr(t, "content", t)) for i, t in (added_tokens_decoder or {}).items()}
        first = self.num_base_tokens
        self.special_ids = {names.get(i, f"<|reserved_token_{i}|>"): i
                            for i in range(first, first + num_reserved_special_tokens)}
        self.num_reserved_special_tokens = num_reserved_special_tokens
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=self.pat_str,
                                       mergeable_ranks=ranks, special_tokens=self.special_ids)
        byte_to_char = bytes_to_unicode()
        self.char_to_byte = {c: b for b, c in byte_to_char.items()}
        self.decoder: dict[int, str] = {r: "".join(byte_to_char[b] for b in tok) for tok, r in ranks.items()}
        self.decoder.update({i: name for name, i in self.special_ids.items()})
        self.encoder: dict[str, int] = {s: i for i, s in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added_tokens_decoder or {}, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # Special tokens were split off by PreTrainedTokenizer.tokenize; what is left is ordinary text.
        return [self.decoder[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        if token in self.encoder:
            return self.encoder[token]
        if self.unk_token_id is not None and token != self.unk_token:
            return self.unk_token_id
        raise KeyError(f"{token!r} is not a token of {self.vocab_file}")

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for t in tokens:
            out += t.encode("utf-8") if t in self.special_ids or t not in self.encoder else \
                bytes(self.char_to_byte[c] for c in t)
        return out.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        if not os.path.isdir(save_directory):
            raise ValueError(f"{save_directory} is not a directory")
        out = os.path.join(save_directory, (f"{filename_prefix}-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
