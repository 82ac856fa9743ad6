"""MoE routing sensitivity of the workflow's tiny DeepseekV3 under bf16-level numeric differences (CPU).

On the H200, SGLang + plugin vs the transformers engine (same weights, same ids) gives the tiny model
per-token errors with a small median but a "flipped" tail (tokens with rel > 0.1) that grows with depth.
The claim under test: those tails are MoE routing decisions (top-k near-ties) that change under
kernel-level differences, not capture errors. This script reproduces the situation with transformers
alone: one reference numeric (bf16, each prompt alone) against candidate numerics of the same bf16
weights (fp32 compute rounded to bf16; bf16 in a padded batch), records every MoE gate's expert set
per token in both runs, and relates the flipped tokens to routing differences. A control variant sets
`e_score_correction_bias` to widely spaced values so that the top-k is fixed for every token.

    PYTHONPATH=src python bench/moe_sensitivity.py [--out bench/results/moe-sensitivity-cpu.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hsextract.atomic import write_json_atomic
from hsextract.tinymodel import make_tiny_model

REPO = Path(__file__).resolve().parents[1]
CONVERSATIONS = REPO / "data" / "conversations.jsonl"
FLIP_THRESHOLD = 0.1  # the fidelity check's "flipped token" bound
GPU_AUX1_MEDIAN = 7e-3  # layer-1 per-token median seen on the H200 (target for choosing the candidate)
CANDIDATES = ("fp32_alone", "bf16_batched")
BIAS_SPACING = 2.0  # > 1 = the whole range of a sigmoid score, so the bias alone decides the top-k


# ---------------------------------------------------------------------------------------------- model
def load_tiny_model(workdir: str | os.PathLike[str], seed: int = 0, **config_overrides: Any) -> torch.nn.Module:
    """The workflow's tiny model: built by `make_tiny_model`, loaded the way the transformers engine loads it."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = make_tiny_model(Path(workdir) / "tiny-model", CONVERSATIONS, seed=seed, **config_overrides)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def moe_gates(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Decoder layer index -> its MoE router (the module whose forward makes the top-k choice)."""
    gates = {}
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gates[i] = gate
    return gates


@torch.no_grad()
def fix_routing(model: torch.nn.Module, spacing: float = BIAS_SPACING) -> None:
    """Bias expert e by e * spacing in every MoE layer: the top-k are always the k highest-numbered experts.

    In noaux_tc the bias only enters the selection (the routed weights use the unbiased scores), so the
    model still computes with real, input-dependent expert weights; only the choice becomes unambiguous.
    """
    for gate in moe_gates(model).values():
        b = gate.e_score_correction_bias
        b.copy_(torch.arange(b.numel(), dtype=b.dtype) * spacing)


def random_prompts(n: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids (no tokenizer needed): lengths uniform in [min_len, max_len], ids past the specials."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(8, vocab_size, (length,), generator=g).tolist() for length in lengths]


# ---------------------------------------------------------------------------------------------- runs
@dataclass
class Trace:
    """One prompt's forward: every decoder layer output and the post-norm state (bf16 values, as float32),
    and per MoE layer the selected expert set (sorted ids, [T, k]) and the selection margin (k-th minus
    (k+1)-th biased score, [T])."""

    hidden: list[torch.Tensor] = field(default_factory=list)
    routes: dict[int, torch.Tensor] = field(default_factory=dict)
    margins: dict[int, torch.Tensor] = field(default_factory=dict)


class _Recorder:
    """Forward hooks on the decoder layers, the final norm and the MoE gates of one model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers: list[torch.Tensor | None] = [None] * len(model.model.layers)
        self.post_norm: torch.Tensor | None = None
        self.routes: dict[int, torch.Tensor] = {}
        self.margins: dict[int, torch.Tensor] = {}
        self.handles = [layer.register_forward_hook(self._layer_hook(i)) for i, layer in enumerate(model.model.layers)]
        self.handles.append(model.model.norm.register_forward_hook(self._norm_hook))
        self.handles += [g.register_forward_hook(self._gate_hook(i)) for i, g in moe_gates(model).items()]

    def _layer_hook(self, i: int) -> Callable[..., None]:
        def hook(_m: torch.nn.Module, _inp: Any, out: Any) -> None:
            self.layers[i] = out[0] if isinstance(out, tuple) else out

        return hook

    def _norm_hook(self, _m: torch.nn.Module, _inp: Any, out: torch.Tensor) -> None:
        self.post_norm = out

    def _gate_hook(self, i: int) -> Callable[..., None]:
        def hook(gate: torch.nn.Module, inp: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, ...]) -> None:
            batch, seq = inp[0].shape[:2]
            logits, _weights, idx = out
            k = idx.shape[-1]
            # the same biased scores the router ranks (DeepseekV3TopkRouter, n_group = 1)
            choice = logits.float().sigmoid() + gate.e_score_correction_bias.float()
            top = choice.topk(k + 1, dim=-1).values
            self.routes[i] = idx.sort(dim=-1).values.view(batch, seq, k)
            self.margins[i] = (top[:, k - 1] - top[:, k]).view(batch, seq)

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.inference_mode()
def run(model: torch.nn.Module, prompts: Sequence[Sequence[int]], batch_size: int = 1, pad_id: int = 2) -> list[Trace]:
    """Forward `prompts` (right-padded batches of `batch_size`, as the transformers engine pads) and trace each.

    Outputs are rounded to bf16 (what a shard stores) and returned as float32 for exact comparisons.
    """
    rec = _Recorder(model)
    traces: list[Trace] = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            lengths = [len(p) for p in batch]
            ids = torch.full((len(batch), max(lengths)), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, p in enumerate(batch):
                ids[row, : lengths[row]] = torch.tensor(p, dtype=torch.long)
                mask[row, : lengths[row]] = 1
            model.model(input_ids=ids, attention_mask=mask, use_cache=False)
            outs = [*rec.layers, rec.post_norm]
            for row, n in enumerate(lengths):
                traces.append(
                    Trace(
                        hidden=[t[row, :n].to(torch.bfloat16).float() for t in outs],  # type: ignore[index]
                        routes={i: r[row, :n].clone() for i, r in rec.routes.items()},
                        margins={i: m[row, :n].clone() for i, m in rec.margins.items()},
                    )
                )
    finally:
        rec.close()
    return traces


def numerics(model: torch.nn.Module, prompts: Sequence[Sequence[int]], mode: str, batch: int = 8) -> list[Trace]:
    """The reference and the candidate numerics of the same bf16 weights.

    bf16_alone: bf16 forward, each prompt alone (the reference, as the fidelity check's transformers reference).
    fp32_alone: the bf16 weights cast exactly to float32, fp32 compute, outputs rounded to bf16.
    bf16_batched: bf16 forward of right-padded batches of `batch` prompts of mixed lengths.
    """
    if mode == "bf16_alone":
        return run(model, prompts, batch_size=1)
    if mode == "bf16_batched":
        return run(model, prompts, batch_size=batch)
    if mode == "fp32_alone":
        return run(copy.deepcopy(model).float(), prompts, batch_size=1)
    raise ValueError(f"unknown numerics mode {mode!r}; use bf16_alone, fp32_alone or bf16_batched")


# ---------------------------------------------------------------------------------------------- stats
def token_rel(ref: Sequence[Trace], got: Sequence[Trace]) -> list[torch.Tensor]:
    """Per output (decoder layers..., post-norm): per-token |got - ref| / |ref| (L2 over hidden), all prompts."""
    n_out = len(ref[0].hidden)
    return [
        torch.cat([(g.hidden[j] - r.hidden[j]).norm(dim=-1) / r.hidden[j].norm(dim=-1) for r, g in zip(ref, got)])
        for j in range(n_out)
    ]


def summarize(x: torch.Tensor, threshold: float = FLIP_THRESHOLD) -> dict[str, float]:
    x = x.double()
    q = torch.quantile(x, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {
        "tokens": int(x.numel()),
        "median": q[0],
        "p90": q[1],
        "p99": q[2],
        "max": float(x.max()),
        "flipped_frac": float((x > threshold).double().mean()),
    }


def route_diffs(ref: Sequence[Trace], got: Sequence[Trace]) -> dict[int, list[torch.Tensor]]:
    """MoE layer -> per prompt, bool[T]: the token's selected expert set differs between the runs."""
    return {i: [(r.routes[i] != g.routes[i]).any(dim=-1) for r, g in zip(ref, got)] for i in ref[0].routes}


def _quantiles(x: torch.Tensor) -> dict[str, float] | None:
    if x.numel() == 0:
        return None
    q = torch.quantile(x.double(), torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)).tolist()
    return {"n": int(x.numel()), "min": q[0], "p10": q[1], "median": q[2], "p90": q[3], "max": q[4]}


def compare(ref: Sequence[Trace], got: Sequence[Trace], threshold: float = FLIP_THRESHOLD) -> dict[str, Any]:
    """Per-token errors per output, routing differences per MoE layer and how the two line up."""
    rels = token_rel(ref, got)
    n_layers = len(rels) - 1
    names = [f"layer{j}" for j in range(n_layers)] + ["final_post_norm"]
    diffs = route_diffs(ref, got)
    moe_layers = sorted(diffs)
    total = int(sum(len(t.hidden[0]) for t in ref))

    routing = {}
    for i in moe_layers:
        d = torch.cat(diffs[i])
        routing[f"layer{i}"] = {"tokens_diff": int(d.sum()), "frac": float(d.double().mean())}

    per_output = {}
    for j, name in enumerate(names):
        depth = min(j, n_layers - 1)  # the post-norm state sees the same routing as the last layer
        upto = [i for i in moe_layers if i <= depth]
        own, ctx = [], []
        for p in range(len(ref)):
            seq = len(ref[p].hidden[0])
            o = torch.zeros(seq, dtype=torch.bool)
            for i in upto:
                o |= diffs[i][p]
            own.append(o)
            # causal context: a route change at this token or any earlier one reaches this token via attention
            ctx.append(torch.cummax(o.int(), dim=0).values.bool())
        own_t, ctx_t = torch.cat(own), torch.cat(ctx)
        flipped = rels[j] > threshold
        nf = int(flipped.sum())
        clean = ~ctx_t
        per_output[name] = {
            **summarize(rels[j], threshold),
            "flipped": nf,
            "tokens_route_diff_upto": int(own_t.sum()),
            "flipped_with_own_route_diff": (float((flipped & own_t).sum()) / nf) if nf else None,
            "flipped_with_context_route_diff": (float((flipped & ctx_t).sum()) / nf) if nf else None,
            "route_diff_tokens_flipped": (float((flipped & own_t).sum()) / int(own_t.sum())) if own_t.any() else None,
            "no_context_route_diff": {
                "tokens": int(clean.sum()),
                "flipped": int((flipped & clean).sum()),
                "max_rel": float(rels[j][clean].max()) if clean.any() else None,
            },
        }

    # Margin of the reference's choice where the candidate chose differently vs where it agreed. A route
    # change is "primary" when nothing upstream of it changed route: no change at an earlier MoE layer at
    # this token or before it, and none at this layer before it (attention carries those to this token);
    # primary changes are the ones kernel-level noise alone must explain, the rest can be cascades.
    m_diff, m_primary, m_secondary, m_same = [], [], [], []
    for p, r in enumerate(ref):
        upstream = torch.zeros(len(r.hidden[0]), dtype=torch.bool)  # route changed below this layer, in context
        for i in moe_layers:
            d = diffs[i][p]
            earlier_same_layer = (torch.cumsum(d.int(), dim=0) - d.int()) > 0  # a change at a strictly earlier position
            primary = d & ~upstream & ~earlier_same_layer
            m_diff.append(r.margins[i][d])
            m_primary.append(r.margins[i][primary])
            m_secondary.append(r.margins[i][d & ~primary])
            m_same.append(r.margins[i][~d])
            upstream |= torch.cummax(d.int(), dim=0).values.bool()
    all_diff, all_same = torch.cat(m_diff), torch.cat(m_same)
    margin = {
        # how often a choice with a margin below t changed: the near-tie rate per margin band
        "changed_below": {
            f"{t:g}": {
                "choices": int((all_diff < t).sum() + (all_same < t).sum()),
                "changed": int((all_diff < t).sum()),
            }
            for t in (1e-3, 1e-2, 1e-1)
        },
        "route_diff": _quantiles(all_diff),
        "route_diff_primary": _quantiles(torch.cat(m_primary)),
        "route_diff_secondary": _quantiles(torch.cat(m_secondary)),
        "route_same": _quantiles(torch.cat(m_same)),
    }
    n_moe_tokens = total * len(moe_layers)
    return {
        "tokens": total,
        "outputs": per_output,
        "routing": routing,
        "route_diff_events": int(sum(int(torch.cat(diffs[i]).sum()) for i in moe_layers)),
        "route_events": n_moe_tokens,
        "margin": margin,
    }


# ---------------------------------------------------------------------------------------------- report
def _fmt(x: float | None, spec: str = ".1e") -> str:
    return "–" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for variant, label in (
        ("router_as_built", "routers as built (bias 0)"),
        ("routing_fixed", "routing fixed (bias 0, 2, 4, ...)"),
    ):
        for cand, res in result[variant].items():
            tag = " (chosen)" if cand == result["chosen_candidate"] else ""
            lines += [
                (
                    f"**{label}; reference bf16 alone vs {cand}{tag}**, {res['tokens']} tokens, "
                    f"route changes {res['route_diff_events']} of {res['route_events']} token×MoE-layer choices"
                ),
                "",
                (
                    "| output | median | p90 | p99 | max | flipped (rel > 0.1) | tokens w/ route change ≤ L | "
                    "flipped w/ own route change ≤ L | flipped w/ route change ≤ L at or before the token | "
                    "max rel, no route change in context | route-changed tokens flipped |"
                ),
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for name, o in res["outputs"].items():
                lines.append(
                    f"| {name} | {o['median']:.1e} | {o['p90']:.1e} | {o['p99']:.1e} | {o['max']:.2f} | "
                    f"{o['flipped_frac']:.2%} ({o['flipped']}) | {o['tokens_route_diff_upto']} | "
                    f"{_fmt(o['flipped_with_own_route_diff'], '.0%')} | {_fmt(o['flipped_with_context_route_diff'], '.0%')} | "
                    f"{_fmt(o['no_context_route_diff']['max_rel'], '.1e')} | {_fmt(o['route_diff_tokens_flipped'], '.0%')} |"
                )
            m = res["margin"]
            parts = []
            for key in ("route_diff", "route_diff_primary", "route_diff_secondary", "route_same"):
                q = m[key]
                parts.append(
                    f"{key}: –"
                    if q is None
                    else f"{key} (n={q['n']}): min {q['min']:.1e}, p10 {q['p10']:.1e}, "
                    f"median {q['median']:.1e}, p90 {q['p90']:.1e}, max {q['max']:.1e}"
                )
            below = ", ".join(f"< {t}: {v['changed']}/{v['choices']}" for t, v in m["changed_below"].items())
            lines += [
                "",
                "Reference's top-k margin (k-th − (k+1)-th biased score): " + "; ".join(parts),
                "",
                f"Choices changed by margin band: {below}",
                "",
            ]
    return "\n".join(lines)


def summary_markdown(result: dict[str, Any], gpu_token: dict[str, Any] | None = None) -> str:
    """One table: the chosen candidate with routers as built and with routing fixed (+ the H200's flips)."""
    cand = result["chosen_candidate"]
    built, fixed = result["router_as_built"][cand], result["routing_fixed"][cand]
    head = (
        "| output | median rel | p99 | flipped (rel > 0.1) | flipped with a route change ≤ L at the token | "
        "route-changed tokens flipped | max rel, no route change in context | routing fixed: median | "
        "routing fixed: max | routing fixed: flipped |"
    )
    sep = "|---|---|---|---|---|---|---|---|---|---|"
    if gpu_token is not None:
        head += " H200 flipped (aux id) |"
        sep += "---|"
    lines = [head, sep]
    for name, o in built["outputs"].items():
        f = fixed["outputs"][name]
        row = (
            f"| {name} | {o['median']:.1e} | {o['p99']:.1e} | {o['flipped_frac']:.2%} | "
            f"{_fmt(o['flipped_with_own_route_diff'], '.0%')} | {_fmt(o['route_diff_tokens_flipped'], '.0%')} | "
            f"{_fmt(o['no_context_route_diff']['max_rel'], '.1e')} | {f['median']:.1e} | {f['max']:.1e} | "
            f"{f['flipped_frac']:.2%} |"
        )
        if gpu_token is not None:
            key = "final_post_norm" if name == "final_post_norm" else f"aux{name.removeprefix('layer')}"
            g = gpu_token.get(key)
            row += f" {g['flipped_frac']:.2%} (median {g['median']:.1e}) |" if g else " |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "moe-sensitivity-cpu.json")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=400)
    p.add_argument("--batch", type=int, default=8, help="prompts per padded batch of the bf16_batched candidate")
    p.add_argument("--seed", type=int, default=0, help="the model's seed (the workflow's default is 0)")
    p.add_argument("--prompt-seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--gpu-json",
        type=Path,
        default=None,
        help="an H200 fidelity-tiny.json: adds its per-token flips (key token.right) to the summary table",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="moe-sens-") as tmp:
        model = load_tiny_model(tmp, seed=args.seed)
    cfg = model.config
    prompts = random_prompts(args.prompts, args.min_len, args.max_len, cfg.vocab_size, args.prompt_seed)

    result: dict[str, Any] = {
        "what": "per-token error and MoE routing differences: bf16 alone (reference) vs candidate numerics, CPU",
        "model": {
            "builder": "hsextract.tinymodel.make_tiny_model + AutoModelForCausalLM.from_pretrained(bf16, sdpa)",
            "seed": args.seed,
            "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "n_routed_experts": cfg.n_routed_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "first_k_dense_replace": cfg.first_k_dense_replace,
            "vocab_size": cfg.vocab_size,
        },
        "prompts": {
            "n": args.prompts,
            "min_len": args.min_len,
            "max_len": args.max_len,
            "seed": args.prompt_seed,
            "tokens": sum(map(len, prompts)),
        },
        "candidates": {
            "fp32_alone": "bf16 weights cast exactly to fp32, fp32 compute, each prompt alone, outputs rounded to bf16",
            "bf16_batched": f"bf16, right-padded batches of {args.batch} prompts (mixed lengths)",
        },
        "flip_threshold": FLIP_THRESHOLD,
        "gpu_aux1_median_target": GPU_AUX1_MEDIAN,
        "bias_spacing_fixed": BIAS_SPACING,
        "torch": torch.__version__,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
    }
    import transformers

    result["transformers"] = transformers.__version__

    fixed = copy.deepcopy(model)
    fix_routing(fixed)
    for variant, m in (("router_as_built", model), ("routing_fixed", fixed)):
        ref = numerics(m, prompts, "bf16_alone")
        result[variant] = {c: compare(ref, numerics(m, prompts, c, args.batch)) for c in CANDIDATES}
        result[variant]["_self"] = compare(ref, ref)
    self_checks = {v: result[v].pop("_self") for v in ("router_as_built", "routing_fixed")}
    result["reference_vs_itself_max_rel"] = max(o["max"] for s in self_checks.values() for o in s["outputs"].values())
    l1 = {c: result["router_as_built"][c]["outputs"]["layer1"]["median"] for c in CANDIDATES}
    result["layer1_median"] = l1
    result["chosen_candidate"] = min(CANDIDATES, key=lambda c: abs(l1[c] - GPU_AUX1_MEDIAN))
    result["seconds"] = round(time.perf_counter() - t0, 1)

    write_json_atomic(args.out, result)
    gpu = json.loads(args.gpu_json.read_text())["token"]["right"] if args.gpu_json else None
    print(markdown(result))
    print(f"Summary, reference bf16 alone vs {result['chosen_candidate']}:\n")
    print(summary_markdown(result, gpu) + "\n")
    print(
        f"layer-1 medians {l1}; chosen {result['chosen_candidate']}; reference vs itself max rel "
        f"{result['reference_vs_itself_max_rel']}; {result['seconds']} s; wrote {args.out}"
    )
    return result


if __name__ == "__main__":
    main()
