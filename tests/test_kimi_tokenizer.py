"""The tiny model packaged the way Kimi-K2.5 ships its tokenizer (hsextract.tinymodel.kimi_tokenizer): custom code
behind an auto_map, a tiktoken BPE, a slow tokenizer, a chat template with a `thinking` switch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# before the imports below: huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported
os.environ["HF_HUB_OFFLINE"] = "1"

import tiktoken
import torch
import yaml

from hsextract.config.checks import check
from hsextract.errors import ConfigError
from hsextract.prepare.tokenizer_loading import load_tokenizer, remote_tokenizer_code
from hsextract.tinymodel import kimi_tokenizer as kt
from hsextract.tinymodel.build import _iter_texts, make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
CONVERSATIONS = ROOT / "data" / "conversations.jsonl"
SMALL = {"num_hidden_layers": 4, "hidden_size": 128}
TEXTS = [
    "Hello there! How are you today?",
    "Greta decided to admire a wish made of geyser.  Two  spaces,\ttabs\nand\n\nnewlines.",
    "中文的句子，还有标点。 mixed 中文 and English; numbers 1234567 and 3.14159.",
    "emoji 🙂🚀 and accents: café naïve — done",
    "<|im_user|>user<|im_middle|>special tokens inside text<|im_end|><think>r</think>",
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kimi") / "kimi-tiny", CONVERSATIONS, tokenizer="kimi", **SMALL)


@pytest.fixture(scope="module")
def tok(model_dir: Path):
    return load_tokenizer(model_dir, trust_remote_code=True)


def test_packaged_like_kimi(model_dir: Path, tok) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert {"tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert not names & {"tokenizer.json", "vocab.json", "merges.txt"}  # nothing a fast tokenizer could load
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert cfg["auto_map"] == {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    code = remote_tokenizer_code(model_dir)
    assert code is not None and code.module_file == model_dir / "tokenization_kimi.py"
    with pytest.raises(ConfigError, match=r"^trust_remote_code: the tokenizer of .* is custom code"):
        load_tokenizer(model_dir)
    assert type(tok).__name__ == "TikTokenTokenizer" and tok.is_fast is False


def test_special_ids_and_model_vocab(model_dir: Path, tok) -> None:
    base = sum(1 for _ in open(model_dir / "tiktoken.model"))
    assert base == 4096 - 256
    for name, off in kt.SPECIAL_OFFSETS.items():
        assert tok.convert_tokens_to_ids(name) == base + off, name
    assert tok.convert_ids_to_tokens(base + 100) == f"<|reserved_token_{base + 100}|>"
    model_cfg = json.loads((model_dir / "config.json").read_text())
    assert model_cfg["vocab_size"] == tok.vocab_size == base + 256 == 4096
    assert (model_cfg["bos_token_id"], model_cfg["eos_token_id"], model_cfg["pad_token_id"]) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (base, base + 1, base + 255)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [base + 1, base + 2]  # [EOS] and <|im_end|>
    hf = json.loads((model_dir / "hsextract_tiny.json").read_text())
    assert hf["tokenizer"] == "kimi"


def test_ids_equal_tiktoken_on_the_shipped_file(model_dir: Path, tok) -> None:
    ranks = {}
    for line in (model_dir / "tiktoken.model").read_text().splitlines():
        b64, rank = line.split()
        import base64

        ranks[base64.b64decode(b64)] = int(rank)
    enc = tiktoken.Encoding("ref", pat_str=kt.pat_str(), mergeable_ranks=ranks,
                            special_tokens=kt.special_ids(len(ranks)))
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == enc.encode(text, allowed_special="all"), text
        assert tok.decode(ids) == text
    # BPE learned something: the shipped conversations take well under one token per 3 bytes
    sample = "".join(list(_iter_texts(CONVERSATIONS))[:200])
    assert len(tok(sample, add_special_tokens=False)["input_ids"]) < len(sample.encode()) / 3


def test_tokenizer_files_are_deterministic(tmp_path: Path) -> None:
    texts = [*kt.TEMPLATE_WORDS, *_iter_texts(CONVERSATIONS)]
    ranks = kt.train_ranks(texts, 1024)
    assert ranks == kt.train_ranks(texts, 1024) and len(ranks) == 1024
    assert all(ranks[bytes([b])] == b for b in range(256))
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        kt.write_kimi_tokenizer(tmp_path / d, ranks, 4096)
    for name in ("tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


CONV = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."},
    {"role": "user", "content": "And Rome?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "21 C"},
]
SYS = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
HEAD = (SYS + "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Sunny.<|im_end|>"
        "<|im_user|>user<|im_middle|>And Rome?<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
CALL = ("</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n21 C<|im_end|>")


def test_template_drops_history_reasoning_and_has_a_thinking_switch(tok) -> None:
    def render(msgs, **kw):
        return tok.apply_chat_template(msgs, tokenize=False, **kw)

    # the plain turn 1 is history: its reasoning is dropped; the tool-call turn after it keeps its own
    assert render(CONV) == HEAD + "Call the tool." + CALL
    assert render(CONV, thinking=False) == HEAD + CALL
    gen = "<|im_assistant|>assistant<|im_middle|>"
    assert render(CONV, add_generation_prompt=True) == HEAD + "Call the tool." + CALL + gen + "<think>"
    assert render(CONV, add_generation_prompt=True, thinking=False) == HEAD + CALL + gen + "<think></think>"
    # once a later plain answer exists, the tool-call turn is history too
    done = [*CONV, {"role": "assistant", "content": "21 C in Rome.", "reasoning_content": "Report."}]
    assert render(done) == HEAD + CALL + gen + "<think></think>21 C in Rome.<|im_end|>"
    # a system message replaces the default; a named message shows its name
    assert render([{"role": "system", "content": "S"}, {"role": "user", "name": "ann", "content": "hi"}]) == (
        "<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>ann<|im_middle|>hi<|im_end|>")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert render(CONV[:1], tools=tools).startswith(
        '<|im_system|>tool_declare<|im_middle|>[{"type": "function", "function": {"name": "f", "parameters": {}}}]'
        "<|im_end|>" + SYS)
    # role markers are single special tokens in the ids
    ids = tok(render(CONV), add_special_tokens=False)["input_ids"]
    for name in ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>", "<think>"):
        assert tok.convert_tokens_to_ids(name) in ids


def test_model_runs_on_its_tokenizer(model_dir: Path, tok) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = tok(tok.apply_chat_template(CONV, tokenize=False), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 4096) and torch.isfinite(logits).all()


def test_tiny_kimi_without_trust_stops_at_parse_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    c = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    c.update(tiny_model_tokenizer="kimi", trust_remote_code=False, model="resources/tiny-kimi-not-built")
    with pytest.raises(ConfigError) as e:
        check(c)
    assert str(e.value) == (
        "trust_remote_code: make_tiny_model builds resources/tiny-kimi-not-built with tiny_model_tokenizer: kimi, a "
        "tokenizer that is custom code (tokenization_kimi.py behind a tokenizer_config.json auto_map, packaged as "
        "Kimi-K2.5's is), which transformers runs only with trust_remote_code: true. Set `trust_remote_code: true` "
        "in the config, or tiny_model_tokenizer: fast")
    for spelled in ("resources/tiny-kimi-not-built/", "./resources/tiny-kimi-not-built"):  # the model's own folder
        with pytest.raises(ConfigError, match=r"^trust_remote_code: make_tiny_model builds "):
            check({**c, "tokenizer": spelled})
    c["trust_remote_code"] = True
    assert check(c).model.num_layers == 10


def test_tokenizer_hash_covers_the_custom_code(tmp_path: Path) -> None:
    from hsextract.provenance import tokenizer_hash

    ranks = kt.train_ranks(kt.TEMPLATE_WORDS, 300)
    kt.write_kimi_tokenizer(tmp_path, ranks, 4096)
    before = tokenizer_hash(str(tmp_path))
    code = tmp_path / "tokenization_kimi.py"
    code.write_text(code.read_text() + "\n# edited\n")
    assert tokenizer_hash(str(tmp_path)) != before
