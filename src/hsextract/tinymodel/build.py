"""A miniature Kimi-K2.5 text model (DeepSeek-V3 architecture) with random weights.

The embedded default workflow runs on a laptop CPU, so it needs a target model that has
Kimi's *structure* (MLA attention with low-rank q and kv, MoE with sigmoid top-k routing
and one shared expert, dense first layer(s), final RMSNorm, untied lm_head, Kimi's chat
format) but is tiny. Weights are random from a fixed seed (the RMSNorm weights too, uniform in [0.5, 1.5]: with
ones, a norm applied twice or read from the wrong tensor would go unseen); a BPE tokenizer is trained on
the shipped conversations, in one of two packagings (`tokenizer=`):

- `fast`: a `tokenizers` tokenizer.json with the Kimi-style template of hsextract.tinymodel.chat_template;
- `kimi`: packaged the way Kimi-K2.5 ships its tokenizer (hsextract.tinymodel.kimi_tokenizer): custom code
  behind an `auto_map` (tokenization_kimi.py), a tiktoken.model BPE, a slow tokenizer, a
  Kimi-K2.5-shaped template with a `thinking` switch. Loading it needs trust_remote_code.

The checkpoint itself comes in one of two packagings (`packaging=`):

- `text`: a DeepseekV3ForCausalLM directory (config.json, model.safetensors), what save_pretrained writes;
- `kimi-k25`: Kimi-K2.5's multimodal wrapper in miniature (hsextract.tinymodel.kimi_k25_checkpoint, which says what
  SGLang needs to serve it and why the quantization_config it carries covers no layer): the same text
  weights under `language_model.`, its config in `text_config` (rms_norm_eps 1e-5, as Kimi's), a small
  MoonViT and projector, the processor files. Needs the kimi tokenizer.

Everything is deterministic: the same arguments write byte-identical weights and tokenizer files.

    python -m hsextract.tinymodel --out resources/tiny-model --conversations data/conversations.jsonl [--tokenizer kimi]
    python -m hsextract.tinymodel --packaging kimi-k25 --tokenizer kimi --out resources/kimi-k25-mini \
        --conversations data/conversations.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from hsextract.atomic import atomic_dir
from hsextract.errors import ConfigError
from hsextract.tinymodel import marker
from hsextract.tinymodel.chat_template import KIMI_STYLE_TEMPLATE, ROLE_TOKENS

BOS, EOS, PAD = "[BOS]", "[EOS]", "[PAD]"
# ids 0..7 in this order; DeepseekV3Config's defaults bos=0, eos=1 match.
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, *ROLE_TOKENS)

# Kimi-K2.5 text model -> miniature. Ratios kept where it matters for the code paths:
# q_lora_rank/kv_lora_rank present (MLA), qk_head = nope + rope, v_head != qk_head,
# n_group = topk_group = 1 (Kimi has no group-limited routing), sigmoid scores with
# a correction bias, norm_topk_prob, routed scaling factor, first layer dense.
# How the weights are drawn, beside TINY_CONFIG in make_tiny_model's params (workflow/rules/common.smk): bump it when
# that changes, so that a release drawing them otherwise rebuilds the model and reruns what it made
# (2: RMSNorm weights uniform in [0.5, 1.5], ones before).
WEIGHTS_RECIPE = 2

TINY_CONFIG: dict[str, Any] = {
    "num_hidden_layers": 10,
    "hidden_size": 256,
    "intermediate_size": 512,  # dense MLP of the first_k_dense_replace layers
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    # Kimi-K2.5's own head widths, so that SGLang runs the MLA kernels Kimi runs (prefill q/k 128 + 64 = 192,
    # decode kv_lora + rope = 576: both special-cased block sizes of its triton kernels). The former 32/32/32
    # widths (288; prefill 64, v 32) crashed every SGLang 0.5.16 start whose triton cache was already warm with
    # an illegal memory access at the warm-up request (bench/README.md, "production command").
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "hidden_act": "silu",
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
    "rope_interleave": True,
    "tie_word_embeddings": False,
    "attention_bias": False,
    # Read by SGLang's DeepseekV2 model (they are in DeepSeek-V3's and Kimi-K2.5's config.json) but not
    # defined by transformers' DeepseekV3Config; they describe what transformers computes anyway.
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}
DEFAULT_VOCAB_SIZE = 4096
TOKENIZER_KINDS = ("fast", "kimi")
PACKAGINGS = ("text", "kimi-k25")
# std of the random weights: the usual 0.02 for all matrices, except the MoE router.
# A random router with std 0.02 gives sigmoid scores all within ~0.5 +- 0.08, so the top-2
# choice is a near-tie for many tokens, and the rounding difference between a padded batch
# and a lone sample flips routes (measured: per-token errors up to 0.5, layer errors 5.7e-2
# by layer 9). Trained routers are decisive; std 0.2 (logit std ~3) is, and the same
# measurement falls to <= 5.8e-3 with neighbouring layers still 0.33 or more apart.
DEFAULT_INIT_STD = 0.02
DEFAULT_ROUTER_STD = 0.2


def _iter_texts(conversations_path: Path) -> Iterator[str]:
    with open(conversations_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                for m in rec["messages"]:
                    yield m["role"]
                    content = m["content"]  # a string, null, or OpenAI's content parts (their texts)
                    parts = content if isinstance(content, list) else [{"text": content}]
                    yield from (p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(
                    f"{conversations_path}:{lineno}: not a {{'messages': [{{'role', 'content'}}]}} record "
                    f"({e}); fix or remove the line."
                ) from e


def train_tokenizer(conversations_path: str | os.PathLike[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Any:
    """Byte-level BPE trained on the conversations' role names and contents.

    Returns a `transformers.PreTrainedTokenizerFast` carrying the special tokens and the
    Kimi-style chat template. Byte-level, so any text encodes (no unknown token).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_iter_texts(Path(conversations_path)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=list(ROLE_TOKENS),
        model_max_length=TINY_CONFIG["max_position_embeddings"],
        padding_side="right",
    )
    fast.chat_template = KIMI_STYLE_TEMPLATE
    return fast


def _param_seed(seed: int, name: str) -> int:
    # One generator per tensor, seeded from its name: the weights do not depend on the
    # order in which transformers creates or initialises modules.
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int, std: float, router_std: float) -> None:
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    for name in sorted(state):
        t = state[name]
        if name.endswith("e_score_correction_bias"):
            t.zero_()
        elif name.endswith("norm.weight"):  # every RMSNorm (input/post-attn, q_a, kv_a, final)
            # away from ones: a norm applied twice, skipped, or read from another tensor changes the numbers
            g = torch.Generator().manual_seed(_param_seed(seed, name))
            t.copy_(torch.empty(t.shape, dtype=torch.float32).uniform_(0.5, 1.5, generator=g))
        elif t.is_floating_point() and "rotary_emb" not in name:
            g = torch.Generator().manual_seed(_param_seed(seed, name))
            s = router_std if name.endswith("mlp.gate.weight") else std
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32) * s)


def build_config(vocab_size: int, special: dict[str, int] | None = None, **overrides: Any) -> Any:
    """DeepseekV3Config of the tiny model; `special` maps [BOS]/[EOS]/[PAD] to ids (default: 0, 1, 2)."""
    from transformers import DeepseekV3Config

    unknown = set(overrides) - set(TINY_CONFIG)
    if unknown:
        raise ConfigError(f"tiny model: unknown config override(s) {sorted(unknown)}; allowed: {sorted(TINY_CONFIG)}")
    cfg = {**TINY_CONFIG, **overrides}
    ids = special or {t: SPECIAL_TOKENS.index(t) for t in (BOS, EOS, PAD)}
    return DeepseekV3Config(
        vocab_size=vocab_size,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        dtype="bfloat16",
        **cfg,
    )


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    conversations_path: str | os.PathLike[str],
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    init_std: float = DEFAULT_INIT_STD,
    router_std: float = DEFAULT_ROUTER_STD,
    tokenizer: str = "fast",
    packaging: str = "text",
    quantization_config: bool = True,
    **config_overrides: Any,
) -> Path:
    """Write a tiny DeepseekV3ForCausalLM (bf16 safetensors) + tokenizer to `out_dir`.

    `tokenizer` is the tokenizer's packaging, `fast` or `kimi`, `packaging` the checkpoint's, `text` or
    `kimi-k25` (module docstring; `quantization_config=False` leaves that block out of a kimi-k25 config);
    `vocab_size` counts every id, the kimi tokenizer's 256 reserved special ids included. `config_overrides`
    replace keys of TINY_CONFIG (e.g. num_hidden_layers=4, hidden_size=128 for tests). The directory is built under a
    temporary name next to `out_dir` and renamed into place, replacing any previous one: it exists
    whole or not at all. A previous one must be a tiny model (marker.MARKER) or an empty folder: anything else
    there (a user's model) is a ConfigError, and nothing is touched.
    """
    from transformers import DeepseekV3ForCausalLM

    if tokenizer not in TOKENIZER_KINDS:
        raise ConfigError(f"tiny model: tokenizer={tokenizer!r}; choose one of {list(TOKENIZER_KINDS)}")
    if packaging not in PACKAGINGS:
        raise ConfigError(f"tiny model: packaging={packaging!r}; choose one of {list(PACKAGINGS)}")
    if packaging == "kimi-k25":
        from hsextract.tinymodel import kimi_k25_checkpoint

        if tokenizer != "kimi":
            raise ConfigError("tiny model: packaging kimi-k25 ships Kimi-K2.5's tokenizer packaging; "
                              "pass tokenizer='kimi' (--tokenizer kimi)")
        config_overrides = {"rms_norm_eps": kimi_k25_checkpoint.RMS_NORM_EPS, **config_overrides}
    out = Path(out_dir)
    foreign = marker.foreign_contents(out)
    if foreign:
        raise ConfigError(f"tiny model: {out} is in the way: the {foreign}; nothing was changed, choose another "
                          f"folder")
    if tokenizer == "kimi":
        from hsextract.tinymodel import kimi_tokenizer

        texts = [*kimi_tokenizer.TEMPLATE_WORDS, *_iter_texts(Path(conversations_path))]
        ranks = kimi_tokenizer.train_ranks(texts, vocab_size - kimi_tokenizer.NUM_RESERVED_SPECIAL_TOKENS)
        ids = kimi_tokenizer.special_ids(len(ranks))
        config = build_config(kimi_tokenizer.vocab_size(len(ranks)), ids, **config_overrides)
        eot = ids["<|im_end|>"]
    else:
        fast = train_tokenizer(conversations_path, vocab_size)
        config = build_config(len(fast), **config_overrides)
        eot = fast.convert_tokens_to_ids("<|im_end|>")

    torch.manual_seed(seed)  # only for anything transformers draws at construction; overwritten below
    model = DeepseekV3ForCausalLM(config)
    _init_weights(model, seed, init_std, router_std)
    model = model.to(torch.bfloat16).eval()
    # the model's generation defaults, stated rather than inherited
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = [config.eos_token_id, eot]
    model.generation_config.pad_token_id = config.pad_token_id

    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        if tokenizer == "kimi":
            kimi_tokenizer.write_kimi_tokenizer(tmp, ranks, TINY_CONFIG["max_position_embeddings"])
        else:
            fast.save_pretrained(tmp)
        if packaging == "kimi-k25":
            kimi_k25_checkpoint.rewrap(tmp, media_placeholder_token_id=ids["<|media_pad|>"], seed=seed,
                                       init_std=init_std, quantization=quantization_config)
        info = {
            "what": "hsextract tiny model: random DeepseekV3 (Kimi-K2.5 shape in miniature)",
            "tokenizer": tokenizer,
            "packaging": packaging,
            "seed": seed,
            "init_std": init_std,
            "router_std": router_std,
            "conversations": str(conversations_path),
            "weights_recipe": WEIGHTS_RECIPE,
        }
        (tmp / marker.MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for f in tmp.iterdir():  # safetensors writes owner-only files
            os.chmod(f, 0o644)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    p = argparse.ArgumentParser(prog="python -m hsextract.tinymodel", description="Build the tiny Kimi-shaped model.")
    p.add_argument("--out", required=True, type=Path,
                   help="model directory to write (a tiny model there is replaced; any other files refused)")
    p.add_argument("--conversations", required=True, type=Path, help="JSONL of {'messages': [...]} for the BPE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--num-layers", type=int, default=TINY_CONFIG["num_hidden_layers"])
    p.add_argument("--hidden-size", type=int, default=TINY_CONFIG["hidden_size"])
    p.add_argument("--tokenizer", choices=TOKENIZER_KINDS, default="fast",
                   help="fast: tokenizer.json; kimi: custom-code tiktoken tokenizer packaged like Kimi-K2.5's")
    p.add_argument("--packaging", choices=PACKAGINGS, default="text",
                   help="text: a DeepseekV3ForCausalLM checkpoint; kimi-k25: Kimi-K2.5's multimodal wrapper in "
                        "miniature (needs --tokenizer kimi)")
    p.add_argument("--no-quantization-config", dest="quantization_config", action="store_false",
                   help="kimi-k25: leave out the compressed-tensors quantization_config (it covers no layer)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        out = _build_from_args(args)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"tiny model written to {out} in {time.perf_counter() - t0:.1f} s")


def _build_from_args(args: argparse.Namespace) -> Path:
    return make_tiny_model(
        args.out,
        args.conversations,
        seed=args.seed,
        vocab_size=args.vocab_size,
        num_hidden_layers=args.num_layers,
        hidden_size=args.hidden_size,
        tokenizer=args.tokenizer,
        packaging=args.packaging,
        quantization_config=args.quantization_config,
    )

