"""Random-weight models made on the machine (fixed seeds), saved with save_pretrained in bf16.

    python3 mk_models.py OUT_DIR [--llama8b] [--only NAME ...]
OUT_DIR/llama     tiny Llama (8 layers, hidden 256)
OUT_DIR/deepseek  small DeepseekV3 (MLA + MoE, 8 layers, hidden 256, 8 routed experts, top-2)
OUT_DIR/deepseek-fixed  the same weights with routing made unambiguous (fix_routing): its routing-fixed twin
                  llama and deepseek get a final-norm weight drawn from [0.25, 2.25] (random init leaves it at
                  ones, and with a last-layer RMS near 1 the pre- and post-norm states are then too close to
                  tell apart, so a check of which one was captured would have no power)
OUT_DIR/tiny      the workflow's tiny DeepseekV3 (hsextract.tinymodel)
OUT_DIR/tiny-fixed  the same weights with routing made unambiguous (fix_routing: expert e biased by 2e, so
                  every token goes to experts 6 and 7): the control for MoE flips (bench/README.md, fidelity)
OUT_DIR/llama8b   Llama-3-8B shape, config.json only (SGLang: --load-format dummy; HF: random init on GPU)
OUT_DIR/wide      Kimi-K2.5's width (hidden 7168) in 4 thin Llama layers, config.json only: a prefill that far
                  outruns the capture path's writers (4 tensors of 7168 per token: 57 KB), to find their ceiling
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


def wide() -> LlamaConfig:
    return LlamaConfig(vocab_size=32000, hidden_size=7168, intermediate_size=4096, num_hidden_layers=4,
                       num_attention_heads=56, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                       torch_dtype="bfloat16")


def save(model_cls, cfg, out: Path, seed: int) -> None:
    torch.manual_seed(seed)
    m = model_cls(cfg).to(torch.bfloat16)
    with torch.no_grad():
        w = m.model.norm.weight
        w.copy_(0.25 + 2 * torch.rand(w.shape, generator=torch.Generator().manual_seed(seed + 100)))
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
    ap.add_argument("--wide", action="store_true", help="also the config-only 'wide' model (hidden 7168)")
    ap.add_argument("--only", nargs="+", help="build only these (llama, deepseek, deepseek-fixed, tiny, tiny-fixed)")
    a = ap.parse_args()
    out = Path(a.out)

    def wanted(name: str) -> bool:
        return (a.only is None or name in a.only) and not (out / name / "config.json").exists()

    for name, flag, make in (("llama8b", a.llama8b, llama8b), ("wide", a.wide, wide)):
        if flag:
            (out / name).mkdir(parents=True, exist_ok=True)
            cfg = make().to_dict()
            cfg["architectures"] = ["LlamaForCausalLM"]
            (out / name / "config.json").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    if wanted("llama"):
        save(LlamaForCausalLM, llama_tiny(), out / "llama", seed=0)
    if wanted("deepseek") or (wanted("deepseek-fixed") and not (out / "deepseek" / "config.json").exists()):
        save(DeepseekV3ForCausalLM, deepseek_small(), out / "deepseek", seed=1)
    if wanted("deepseek-fixed"):
        tiny_fixed(out / "deepseek", out / "deepseek-fixed")
    if a.only is not None and not {"tiny", "tiny-fixed"} & set(a.only):
        return
    if not (out / "tiny" / "config.json").exists():
        # the workflow's own default model (hsextract.tinymodel), tokenizer trained on the shipped data
        from hsextract.tinymodel.build import make_tiny_model

        try:
            make_tiny_model(out / "tiny", Path(__file__).resolve().parents[2] / "data" / "conversations.jsonl")
        except Exception as e:  # noqa: BLE001 - the other models must still be built
            print("tiny model failed:", repr(e), flush=True)
    if (out / "tiny" / "config.json").exists() and not (out / "tiny-fixed" / "config.json").exists():
        tiny_fixed(out / "tiny", out / "tiny-fixed")


if __name__ == "__main__":
    main()
