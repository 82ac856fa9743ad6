"""Capture presets: which decoder layers a run stores, named by the drafter that reads them.

Ids are hidden_states indices (hsextract.layers): id i is transformers `hidden_states[i]`, the input of
decoder layer i, i.e. the output of layer i-1. For a model of L decoder layers:

    eagle3  [2, L//2, L-3]: what EAGLE-3's reference code, vLLM and SGLang (set_eagle3_layers_to_capture
            without ids) feed an EAGLE-3 drafter; Kimi-K2.5 (61 layers): [2, 30, 58], the outputs of
            layers 1, 29, 57
    dflash  what SGLang's DFlash feeds a 5-layer drafter: the outputs of build_target_layer_ids(L, 5)
            (evenly spaced from 1 to L-3, Python round), so hidden_states [2, .., L-2]; 61 layers:
            [2, 16, 31, 45, 59]
    mtp     no aux layer: the final state only (an MTP head reads the last hidden state)
    custom  the explicit `aux_layers` list (1 to 8 ids)

An explicit `aux_layers` list must say its convention (`aux_layers_convention`): hsextract's ids meant
layer outputs before this was recorded, so a list is never silently read one way or the other. Every
preset is followed by the final state (`final_state`). A preset with an explicit list too must agree
with it: a list copied from another model's config would otherwise silently capture the wrong layers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hsextract.errors import ConfigError
from hsextract.layers import CONVENTIONS, HIDDEN_STATES, LAYER_OUTPUT, describe, to_hidden_states

PRESETS = ("eagle3", "dflash", "mtp", "custom")
MAX_AUX_LAYERS = 8
DFLASH_NUM_LAYERS = 5


def eagle3_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def dflash_layers(num_layers: int, n: int = DFLASH_NUM_LAYERS) -> list[int]:
    # DFlash names layers by their output (SGLang's set_dflash_layers_to_capture adds 1): hidden_states is +1
    start, end = 1, num_layers - 3
    return [round(start + i * (end - start) / (n - 1)) + 1 for i in range(n)]


def preset_count(preset: str) -> int | None:
    """How many aux layers a preset stores, known without the model's depth (None: custom, the list's)."""
    return {"eagle3": 3, "dflash": DFLASH_NUM_LAYERS, "mtp": 0}.get(preset)


def check_count(preset: str, given: list[int]) -> None:
    """An explicit list beside a preset of another length is refused without the model's depth (a hub id): the
    check against the preset's very layers needs config.json (resolve_aux_layers)."""
    n = preset_count(preset)
    if n is not None and len(given) != n:
        raise ConfigError(f"aux_layers: capture: {preset} takes {n} layers from the model, but aux_layers lists "
                          f"{len(given)} ({describe(given)}); set aux_layers: null to use the preset, or capture: "
                          "custom to keep the list")


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
    if (problem := _misordered(layers)) or min(layers) < 1:
        raise ConfigError(f"capture: {preset} gives {layers} for a model of {num_layers} decoder layers, which "
                          f"{problem or 'names the embeddings (hidden_states[0]) or none'}; use capture: custom "
                          "with an explicit aux_layers list")
    return layers


def _misordered(layers: list[int]) -> str | None:
    """Why a list of ids is not distinct layers in depth order, the order in which SGLang and vLLM capture (a
    loop over the layers) and so feed a drafter them; None if it is."""
    if len(set(layers)) != len(layers):
        return "repeats a layer"
    if layers != sorted(layers):
        return f"is not in depth order ({sorted(layers)})"
    return None


def explicit_layers(config: Mapping[str, Any]) -> list[int] | None:
    """The explicit `aux_layers` list as hidden_states ids (None without a list); its convention must be said."""
    given = config.get("aux_layers")
    if given is None:
        return None
    convention = config.get("aux_layers_convention")
    if convention not in CONVENTIONS:
        raise _unsaid([int(i) for i in given])
    return to_hidden_states(given, convention)


def _unsaid(ids: list[int], where: str = "", note: str = "") -> ConfigError:
    return ConfigError(
        f"aux_layers: {ids}{where} does not say which layers it means; add aux_layers_convention: "
        f"{HIDDEN_STATES} (id i = transformers hidden_states[i]: {describe(ids)}; what vLLM, SGLang and "
        f"EAGLE-3 drafter configs use) or aux_layers_convention: {LAYER_OUTPUT} (id i = the output of "
        f"decoder layer i: {describe(to_hidden_states(ids, LAYER_OUTPUT))}; hsextract's meaning before it "
        f"was recorded), or set aux_layers: null to take the `capture` preset's layers{note}")


def check_conventions_said(layers: Iterable[tuple[str, Any]]) -> None:
    """Each config layer (a `--configfile` file or `--config`: name, mapping, in the order they apply) that gives an
    `aux_layers` list says its convention itself, and no later layer changes it: one inherited from another file
    (config/kimi.yaml says hidden_states for its own list) would silently reinterpret a list written before the
    convention was recorded, and one set after a file's list would silently move that list's layers."""
    listed: tuple[str, list[int], str] | None = None  # the list in effect: its layer's name, ids, convention
    for name, layer in layers:
        if not isinstance(layer, Mapping):
            continue
        if "aux_layers" in layer:
            listed = None
            ids = layer["aux_layers"]
            # a list of anything but ids (`--config aux_layers=[1,2]` gives strings) is the schema check's to refuse
            if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                if layer.get("aux_layers_convention") not in CONVENTIONS:
                    raise _unsaid(ids, f" in {name}", f"; in {name} itself: a convention set by another file is not "
                                                      "taken for this file's list")
                listed = (name, ids, layer["aux_layers_convention"])
        elif listed and layer.get("aux_layers_convention") in CONVENTIONS \
                and layer["aux_layers_convention"] != listed[2]:
            where, ids, said = listed
            raise ConfigError(
                f"aux_layers_convention: {layer['aux_layers_convention']} in {name} would change what aux_layers "
                f"{ids} in {where} means, said there as {said} ({describe(to_hidden_states(ids, said))}): a "
                f"convention applies to the list of its own file; give the list and its convention together in "
                f"{name}, or remove aux_layers_convention from it")


def resolve_aux_layers(config: Mapping[str, Any], num_layers: int) -> list[int]:
    """The run's aux layers as hidden_states ids, from `capture`, `aux_layers` and its convention; a
    ConfigError names the key to change."""
    given = explicit_layers(config)
    # without a `capture` key (a config that did not pass the schema): a list is custom, no list eagle3
    preset = config.get("capture") or ("custom" if given is not None else "eagle3")
    if preset == "custom":
        if not given:
            raise ConfigError("aux_layers: capture: custom needs an explicit list of 1 to "
                              f"{MAX_AUX_LAYERS} layer ids (for the final state alone use capture: mtp)")
        layers = given
        if problem := _misordered(layers):
            raise ConfigError(f"aux_layers: {describe(layers)} {problem}: SGLang and vLLM feed a drafter its layers "
                              "in depth order, and the stored tensors follow the list; list the ids increasing")
    else:
        layers = preset_layers(preset, num_layers)
        if given is not None and given != layers:
            raise ConfigError(
                f"aux_layers: capture: {preset} takes its layers from the model ({describe(layers)} for its "
                f"{num_layers} decoder layers), but aux_layers is {describe(given)}; set aux_layers: null to use "
                f"the preset, or capture: custom to keep the list")
    if len(layers) > MAX_AUX_LAYERS:
        raise ConfigError(f"aux_layers: {len(layers)} layers; at most {MAX_AUX_LAYERS} aux layers are supported")
    return layers
