"""Layer ids and their conventions: what an aux layer id means, and what each consumer calls it.

One convention is stored everywhere (config after resolution, shards, dataset.json, reports, CLI):

    hidden_states   id i = transformers `hidden_states[i]` = the input of decoder layer i = the output of
                    layer i-1 (0: the embeddings). EAGLE-3's reference code, vLLM (`_maybe_add_hidden_state`
                    with idx+1 after layer idx; `eagle_aux_hidden_state_layer_ids`) and SGLang's
                    `layers_to_capture` ("before layer i") use it, and so do the drafter configs people
                    copy: Kimi-K2.5's [2, 30, 58] are the outputs of layers 1, 29, 57.

The other one, still met in configs, old shards and some consumers:

    layer_output    id i = the output of decoder layer i = `hidden_states[i+1]`. hsextract's shards before
                    they recorded a convention; SpecForge's `aux_hidden_states_layers` ([1, L//2-1, L-4]);
                    speculators 0.4's data generation `layer_ids` (captured after layer i); SGLang's DFlash
                    `target_layer_ids` (`set_dflash_layers_to_capture` adds 1).

Why hidden_states: it is the number a served drafter is configured with, so the ids a user reads in
dataset.json are the ones to put in the drafter's config for vLLM, and a mismatch with the engine is then
visible as a different number instead of hidden one layer away.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

HIDDEN_STATES = "hidden_states"
LAYER_OUTPUT = "layer_output"
CONVENTIONS = (HIDDEN_STATES, LAYER_OUTPUT)
STORED = HIDDEN_STATES  # what every id this package writes means
# a shard without `layer_convention` was written before it was recorded: its ids are layer outputs
UNRECORDED = LAYER_OUTPUT

# SGLang 0.5.16 `set_eagle3_layers_to_capture(ids)`: these model classes take the ids as they are unless the
# first is 1 (then +1 each; deepseek_v2.py, glm4_moe_lite.py; KimiK25 delegates to its DeepseekV3); every
# other class with the method adds 1 (llama.py, qwen2/3(_moe).py, gpt_oss.py, ...).
SGLANG_RAW_UNLESS_ONE = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "Glm4MoeLiteForCausalLM",
})


def to_hidden_states(ids: Sequence[int], convention: str) -> list[int]:
    """`ids` given in `convention`, as hidden_states indices."""
    if convention == HIDDEN_STATES:
        return [int(i) for i in ids]
    if convention == LAYER_OUTPUT:
        return [int(i) + 1 for i in ids]
    raise ValueError(f"layer convention {convention!r}: one of {', '.join(CONVENTIONS)}")


def to_layer_output(hs_ids: Sequence[int]) -> list[int]:
    return [int(i) - 1 for i in hs_ids]


def describe(hs_ids: Sequence[int]) -> str:
    """'hidden_states[2, 30, 58] = outputs of decoder layers 1, 29, 57' ('hidden_states[0, 5] = the embeddings,
    outputs of decoder layers 4')."""
    parts = (["the embeddings"] if 0 in hs_ids else []) + \
        ([f"outputs of decoder layers {', '.join(str(i - 1) for i in hs_ids if i != 0)}"] if any(hs_ids) else [])
    return f"hidden_states{list(hs_ids)} = {', '.join(parts) or 'no layer'}"


def shard_convention(meta: Mapping[str, Any]) -> str:
    """The convention of a shard's `aux_layers` (unrecorded: written before it was, i.e. layer outputs)."""
    return str(meta.get("layer_convention", UNRECORDED))


def shard_hidden_states(meta: Mapping[str, Any]) -> list[int]:
    """A shard's aux layers as hidden_states indices, whatever convention it was written in."""
    return to_hidden_states(meta["aux_layers"], shard_convention(meta))


def sglang_eagle3_ids(hs_ids: Sequence[int], architecture: str | None) -> list[int] | None:
    """The drafter's `eagle_aux_hidden_state_layer_ids` that makes SGLang 0.5.16 capture `hs_ids` on a
    target of this architecture; None when no list can (a DeepSeek-family target whose first id is 1)."""
    hs = [int(i) for i in hs_ids]
    if architecture is None:  # not recorded (shards before it was): the rule depends on the model class
        return None
    if architecture in SGLANG_RAW_UNLESS_ONE:
        return None if hs and hs[0] == 1 else hs
    if any(i < 1 for i in hs):  # +1 classes cannot reach the embeddings
        return None
    return to_layer_output(hs)


def drafter_config(hs_ids: Sequence[int], num_layers: int | None, architecture: str | None) -> dict[str, Any]:
    """Every consumer's value for the stored layers: what to write in a drafter's or trainer's config so
    that it reads (or is fed) exactly these tensors. Recorded in dataset.json and every export."""
    hs = [int(i) for i in hs_ids]
    out = to_layer_output(hs) if all(i >= 1 for i in hs) else None
    sglang = sglang_eagle3_ids(hs, architecture)
    if architecture is None:
        rule, why = "unknown", "the target's architecture is not recorded: its class decides SGLang's rule"
    elif architecture in SGLANG_RAW_UNLESS_ONE:
        rule = "ids as given unless the first is 1 (then +1 each)"
        why = (f"SGLang adds 1 to a list whose first id is 1, so no list in depth order makes {architecture} "
               f"capture {hs}")
    else:
        rule, why = "+1 each", f"{architecture} adds 1 to every id, so it cannot capture {hs}"
    no_output = {} if out is not None else {"note": "hidden_states[0] is the embeddings, no decoder layer's output"}
    no_sglang = {"note": why} if sglang is None else {}
    return {
        "stored": {"convention": STORED, "aux_layers": hs, "meaning": describe(hs) if hs else "none"},
        "vllm": {"eagle_aux_hidden_state_layer_ids": hs},
        "sglang_0.5.16": {
            "eagle_aux_hidden_state_layer_ids": sglang,
            "target_architecture": architecture,
            "rule": rule,
            **no_sglang,
        },
        "sglang_dflash": {"target_layer_ids": out, **no_output},
        # SpecForge 0.2.0: `model.aux_hidden_state_layer_ids` (else the draft config's
        # eagle_aux_hidden_state_layer_ids) goes to SGLang's set_eagle3_layers_to_capture, its only capture
        # backend. Earlier SpecForge: `aux_hidden_states_layers`, whose HF backend hooked the outputs of layers[i]
        # and whose SGLang backend handed the list to SGLang
        "specforge": {
            "0.2.0": {"aux_hidden_state_layer_ids": sglang, **no_sglang},
            "hf_backend": {"aux_hidden_states_layers": out, **no_output},
            "sglang_backend": {"aux_hidden_states_layers": sglang, **no_sglang},
        },
        "speculators_0.4_data_config": {
            "layer_ids": None if out is None else [*out, num_layers - 1 if num_layers else None]
        },
        # speculators 0.4.0 trains on data_config.json's data but writes no ids into the drafter's config.json
        # (eagle_aux_hidden_state_layer_ids null: vLLM then feeds its default 2, L//2, L-3); read in its
        # Eagle3DraftModel.from_training_args and run on CPU by an outside audit
        "speculators_0.4_drafter": {
            "eagle_aux_hidden_state_layer_ids": hs,
            "note": "speculators 0.4.0's trainer leaves this null in the drafter's config.json; set it there",
        },
    }
