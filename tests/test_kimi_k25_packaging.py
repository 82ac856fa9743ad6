"""Kimi-K2.5's packaging in miniature (hsextract.tinymodel.kimi_k25_checkpoint, `tinymodel --packaging kimi-k25`), and
what reads it: the transformers engine (the text model inside the wrapper), model_info, the final norm, the
processor files SGLang loads at start-up, and the SGLang plugin on an object shaped like SGLang's
KimiK25ForConditionalGeneration (tests/fake_sglang.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from fake_sglang import FakeServer, expected_states, sglang_model_for
from safetensors import safe_open
from test_workflow import ROOT

from hsextract.config.model_info import read_model_shape
from hsextract.engines.base import BOTH, CaptureSpec, Prompt
from hsextract.engines.transformers_engine import TransformersEngine
from hsextract.errors import ConfigError, EngineError
from hsextract.extract.final_norm import read_final_norm
from hsextract.extract.text_model import find_wrapped_text_model, load_causal_lm
from hsextract.sglang_plugin import dumpfiles
from hsextract.sglang_plugin import plugin as plg
from hsextract.tinymodel import kimi_k25_checkpoint as k25
from hsextract.tinymodel import kimi_tokenizer
from hsextract.tinymodel.build import make_tiny_model

CONVERSATIONS = ROOT / "data/conversations.jsonl"
SMALL = dict(num_hidden_layers=5, hidden_size=64, q_lora_rank=32, kv_lora_rank=32, intermediate_size=128,
             moe_intermediate_size=32, vocab_size=1024)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The miniature K2.5 checkpoint, and the text packaging of the same model (seed, sizes, Kimi's eps)."""
    d = tmp_path_factory.mktemp("k25")
    wrapped = make_tiny_model(d / "kimi-k25", CONVERSATIONS, tokenizer="kimi", packaging="kimi-k25", **SMALL)
    text = make_tiny_model(d / "text", CONVERSATIONS, tokenizer="kimi", rms_norm_eps=k25.RMS_NORM_EPS, **SMALL)
    return wrapped, text


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_files_config_and_weights_are_packaged_as_kimi_k25(built: tuple[Path, Path]) -> None:
    wrapped, text = built
    assert sorted(p.name for p in wrapped.iterdir()) == sorted([
        "config.json", "configuration_kimi_k25.py", "generation_config.json", "hsextract_tiny.json",
        "kimi_k25_processor.py", "kimi_k25_vision_processing.py", k25.TEXT_SHARD, k25.VISION_SHARD, k25.INDEX,
        "preprocessor_config.json", "chat_template.jinja", "tiktoken.model", "tokenization_kimi.py",
        "tokenizer_config.json"])
    cfg = json.loads((wrapped / "config.json").read_text())
    tc = cfg["text_config"]
    assert (cfg["architectures"], cfg["model_type"], cfg["auto_map"]) == (
        ["KimiK25ForConditionalGeneration"], "kimi_k25", {"AutoConfig": "configuration_kimi_k25.KimiK25Config"})
    assert (tc["architectures"], tc["model_type"], tc["num_nextn_predict_layers"], tc["rms_norm_eps"]) == (
        ["DeepseekV3ForCausalLM"], "kimi_k2", 0, 1e-5)
    assert (tc["num_hidden_layers"], tc["hidden_size"]) == (5, 64)
    ids = kimi_tokenizer.special_ids(tc["vocab_size"] - kimi_tokenizer.NUM_RESERVED_SPECIAL_TOKENS)
    assert cfg["media_placeholder_token_id"] == ids["<|media_pad|>"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (ids["[BOS]"], ids["[EOS]"], ids["[PAD]"])
    # the quantization block: Kimi's, at both places, and its ignore list covers every layer (re.match, as
    # compressed-tensors' should_ignore_layer does; SGLang's layer names, shards of fused ones)
    q = cfg["quantization_config"]
    assert tc["quantization_config"] == q and q["quant_method"] == "compressed-tensors"
    assert q["config_groups"]["group_0"]["weights"]["num_bits"] == 4 and q["format"] == "pack-quantized"

    def ignored(name: str) -> bool:
        return any(re.match(t[3:], name) if t.startswith("re:") else t.lower() in name.lower() for t in q["ignore"])

    layer = ["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj", "self_attn.kv_b_proj",
             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.shared_experts.gate_proj",
             "mlp.shared_experts.down_proj", "mlp.experts.0.gate_proj", "mlp.experts.0.up_proj",
             "mlp.experts.0.down_proj"]
    assert all(ignored(f"model.layers.{i}.{n}") for i in range(5) for n in layer) and ignored("lm_head")
    kimi_ignore = [t for t in q["ignore"] if t != "re:.*mlp\\.experts\\..*"]  # Kimi's own: the experts are int4
    assert not any(re.match(t[3:], "model.layers.1.mlp.experts.0.gate_proj") for t in kimi_ignore if "re:" in t)
    # the vision config under both spellings (Kimi's vt_* and SGLang's tower sizes), sized to the text model
    v = cfg["vision_config"]
    assert (v["vt_hidden_size"], v["hidden_size"], v["vt_num_hidden_layers"], v["num_hidden_layers"]) == (64, 64, 2, 2)
    assert v["text_hidden_size"] == 64 and v["merge_kernel_size"] == [2, 2]

    # weights: the text model's, byte for byte, under language_model.; the vision ones by Kimi's names
    index = json.loads((wrapped / k25.INDEX).read_text())["weight_map"]
    lm, vision = tensors(wrapped / k25.TEXT_SHARD), tensors(wrapped / k25.VISION_SHARD)
    assert index == {**dict.fromkeys(lm, k25.TEXT_SHARD), **dict.fromkeys(vision, k25.VISION_SHARD)}
    plain = tensors(text / "model.safetensors")
    assert sorted(lm) == sorted("language_model." + k for k in plain)
    assert all(torch.equal(lm["language_model." + k], t) and lm["language_model." + k].dtype == t.dtype
               for k, t in plain.items())
    for name in ("language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
                 "language_model.lm_head.weight", "language_model.model.layers.4.mlp.experts.7.down_proj.weight"):
        assert name in lm
    assert {k: tuple(t.shape) for k, t in vision.items()} == k25.vision_shapes(64)
    assert vision["mm_projector.proj.2.weight"].shape == (64, 4 * 64)
    assert vision["vision_tower.encoder.blocks.1.wqkv.weight"].shape == (3 * 64, 64)
    assert json.loads((wrapped / "hsextract_tiny.json").read_text())["packaging"] == "kimi-k25"


def test_the_text_model_gives_the_text_packagings_hidden_states_exactly(built: tuple[Path, Path]) -> None:
    wrapped, text = built
    w = find_wrapped_text_model(str(wrapped))
    assert w is not None and (w.wrapper, w.architecture, w.prefix) == (
        "KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM", "language_model.")
    assert find_wrapped_text_model(str(text)) is None
    g = torch.Generator().manual_seed(0)
    prompts = [Prompt(i, f"s{i}", torch.randint(0, 700, (n,), generator=g).tolist()) for i, n in enumerate((9, 23, 4))]
    spec = CaptureSpec((1, 2, 3, 4), BOTH)
    got = {}
    for name, path in (("kimi-k25", wrapped), ("text", text)):
        with TransformersEngine(path, spec, token_budget=64) as eng:
            assert (eng.num_layers, eng.hidden_size) == (5, 64)
            got[name] = [c.hidden_states for c in eng.extract(prompts)]
    assert len(got["text"]) == 3
    for a, b in zip(got["kimi-k25"], got["text"], strict=True):
        assert len(a) == 6 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # every layer of the plain forward, and the vision tower never built
    m1, m2 = load_causal_lm(str(wrapped), torch.bfloat16, "sdpa"), load_causal_lm(str(text), torch.bfloat16, "sdpa")
    assert not any("vision" in n or "mm_projector" in n for n, _ in m1.named_parameters())
    ids = torch.tensor([prompts[1].input_ids])
    with torch.no_grad():
        h1 = m1.model(input_ids=ids, output_hidden_states=True).hidden_states
        h2 = m2.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(h1) == 6 and all(torch.equal(x, y) for x, y in zip(h1, h2, strict=True))


def test_shape_and_final_norm_are_read_from_the_text_config_and_language_model_weights(
        built: tuple[Path, Path]) -> None:
    wrapped, text = built
    shape = read_model_shape(str(wrapped))
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size) == (5, 64, read_model_shape(str(text)).vocab_size)
    norm = read_final_norm(str(wrapped))
    assert norm.source == f"{k25.TEXT_SHARD}:language_model.model.norm.weight"
    assert (norm.kind, norm.eps) == ("rms_norm", 1e-5)
    assert torch.equal(norm.weight, tensors(text / "model.safetensors")["model.norm.weight"])


def test_config_and_processor_load_as_sglang_loads_them_at_start_up(built: tuple[Path, Path]) -> None:
    """SGLang's get_processor: AutoConfig then AutoProcessor with trust_remote_code (the remote code in the
    directory); its Kimi-K2.5 processor then reads media_processor.media_proc_cfg."""
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    wrapped, _ = built
    cfg = AutoConfig.from_pretrained(wrapped, trust_remote_code=True)
    assert type(cfg).__name__ == "KimiK25Config" and cfg.model_type == "kimi_k25"
    assert type(cfg.text_config).__name__ == "DeepseekV3Config" and cfg.hidden_size == 64
    assert cfg.text_config.rms_norm_eps == 1e-5 and cfg.quantization_config["quant_method"] == "compressed-tensors"
    proc = AutoProcessor.from_pretrained(wrapped, trust_remote_code=True, use_fast=True)
    assert type(proc.tokenizer).__name__ == "TikTokenTokenizer" and proc.media_processor is proc.image_processor
    mpc = proc.media_processor.media_proc_cfg
    assert {"patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side", "image_mean",
            "image_std", "fixed_output_tokens"} <= set(mpc)
    pad = proc.tokenizer.convert_tokens_to_ids("<|media_pad|>")
    assert pad == cfg.media_placeholder_token_id
    img = Image.new("RGB", (70, 50), (200, 10, 30))  # 5 x 3 patches, padded to 6 x 4: 3 x 2 merged tokens
    n = proc.media_processor.media_tokens_calculator({"type": "image", "image": img})
    out = proc(text=["look: " + "<|media_pad|>" * n], medias=[{"type": "image", "image": img}])
    assert n == 6 and out["grid_thws"].tolist() == [[1, 4, 6]] and tuple(out["pixel_values"].shape) == (24, 3, 14, 14)
    assert out["input_ids"][0].tolist().count(pad) == 6


def test_refusals(built: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="packaging kimi-k25 ships Kimi-K2.5's tokenizer packaging"):
        make_tiny_model(tmp_path / "x", CONVERSATIONS, tokenizer="fast", packaging="kimi-k25", **SMALL)
    # int4-packed text weights (Kimi-K2.5's experts): the transformers engine says so and names one
    wrapped, _ = built
    packed = tmp_path / "packed"
    shutil.copytree(wrapped, packed)
    index = json.loads((packed / k25.INDEX).read_text())
    index["weight_map"]["language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed"] = k25.TEXT_SHARD
    (packed / k25.INDEX).write_text(json.dumps(index))
    with pytest.raises(EngineError, match=r"quantized \(language_model\.model\.layers\.1\.mlp\.experts\.0\.gate_proj"
                                          r"\.weight_packed and 0 more\).*Use engine: sglang"):
        load_causal_lm(str(packed), torch.bfloat16, "sdpa")
    # ... and the config check says it before any job (it said so in every extract job, after prepare had run)
    from hsextract.config.checks import check

    config = {"model": str(packed), "make_tiny_model": False, "sources": [{"path": str(CONVERSATIONS)}],
              "reference_sample": str(ROOT / "resources/reference/speculators-v1-data_0.pt"), "trust_remote_code": True}
    with pytest.raises(ConfigError) as e:
        check(config)
    assert str(e.value) == (f"engine: transformers: {packed} (KimiK25ForConditionalGeneration): the text model's "
                            "weights are quantized (language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed"
                            " and 0 more); the transformers engine reads unquantized checkpoints only. Use engine: "
                            "sglang")
    with pytest.raises(ConfigError, match=r"^regenerate\.engine: transformers: "):
        check({**config, "engine": "sglang", "regenerate": {"enabled": True, "engine": "transformers"}})


# ---- the plugin on SGLang's KimiK25ForConditionalGeneration ------------------------------------------------------
def test_plugin_finds_decoder_layers_and_norm_inside_the_wrapper(built: tuple[Path, Path], tmp_path: Path) -> None:
    wrapped, _ = built
    model = sglang_model_for(wrapped)
    assert type(model).__name__ == "FakeKimiK25" and model.model is model.language_model  # SGLang's alias
    dec = plg.find_decoder(model)
    assert dec is model.language_model.model and len(dec.layers) == 5
    assert plg.final_norm_module(model) is model.language_model.model.norm
    dump = tmp_path / "dump"
    dump.mkdir(mode=0o700)
    aux = (1, 2, 4)
    srv = FakeServer(dump, aux, chunk=16, hidden=64, final_state="pre_norm", model=model).start()
    try:
        marker = json.loads(next(dump.glob(f"{dumpfiles.PLUGIN_MARKER_PREFIX}*.json")).read_text())
        # the plugin set the capture layers through the wrapper's delegating setter; they are the decoder's
        assert marker["layers_to_capture"] == dec.layers_to_capture == plg.find_layers_to_capture(model)
        assert len(dec.layers_to_capture) == 3 and marker["final_norm_module"] == "FusedAddRMSNorm"
        assert marker["hidden_size"] == 64 and srv.dumper.mode == "plugin"
        assert dec.norm._forward_pre_hooks  # the pre-norm tap sits on the wrapper's text model's final norm
        import urllib.request

        ids = list(range(3, 40))
        req = urllib.request.Request(f"{srv.url}/generate", data=json.dumps(
            {"rid": "hsx-k25", "input_ids": ids, "sampling_params": {"max_new_tokens": 0}}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
        got = dumpfiles.collect(dump, "hsx-k25", ids, len(aux) + 1, 10.0).hidden_states
    finally:
        srv.stop()
    # three passes of 16 rows through the decoder and the store hook: aux blocks, then the norm's input sum
    assert srv.passes == 3
    assert all(torch.equal(a, b) for a, b in zip(got, expected_states(ids, len(aux) + 1, 64), strict=True))


def test_the_miniature_media_config_is_the_processors_default() -> None:
    """MEDIA_PROC_CFG is written out beside the shipped processor's defaults (not imported: checkpoint code);
    the miniature's patch and merge sizes are Kimi-K2.5's, so the two are equal and stay so."""
    from hsextract.resources.kimi_k25_vision_processing import DEFAULT_MEDIA_PROC_CFG
    from hsextract.tinymodel.kimi_k25_checkpoint import MEDIA_PROC_CFG

    assert MEDIA_PROC_CFG == DEFAULT_MEDIA_PROC_CFG
