"""Test fixtures: tiny byte-level BPE tokenizers trained here, with the chat templates under fixtures/templates."""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AddedToken, PreTrainedTokenizer, PreTrainedTokenizerFast

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"

GLM = ["[gMASK]", "<sop>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
       "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
       "<tool_response>", "</tool_response>"]
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
    "harmony": ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>",
                "<|constrain|>"],
    "deepseek_v31": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                     "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"],
    "mistral": ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
    "gemma3": ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
    "deepseek_r1": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                    "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                    "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"],
    "qwq": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"],
    "glm45": GLM,
    "glm47": GLM,
    "phi3": ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    "gemma4": ["<bos>", "<eos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>",
               "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>"],
}
BOS = {"llama3": "<|begin_of_text|>", "deepseek_v3": "<｜begin▁of▁sentence｜>", "qwen3": None, "kimi_k25": "[BOS]",
       "harmony": None, "deepseek_v31": "<｜begin▁of▁sentence｜>", "mistral": "<s>", "gemma3": "<bos>",
       "deepseek_r1": "<｜begin▁of▁sentence｜>", "qwq": None, "glm45": None, "glm47": None,
       "phi3": None, "gemma4": "<bos>"}
EOS = {"llama3": "<|eot_id|>", "deepseek_v3": "<｜end▁of▁sentence｜>", "qwen3": "<|im_end|>", "kimi_k25": "<|im_end|>",
       "harmony": "<|return|>", "deepseek_v31": "<｜end▁of▁sentence｜>", "mistral": "</s>", "gemma3": "<eos>",
       "deepseek_r1": "<｜end▁of▁sentence｜>", "qwq": "<|im_end|>", "glm45": "<|endoftext|>", "glm47": "<|endoftext|>",
       "phi3": "<|endoftext|>", "gemma4": "<eos>"}

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
def _tokenizer_object(extra_corpus: tuple[str, ...] = ()) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*CORPUS, *extra_corpus] * 3, trainer=trainer)
    return tok


def tokenizer_with(template: str, specials: list[str], eos: str, bos: str | None,
                   extra_corpus: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """The tiny BPE (trained on CORPUS and `extra_corpus`) with a chat template and its special tokens (ids after
    the BPE vocab)."""
    tok = Tokenizer.from_str(_tokenizer_object(extra_corpus).to_str())
    tok.add_special_tokens(specials)
    kw = {"eos_token": eos} | ({"bos_token": bos} if bos else {})
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **kw)


def make_tokenizer(name: str, extra_corpus: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A fast tokenizer with the fixture template `name` and its special tokens."""
    return tokenizer_with((TEMPLATES / f"{name}.jinja").read_text(), SPECIALS[name], EOS[name], BOS[name],
                          extra_corpus)


def trained_segments(sample, tokenizer) -> list[str]:
    """Decoded text of each contiguous run of trained tokens (pins the mask token by token, readable in asserts)."""
    runs: list[str] = []
    start = None
    for t, m in enumerate(sample.loss_mask + [0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append(tokenizer.decode(sample.input_ids[start:t], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False))
            start = None
    return runs


class SlowTwinTokenizer(PreTrainedTokenizer):
    """A slow (pure Python, no offset mappings) tokenizer with the vocabulary and merges of a fast one.

    Real checkpoints ship such tokenizers (tiktoken or sentencepiece based, often as custom code); this twin
    lets a test compare masks computed through the slow path with the fast tokenizer's, id for id."""

    vocab_files_names: dict[str, str] = {}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, fast: PreTrainedTokenizerFast, **kwargs) -> None:
        raw = Tokenizer.from_str(fast.backend_tokenizer.to_str())
        self._specials = {t.content for t in fast.added_tokens_decoder.values()}
        self._base = Tokenizer(raw.model)  # the BPE model alone: added tokens are split out by the slow path
        self._base.pre_tokenizer = raw.pre_tokenizer
        self._base.decoder = raw.decoder
        self._vocab = dict(raw.get_vocab(with_added_tokens=True))
        self._ids = {i: t for t, i in self._vocab.items()}
        added = {i: AddedToken(t.content, special=True, normalized=False)
                 for i, t in fast.added_tokens_decoder.items()}
        super().__init__(added_tokens_decoder=added, chat_template=fast.chat_template,
                         eos_token=fast.eos_token, bos_token=fast.bos_token, clean_up_tokenization_spaces=False,
                         **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return self._base.encode(text, add_special_tokens=False).tokens

    def _convert_token_to_id(self, token: str) -> int:
        return self._vocab[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self._ids[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self._base.decoder.decode(tokens)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        return ()


def make_slow_tokenizer(name: str) -> SlowTwinTokenizer:
    """The slow twin of `make_tokenizer(name)`: same ids for every text, no offsets."""
    return SlowTwinTokenizer(make_tokenizer(name))


# Message builders of the mask tests: system prompt, user turn, assistant turn (reasoning, tool calls).
SYS = {"role": "system", "content": "You are a helpful assistant."}


def U(c):
    return {"role": "user", "content": c}


def A(c, r=None, calls=None):
    m = {"role": "assistant", "content": c}
    if r:
        m["reasoning_content"] = r
    if calls:
        m["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return m
