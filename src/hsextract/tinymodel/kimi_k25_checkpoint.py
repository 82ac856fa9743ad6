"""A text checkpoint repackaged the way Kimi-K2.5 ships: the multimodal wrapper around its language model.

`python -m hsextract.tinymodel --packaging kimi-k25 --tokenizer kimi ...` builds the tiny DeepseekV3 as
usual, then `rewrap` turns its directory into Kimi-K2.5's packaging, in miniature:

    config.json                  architectures [KimiK25ForConditionalGeneration], model_type kimi_k25,
                                 auto_map AutoConfig -> configuration_kimi_k25.KimiK25Config; the text model
                                 in `text_config` (architectures [DeepseekV3ForCausalLM], model_type kimi_k2,
                                 num_nextn_predict_layers 0), a MoonViT `vision_config`, a compressed-tensors
                                 `quantization_config` at the top level and again in text_config (below),
                                 media_placeholder_token_id = the tokenizer's <|media_pad|>
    model-00001-of-00002.safetensors   language_model.model.{embed_tokens,layers.*,norm}.*, language_model.lm_head.*
    model-00002-of-00002.safetensors   vision_tower.* and mm_projector.*, Kimi-K2.5's names at small sizes
    model.safetensors.index.json
    configuration_kimi_k25.py    the config class behind auto_map (hsextract/resources)
    preprocessor_config.json     auto_map AutoProcessor -> kimi_k25_processor.KimiK25Processor, AutoImageProcessor
                                 -> kimi_k25_vision_processing.KimiK25VisionProcessor, and `media_proc_cfg`
    kimi_k25_processor.py, kimi_k25_vision_processing.py   that processor (hsextract/resources)
    tokenizer_config.json, tokenization_kimi.py, tiktoken.model, chat_template.jinja, generation_config.json

The text weights are the tiny model's, byte for byte, under the `language_model.` prefix: the same seed gives
the same hidden states in both packagings (with the same config overrides; kimi-k25 sets rms_norm_eps 1e-5,
Kimi-K2.5's). Not shipped: Kimi-K2.5's modeling code (modeling_kimi_k25.py and its DeepSeek modules; SGLang
has its own model class and hsextract's transformers engine builds DeepseekV3ForCausalLM from text_config),
so auto_map names AutoConfig only.

What SGLang 0.5.16 needs to start this architecture (checked by reading its source; it runs on a GPU only):
- Config: `AutoConfig.from_pretrained(dir, trust_remote_code=True)` (utils/hf_transformers/config.py:86)
  imports configuration_kimi_k25.py through auto_map, then SGLang reloads config.json with its own
  KimiK25Config (config.py:137-141; configs/kimi_k25.py:128-161), which rebuilds text_config as a
  DeepseekV3Config and takes the top-level quantization_config from text_config (kimi_k25.py:157-159).
- Vision tower sizes: SGLang's KimiK25VisionConfig reads `hidden_size`, `num_hidden_layers`,
  `num_attention_heads`, `intermediate_size` (configs/kimi_k25.py:36-81, defaults 1152/27/16/4304) and
  builds MoonViT from them (models/kimi_k25.py:533-548), while its projector reads `vt_hidden_size` and
  `text_hidden_size` (models/kimi_k25.py:601-612). Kimi-K2.5's vision_config has only the `vt_*` names, so a
  real server builds the default-size tower, which happens to be Kimi's. The miniature writes both spellings
  with its small sizes, else SGLang would build a 27-layer 1152-wide tower and reject the small weights.
- Weights: `load_weights` (models/kimi_k25.py:849-892) renames `wqkv.`/`wo.` to `attn.qkv_proj.`/`attn.proj.`
  and `mm_projector.proj.0/.2` to `linear_1/2`, raises ValueError for a vision name it does not know (877-878)
  and hands `language_model.`-stripped names to DeepseekV3ForCausalLM (885). Missing vision weights are not an
  error; the miniature ships them (Kimi-K2.5's names and shapes, e.g. patch_embed.proj [H, 3, 14, 14],
  pos_emb [h, w, H], wqkv [3H, H], mm_projector.proj.0 [4H, 4H], proj.2 [text H, 4H]).
- A processor: the architecture is multimodal (configs/model_config.py:334, 414), so the tokenizer manager
  builds one at start-up, with --skip-tokenizer-init too (managers/tokenizer_manager.py:361-377):
  `get_processor` loads the config as above and calls `AutoProcessor.from_pretrained(dir,
  trust_remote_code=..., use_fast=True)` (utils/hf_transformers/processor.py:166-217); SGLang's own
  KimiK2_5VLImageProcessor then reads `_processor.media_processor.media_proc_cfg` [patch_size,
  merge_kernel_size, in_patch_limit, patch_limit_on_one_side, image_mean, image_std; fixed_output_tokens
  optional] and `hf_config.media_placeholder_token_id` (multimodal/processors/kimi_k25.py:416-443).
  Kimi-K2.5 ships that processor as remote code behind preprocessor_config.json's auto_map; so does the
  miniature (its own small implementation, images only). The server needs --trust-remote-code (the
  tokenizer needs it anyway; config/kimi.yaml sets trust_remote_code: true).
- No server flag serves the text model alone without that processor: `--enable-multimodal` is a store-true
  flag (server_args.py:525; its default None means "by architecture"), and `--language-only`
  (server_args.py:2570) is the language half of encoder disaggregation: it skips loading vision weights
  (models/kimi_k25.py:862) but still builds the processor and starts an encoder bootstrap server
  (tokenizer_manager.py:537). Do not use it for hidden-state extraction; ship the processor files.

Quantization: Kimi-K2.5 carries a compressed-tensors int4 `quantization_config` (pack-quantized, group 32,
symmetric; ignore: lm_head, attention, shared experts, dense MLPs) at the top level and in text_config, and
only its routed experts are packed int4. The miniature keeps that block, in both places, with one more
`ignore` entry, `re:.*mlp\\.experts\\..*`, so that it covers every layer of the model: SGLang's
CompressedTensorsConfig gives an ignored linear layer UnquantizedLinearMethod and an ignored MoE layer (its
`<prefix>.0.gate_proj/up_proj/down_proj` names matched against `ignore`, re.match for `re:` entries)
UnquantizedFusedMoEMethod (layers/quantization/compressed_tensors/compressed_tensors.py:173-191, 684-700,
860-861; compressed_tensors/utils.py:24-87, 158-176), which load plain bf16 `weight` tensors, as the
random weights are. So the server parses the block as it parses Kimi's (ModelConfig quantization
compressed-tensors, configs/model_config.py:1096-1097) without ever expecting packed int4 tensors. Other
uses of the block: `is_wint4afp8_or_wint4a16_config` turns shared-expert fusion off and adds expert
input-scale name mappings (models/deepseek_v2.py:2814, deepseek_common/deepseek_weight_loader.py:186), both
harmless here; the Blackwell-only MoE backend choice (arg_groups/overrides.py:1342-1392) picks
flashinfer_trtllm with or without it. Without the extra entry SGLang would give the routed experts
CompressedTensorsWNA16MoE and expect `weight_packed` tensors the miniature does not have. If a server
release ever refuses the block, build with `--no-quantization-config` (the same model without it). hsextract's
transformers engine drops a quantization_config whose checkpoint holds no quantized tensor
(hsextract.extract.text_model).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from hsextract.errors import ConfigError

ARCHITECTURE = "KimiK25ForConditionalGeneration"
MODEL_TYPE = "kimi_k25"
TEXT_ARCHITECTURE = "DeepseekV3ForCausalLM"
TEXT_MODEL_TYPE = "kimi_k2"  # as in Kimi-K2.5's raw config.json; config classes rebuild it as DeepSeek-V3
TEXT_PREFIX = "language_model."
RMS_NORM_EPS = 1e-5  # Kimi-K2.5's text_config
REMOTE_CODE = ("configuration_kimi_k25.py", "kimi_k25_processor.py", "kimi_k25_vision_processing.py")
RESOURCES = Path(__file__).resolve().parents[1] / "resources"
TEXT_SHARD = "model-00001-of-00002.safetensors"
VISION_SHARD = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"

# Kimi-K2.5's block, plus the routed experts in `ignore` (module docstring)
QUANTIZATION_CONFIG: dict[str, Any] = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                        "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                        "type": "int"},
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*mlp\\.experts\\..*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

# MoonViT in miniature: 2 blocks of width 64, 2 heads of 32 (SGLang's 2D rope needs head_dim % 4 == 0),
# patch 14, an 8x8 learned position grid, 2x2 patch merging. Kimi-K2.5: 27 x 1152, 16 heads, 4304, 64x64.
VISION = {"hidden": 64, "layers": 2, "heads": 2, "intermediate": 128, "patch": 14, "pos_emb": 8, "merge": 2}
# Written out, not imported from resources/kimi_k25_vision_processing.py (DEFAULT_MEDIA_PROC_CFG): that file is
# checkpoint code, and importing it would put its imports (transformers, PIL) into the package's import graph.
MEDIA_PROC_CFG: dict[str, Any] = {
    "patch_size": VISION["patch"],
    "merge_kernel_size": VISION["merge"],
    "in_patch_limit": 1024,
    "patch_limit_on_one_side": 32,
    "fixed_output_tokens": None,
    "temporal_merge_kernel_size": 4,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def vision_config(text_hidden_size: int) -> dict[str, Any]:
    """Kimi-K2.5's vision_config keys at the miniature's sizes, plus the names SGLang builds MoonViT from."""
    v = VISION
    return {
        "init_pos_emb_height": v["pos_emb"],
        "init_pos_emb_time": 4,
        "init_pos_emb_width": v["pos_emb"],
        "merge_kernel_size": [v["merge"], v["merge"]],
        "merge_type": "sd2_tpool",
        "mm_hidden_size": v["hidden"],
        "mm_projector_type": "patchmerger",
        "model_type": "",
        "patch_size": v["patch"],
        "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        "text_hidden_size": text_hidden_size,
        "video_attn_type": "spatial_temporal",
        "vt_hidden_size": v["hidden"],
        "vt_intermediate_size": v["intermediate"],
        "vt_num_attention_heads": v["heads"],
        "vt_num_hidden_layers": v["layers"],
        # SGLang 0.5.16's KimiK25VisionConfig reads these for the tower (module docstring)
        "hidden_size": v["hidden"],
        "intermediate_size": v["intermediate"],
        "num_attention_heads": v["heads"],
        "num_hidden_layers": v["layers"],
    }


def vision_shapes(text_hidden_size: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the vision tower and projector weights, Kimi-K2.5's names."""
    v = VISION
    h, i, p, m = v["hidden"], v["intermediate"], v["patch"], v["hidden"] * v["merge"] ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (h, 3, p, p),
        "vision_tower.patch_embed.proj.bias": (h,),
        "vision_tower.patch_embed.pos_emb.weight": (v["pos_emb"], v["pos_emb"], h),
        "vision_tower.encoder.final_layernorm.weight": (h,),
        "vision_tower.encoder.final_layernorm.bias": (h,),
        "mm_projector.pre_norm.weight": (h,),
        "mm_projector.pre_norm.bias": (h,),
        "mm_projector.proj.0.weight": (m, m),
        "mm_projector.proj.0.bias": (m,),
        "mm_projector.proj.2.weight": (text_hidden_size, m),
        "mm_projector.proj.2.bias": (text_hidden_size,),
    }
    for b in range(v["layers"]):
        pre = f"vision_tower.encoder.blocks.{b}."
        shapes.update({
            pre + "wqkv.weight": (3 * h, h), pre + "wqkv.bias": (3 * h,),
            pre + "wo.weight": (h, h), pre + "wo.bias": (h,),
            pre + "norm0.weight": (h,), pre + "norm0.bias": (h,),
            pre + "norm1.weight": (h,), pre + "norm1.bias": (h,),
            pre + "mlp.fc0.weight": (i, h), pre + "mlp.fc0.bias": (i,),
            pre + "mlp.fc1.weight": (h, i), pre + "mlp.fc1.bias": (h,),
        })
    return shapes


def vision_weights(text_hidden_size: int, seed: int, std: float) -> dict[str, torch.Tensor]:
    """Random bf16 vision weights: LayerNorms 1 and 0, other biases 0, the rest N(0, std) seeded per name."""
    from hsextract.tinymodel.build import _param_seed

    out = {}
    for name, shape in sorted(vision_shapes(text_hidden_size).items()):
        norm = "norm" in name.rsplit(".", 2)[-2]
        if name.endswith(".bias"):
            t = torch.zeros(shape)
        elif norm:
            t = torch.ones(shape)
        else:
            g = torch.Generator().manual_seed(_param_seed(seed, name))
            t = torch.randn(shape, generator=g, dtype=torch.float32) * std
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def text_config(text: dict[str, Any], quantization: bool) -> dict[str, Any]:
    """The text model's config.json (as save_pretrained wrote it) as Kimi-K2.5's text_config."""
    cfg = {k: v for k, v in text.items() if k != "transformers_version"}
    cfg.update(architectures=[TEXT_ARCHITECTURE], model_type=TEXT_MODEL_TYPE, num_nextn_predict_layers=0)
    if quantization:
        cfg["quantization_config"] = QUANTIZATION_CONFIG
    return cfg


def wrapper_config(text: dict[str, Any], media_placeholder_token_id: int, quantization: bool) -> dict[str, Any]:
    tc = text_config(text, quantization)
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "bos_token_id": tc["bos_token_id"],
        "dtype": tc.get("dtype", "bfloat16"),
        "eos_token_id": tc["eos_token_id"],
        "ignore_index": -100,
        "media_placeholder_token_id": media_placeholder_token_id,
        "model_type": MODEL_TYPE,
        "pad_token_id": tc["pad_token_id"],
        "text_config": tc,
        "tie_word_embeddings": False,
        "transformers_version": text.get("transformers_version"),
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "vision_config": vision_config(int(tc["hidden_size"])),
    }
    if quantization:
        cfg["quantization_config"] = QUANTIZATION_CONFIG
    return cfg


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def rewrap(model_dir: str | os.PathLike[str], *, media_placeholder_token_id: int, seed: int, init_std: float,
           quantization: bool = True) -> None:
    """Turn a text checkpoint directory (config.json + model.safetensors, as save_pretrained writes them) into
    Kimi-K2.5's packaging, in place (module docstring). The tokenizer files already in it are kept."""
    from safetensors.torch import load_file, save_file

    out = Path(model_dir)
    text = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if text.get("architectures") != [TEXT_ARCHITECTURE]:
        raise ConfigError(f"{out}: packaging kimi-k25 wraps a {TEXT_ARCHITECTURE}, not {text.get('architectures')}")
    lm = {TEXT_PREFIX + k: v for k, v in load_file(str(out / "model.safetensors")).items()}
    vision = vision_weights(int(text["hidden_size"]), seed, init_std)
    save_file(lm, str(out / TEXT_SHARD), metadata={"format": "pt"})
    save_file(vision, str(out / VISION_SHARD), metadata={"format": "pt"})
    size = sum(t.numel() * t.element_size() for t in (*lm.values(), *vision.values()))
    weight_map = {**dict.fromkeys(lm, TEXT_SHARD), **dict.fromkeys(vision, VISION_SHARD)}
    _write_json(out / INDEX, {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))})
    (out / "model.safetensors").unlink()
    _write_json(out / "config.json", wrapper_config(text, media_placeholder_token_id, quantization))
    for name in REMOTE_CODE:
        shutil.copyfile(RESOURCES / name, out / name)
    _write_json(out / "preprocessor_config.json", {
        "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor",
                     "AutoProcessor": "kimi_k25_processor.KimiK25Processor"},
        "media_proc_cfg": MEDIA_PROC_CFG,
    })


__all__ = ["ARCHITECTURE", "MEDIA_PROC_CFG", "MODEL_TYPE", "QUANTIZATION_CONFIG", "RMS_NORM_EPS", "TEXT_PREFIX",
           "rewrap", "vision_config", "vision_shapes", "vision_weights", "wrapper_config"]
