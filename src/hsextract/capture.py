"""Capture presets: which decoder layers a run stores, named by the drafter that reads them.

    eagle3  [2, L//2, L-3]: the default of vLLM's hidden-state extraction and of speculators (and
            SGLang's set_eagle3_layers_to_capture without ids); Kimi-K2.5 (61 layers): [2, 30, 58]
    dflash  5 layers evenly spaced from 1 to L-3, rounded as DFlash's build_target_layer_ids rounds
            (Python round); 61 layers: [1, 15, 30, 44, 58]
    mtp     no aux layer: the final state only (an MTP head reads the last hidden state)
    custom  the explicit `aux_layers` list (1 to 8 ids)

Ids follow the layer convention: id i is the output of decoder layer i. Every preset is followed by the
final state (`final_state`). A preset with an explicit `aux_layers` list too must agree with it: a list
copied from another model's config would otherwise silently capture the wrong layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hsextract.errors import ConfigError

PRESETS = ("eagle3", "dflash", "mtp", "custom")
MAX_AUX_LAYERS = 8
DFLASH_NUM_LAYERS = 5


def eagle3_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def dflash_layers(num_layers: int, n: int = DFLASH_NUM_LAYERS) -> list[int]:
    start, end = 1, num_layers - 3
    return [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]


def preset_layers(preset: str, num_layers: int) -> list[int]:
    """The aux layer ids of a named preset for a model of `num_layers` decoder layers."""
    if preset == "eagle3":
        layers = eagle3_layers(num_layers)
    elif preset == "dflash":
        layers = dflash_layers(num_layers)
    elif preset == "mtp":
        return []
    else:
        raise ConfigError(f"capture: {preset!r} is not a preset; use one of {', '.join(PRESETS)}")
    if len(set(layers)) != len(layers) or min(layers) < 0:
        raise ConfigError(f"capture: {preset} gives {layers} for a model of {num_layers} decoder layers, which "
                          f"repeats a layer; use capture: custom with an explicit aux_layers list")
    return layers


def resolve_aux_layers(config: Mapping[str, Any], num_layers: int) -> list[int]:
    """The run's aux layer ids from `capture` and `aux_layers`; a ConfigError names the key to change."""
    given = config.get("aux_layers")
    # without a `capture` key (a config that did not pass the schema): a list is custom, no list eagle3
    preset = config.get("capture") or ("custom" if given is not None else "eagle3")
    if preset == "custom":
        if not given:
            raise ConfigError("aux_layers: capture: custom needs an explicit list of 1 to "
                              f"{MAX_AUX_LAYERS} layer ids (for the final state alone use capture: mtp)")
        layers = list(given)
    else:
        layers = preset_layers(preset, num_layers)
        if given is not None and list(given) != layers:
            raise ConfigError(
                f"aux_layers: capture: {preset} takes its layers from the model ({layers} for its {num_layers} "
                f"decoder layers), but aux_layers is {list(given)}; set aux_layers: null to use the preset "
                f"(config/config.yaml sets a list for the tiny model), or capture: custom to keep the list")
    if len(layers) > MAX_AUX_LAYERS:
        raise ConfigError(f"aux_layers: {len(layers)} layers; at most {MAX_AUX_LAYERS} aux layers are supported")
    return layers
