"""Random-weight models made on the machine (fixed seeds), saved with save_pretrained in bf16.

    python3 mk_models.py OUT_DIR [--llama8b]
OUT_DIR/llama     tiny Llama (8 layers, hidden 256), as in notes/sglang-on-h200.md
OUT_DIR/deepseek  small DeepseekV3 (MLA + MoE, 8 layers, hidden 256, 8 routed experts, top-2)
OUT_DIR/tiny      the workflow's tiny DeepseekV3 (hsextract.tinymodel)
OUT_DIR/tiny-fixed  the same weights with routing made unambiguous (fix_routing: expert e biased by 2e, so
                  every token goes to experts 6 and 7): the control for MoE flips (bench/README.md, fidelity)
OUT_DIR/llama8b   Llama-3-8B shape, config.json only (SGLang: --load-format dummy; HF: random init on GPU)
A byte-level tokenizer is not needed: every request is sent as token ids (--skip-tokenizer-init).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM


def llama_tiny() -> LlamaConfig:
    return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       torch_dtype="bfloat16")


def deepseek_small() -> DeepseekV3Config:
    return DeepseekV3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                            num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                            n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=256,
                            q_lora_rank=64, qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, n_group=1,
                            topk_group=1, max_position_embeddings=4096, rope_scaling=None, torch_dtype="bfloat16",
                            # read by SGLang's DeepseekV2 (as in DeepSeek-V3's and Kimi-K2.5's config.json) but
                            # not defined by transformers' DeepseekV3Config: without them SGLang fails to load
                            moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc")


def llama8b() -> LlamaConfig:
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0, torch_dtype="bfloat16")


def save(model_cls, cfg, out: Path, seed: int) -> None:
    torch.manual_seed(seed)
    m = model_cls(cfg).to(torch.bfloat16)
    m.save_pretrained(out)
    print(out, sum(p.numel() for p in m.parameters()), "parameters", flush=True)


@torch.no_grad()
def fix_routing(model: torch.nn.Module, spacing: float = 2.0) -> None:
    """Bias expert e by e * spacing in every MoE router: the top-k are always the k highest-numbered experts.

    `spacing` > 1 spans the whole range of a sigmoid score, so the bias alone decides the selection. In
    noaux_tc the bias only enters the selection (the routed weights use the unbiased scores), so the model
    still computes with real, input-dependent expert weights; only the choice becomes unambiguous.
    """
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            b = gate.e_score_correction_bias
            b.copy_(torch.arange(b.numel(), dtype=b.dtype) * spacing)


def tiny_fixed(src: Path, dst: Path) -> None:
    """`src` with every MoE router's selection fixed (weights unchanged), tokenizer files copied."""
    import shutil

    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    fix_routing(m)
    m.save_pretrained(dst)
    for f in src.iterdir():
        if f.is_file() and not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)
    print(dst, "routing fixed", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--llama8b", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    if not (out / "llama" / "config.json").exists():
        save(LlamaForCausalLM, llama_tiny(), out / "llama", seed=0)
    if not (out / "deepseek" / "config.json").exists():
        save(DeepseekV3ForCausalLM, deepseek_small(), out / "deepseek", seed=1)
    if not (out / "tiny" / "config.json").exists():
        # the workflow's own default model (hsextract.tinymodel), tokenizer trained on the shipped data
        from hsextract.tinymodel import make_tiny_model

        try:
            make_tiny_model(out / "tiny", Path(__file__).resolve().parents[2] / "data" / "conversations.jsonl")
        except Exception as e:  # noqa: BLE001 - the other models must still be built
            print("tiny model failed:", repr(e), flush=True)
    if (out / "tiny" / "config.json").exists() and not (out / "tiny-fixed" / "config.json").exists():
        tiny_fixed(out / "tiny", out / "tiny-fixed")
    if a.llama8b:
        (out / "llama8b").mkdir(parents=True, exist_ok=True)
        cfg = llama8b().to_dict()
        cfg["architectures"] = ["LlamaForCausalLM"]
        (out / "llama8b" / "config.json").write_text(json.dumps(cfg, indent=1))


if __name__ == "__main__":
    main()
