"""Test fixtures: tiny byte-level BPE tokenizers trained here, with the chat templates under fixtures/templates."""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"

SPECIALS = {
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "deepseek_v3": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                    "<｜tool▁output▁end｜>"],
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
              "<tool_response>", "</tool_response>"],
    "kimi_k25": ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                 "<|im_middle|>", "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                 "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"],
}
BOS = {"llama3": "<|begin_of_text|>", "deepseek_v3": "<｜begin▁of▁sentence｜>", "qwen3": None, "kimi_k25": "[BOS]"}
EOS = {"llama3": "<|eot_id|>", "deepseek_v3": "<｜end▁of▁sentence｜>", "qwen3": "<|im_end|>", "kimi_k25": "<|im_end|>"}

CORPUS = [
    "Hello there! How are you today?",
    "I am fine, thank you. What is the weather in Paris?",
    "The weather in Paris is sunny and warm.",
    "You are a helpful assistant.",
    "Let me think about this step by step. The user asks about the weather.",
    "get_weather city Paris temperature 21 degrees",
    "What is two plus two? Two plus two is four.",
    '{"city": "Paris"} {"temperature": 21}',
    "assistant user system tool ipython json",
]


@functools.cache
def _tokenizer_object() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return tok


def make_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """A fast tokenizer with the template `name` and its special tokens (ids after the BPE vocab)."""
    tok = Tokenizer.from_str(_tokenizer_object().to_str())
    tok.add_special_tokens(SPECIALS[name])
    kw = {"eos_token": EOS[name]}
    if BOS[name]:
        kw["bos_token"] = BOS[name]
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=(TEMPLATES / f"{name}.jinja").read_text(),
                                   **kw)


def trained_segments(sample) -> list[str]:
    """Text of each contiguous run of trained tokens (pins the mask token by token, readable in asserts)."""
    enc_text = sample.text
    runs: list[str] = []
    tok_spans = sample.offsets
    cur: list[int] | None = None
    for (a, b), m in zip(tok_spans, sample.loss_mask):
        if m:
            cur = [cur[0], b] if cur else [a, b]
        elif cur:
            runs.append(enc_text[cur[0]:cur[1]])
            cur = None
    if cur:
        runs.append(enc_text[cur[0]:cur[1]])
    return runs
