"""The tiny Kimi-shaped model: deterministic build, loadable offline, Kimi-style chat format."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

# before the imports below: huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from hsextract.errors import ConfigError
from hsextract.tinymodel.build import SPECIAL_TOKENS, main, make_tiny_model
from hsextract.tinymodel.chat_template import DEFAULT_SYSTEM_PROMPT, KIMI_STYLE_TEMPLATE

CONVERSATIONS = Path(__file__).resolve().parents[1] / "data" / "conversations.jsonl"
SMALL = {"num_hidden_layers": 4, "hidden_size": 128}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same small model built twice: once through the CLI, once through the function."""
    root = tmp_path_factory.mktemp("tiny")
    main(["--out", str(root / "a"), "--conversations", str(CONVERSATIONS), "--num-layers", "4", "--hidden-size", "128"])
    make_tiny_model(root / "b", CONVERSATIONS, seed=0, **SMALL)
    return root / "a", root / "b"


def test_conversations_file_shape() -> None:
    recs = [json.loads(line) for line in CONVERSATIONS.read_text(encoding="utf-8").splitlines()]
    assert 250 <= len(recs) <= 400
    assert CONVERSATIONS.stat().st_size < 3_000_000
    turns = {sum(m["role"] == "user" for m in r["messages"]) for r in recs}
    assert min(turns) == 1 and max(turns) == 8
    assert any(r["messages"][0]["role"] == "system" for r in recs)
    assert any(r["messages"][0]["role"] != "system" for r in recs)
    sizes = [sum(len(m["content"]) for m in r["messages"]) for r in recs]
    assert min(sizes) < 40 and max(sizes) > 12_000  # a few tokens .. a few thousand tokens
    for r in recs:
        roles = [m["role"] for m in r["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2)


def test_conversations_generator_is_deterministic(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("mk", CONVERSATIONS.parents[1] / "tools" / "make_conversations.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--out", str(tmp_path / "c.jsonl")])
    assert (tmp_path / "c.jsonl").read_bytes() == CONVERSATIONS.read_bytes()


def test_build_is_byte_identical(built: tuple[Path, Path]) -> None:
    a, b = built
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {"model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"} <= set(names)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json", "chat_template.jinja"):
        assert _sha(a / name) == _sha(b / name), name


def test_other_seed_other_weights(built: tuple[Path, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    other = make_tiny_model(tmp_path / "s1", CONVERSATIONS, seed=1, **SMALL)
    w0 = load_file(built[0] / "model.safetensors")
    w1 = load_file(other / "model.safetensors")
    assert w0.keys() == w1.keys()
    assert not torch.equal(w0["model.embed_tokens.weight"], w1["model.embed_tokens.weight"])
    assert (built[0] / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    assert all(t.dtype == torch.bfloat16 for k, t in w0.items() if not k.endswith("e_score_correction_bias"))


def test_loads_offline_with_kimi_shape(built: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(built[0], dtype=torch.bfloat16, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(built[0])
    cfg = model.config
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (4, 128)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        128, 512, 128, 64, 128,  # Kimi-K2.5's head widths: SGLang's MLA kernels for 192 and 576
    )
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts, cfg.first_k_dense_replace) == (
        8, 2, 1, 1,
    )
    layers = model.model.layers
    assert type(layers[0].mlp).__name__ == "DeepseekV3MLP"  # dense first layer
    assert all(type(layer.mlp).__name__ == "DeepseekV3MoE" for layer in layers[1:])
    assert not cfg.tie_word_embeddings
    assert cfg.vocab_size == len(tok) and 3500 <= len(tok) <= 8192
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2) == (
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id,
    )
    # the forward runs on the CPU in bf16 and the logits are finite
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "hi"}], return_dict=False)])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size) and torch.isfinite(logits).all()


def test_norm_weights_are_not_ones(built: tuple[Path, Path]) -> None:
    """Every RMSNorm weight drawn in [0.5, 1.5], each tensor its own: with ones, norm(norm(x)) would equal norm(x),
    so a final norm applied twice, skipped on a weight, or read from another layer's tensor would leave the numbers
    the tests compare unchanged."""
    from safetensors.torch import load_file

    norms = {k: v.float() for k, v in load_file(built[0] / "model.safetensors").items() if k.endswith("norm.weight")}
    assert len(norms) == 4 * 4 + 1  # per layer: input, post-attention, q_a, kv_a; and the final one
    for name, w in norms.items():
        assert 0.5 <= w.min() and w.max() <= 1.5 and w.std() > 0.2, name
    final = norms.pop("model.norm.weight")
    assert all(w.shape != final.shape or not torch.equal(w, final) for w in norms.values())

    def rms(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * final

    x = torch.randn(3, final.numel(), generator=torch.Generator().manual_seed(0))
    assert (rms(rms(x)) - rms(x)).abs().max() > 0.1


def test_chat_template_renders_kimi_format(built: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built[0])
    assert tok.chat_template == KIMI_STYLE_TEMPLATE
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6."},
    ]
    assert tok.apply_chat_template(conv, tokenize=False) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>4.<|im_end|>"
        "<|im_user|>user<|im_middle|>And 3+3?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>6.<|im_end|>"
    )
    # no system message: Kimi's default system turn is injected; generation prompt appended
    assert tok.apply_chat_template(conv[1:2], tokenize=False, add_generation_prompt=True) == (
        f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>"
        "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    # role markers are single tokens, never split by the BPE
    ids = tok.apply_chat_template(conv, return_dict=False)
    text_ids = tok.encode("<|im_user|>user<|im_middle|>", add_special_tokens=False)
    assert text_ids[0] == tok.convert_tokens_to_ids("<|im_user|>")
    assert text_ids[-1] == tok.convert_tokens_to_ids("<|im_middle|>")
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 5
    assert tok.decode(ids) == tok.apply_chat_template(conv, tokenize=False)


def test_unknown_override_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown config override\(s\) \['num_layers'\]"):
        make_tiny_model(tmp_path / "x", CONVERSATIONS, num_layers=4)
    assert not (tmp_path / "x").exists()


def test_a_folder_not_built_as_a_tiny_model_is_never_replaced(built: tuple[Path, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A user's model where the tiny model would go (make_tiny_model left true, `model` under resources/): refused,
    every file as it was; a tiny model (its marker) or an empty folder is replaced as before."""
    mine = tmp_path / "my-llama"
    mine.mkdir()
    (mine / "config.json").write_text('{"model_type": "llama"}')
    (mine / "model.safetensors").write_bytes(b"weights")
    msg = (f"tiny model: {mine} is in the way: the folder holds files and no hsextract_tiny.json, so it is not a "
           "tiny model hsextract built")
    with pytest.raises(ConfigError, match="^" + re.escape(msg)):
        make_tiny_model(mine, CONVERSATIONS, **SMALL)
    with pytest.raises(SystemExit, match="^error: " + re.escape(msg)):
        main(["--out", str(mine), "--conversations", str(CONVERSATIONS)])
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "model.safetensors"]
    assert (mine / "model.safetensors").read_bytes() == b"weights"
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"is in the way: the path is not a folder of its own"):
        make_tiny_model(tmp_path / "f", CONVERSATIONS, **SMALL)
    shutil.copytree(built[1], tmp_path / "again")
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "again", tmp_path / "empty"):
        make_tiny_model(out, CONVERSATIONS, **SMALL)
        assert _sha(out / "model.safetensors") == _sha(built[1] / "model.safetensors")


def test_the_tokenizer_trains_on_content_parts_and_null_content(tmp_path: Path) -> None:
    """A first source in OpenAI's shapes the prepare step reads (content parts, null content beside tool calls):
    the texts are the parts' texts; nothing else is a text (the build crashed on a part's dict)."""
    from hsextract.tinymodel.build import _iter_texts

    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": None, "tool_calls": []}, {"role": "assistant", "content": "Hi"}]}) + "\n")
    assert list(_iter_texts(path)) == ["user", "Hello", "assistant", "assistant", "Hi"]
