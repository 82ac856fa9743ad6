"""Capture presets (hsextract.capture) and their resolution in the parse-time config check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_config import ROOT, write_model, write_reference

from hsextract.capture import dflash_layers, eagle3_layers, preset_layers, resolve_aux_layers
from hsextract.config import check
from hsextract.errors import ConfigError


def test_preset_layers_for_kimi_and_the_tiny_model() -> None:
    assert eagle3_layers(61) == [2, 30, 58]  # vLLM / speculators default, NVIDIA's Kimi-K2.5 recipe
    assert dflash_layers(61) == [1, 15, 30, 44, 58]
    assert dflash_layers(10) == [1, 2, 4, 6, 7]
    assert eagle3_layers(10) == [2, 5, 7]
    assert preset_layers("mtp", 61) == []


def test_presets_that_repeat_a_layer_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^capture: eagle3 gives \[2, 3, 3\] for a model of 6 decoder layers"):
        preset_layers("eagle3", 6)
    with pytest.raises(ConfigError, match="capture: dflash gives"):
        preset_layers("dflash", 6)


def test_resolution_rules() -> None:
    assert resolve_aux_layers({"capture": "eagle3", "aux_layers": None}, 61) == [2, 30, 58]
    assert resolve_aux_layers({"capture": "eagle3", "aux_layers": [2, 30, 58]}, 61) == [2, 30, 58]
    assert resolve_aux_layers({"capture": "custom", "aux_layers": [3, 1]}, 61) == [3, 1]
    assert resolve_aux_layers({"capture": "mtp", "aux_layers": None}, 61) == []
    assert resolve_aux_layers({"aux_layers": [4]}, 61) == [4]  # no capture key: a list is custom
    with pytest.raises(ConfigError) as e:
        resolve_aux_layers({"capture": "eagle3", "aux_layers": [1, 5, 7]}, 61)
    assert str(e.value) == (
        "aux_layers: capture: eagle3 takes its layers from the model ([2, 30, 58] for its 61 decoder layers), but "
        "aux_layers is [1, 5, 7]; set aux_layers: null to use the preset (config/config.yaml sets a list for the "
        "tiny model), or capture: custom to keep the list")
    with pytest.raises(ConfigError, match=r"^aux_layers: capture: custom needs an explicit list of 1 to 8"):
        resolve_aux_layers({"capture": "custom", "aux_layers": []}, 61)
    with pytest.raises(ConfigError, match=r"^aux_layers: 9 layers; at most 8 aux layers are supported$"):
        resolve_aux_layers({"capture": "custom", "aux_layers": list(range(9))}, 61)


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.chdir(tmp_path)
    write_model(tmp_path / "m", layers=12)
    (tmp_path / "conv.jsonl").write_text(json.dumps(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
    c = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    c.update(model="m", make_tiny_model=False, reference_sample="ref.pt")
    c["sources"] = [{"path": "conv.jsonl", "format": "messages", "weight": 1.0, "max_records": None}]
    return c


@pytest.mark.parametrize("preset,layers", [("eagle3", [2, 6, 9]), ("dflash", [1, 3, 5, 7, 9]), ("mtp", [])])
def test_check_plans_the_preset_layers(cfg: dict, tmp_path: Path, preset: str, layers: list[int]) -> None:
    write_reference(tmp_path / "ref.pt", n_tensors=len(layers) + 1)
    cfg.update(capture=preset, aux_layers=None)
    assert check(cfg).aux_layers == layers


def test_check_names_the_preset_when_the_reference_has_another_count(cfg: dict, tmp_path: Path) -> None:
    write_reference(tmp_path / "ref.pt", n_tensors=4)
    cfg.update(capture="dflash", aux_layers=None)
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert str(e.value) == (
        "reference_sample: ref.pt holds 4 hidden-state tensors, but aux_layers [1, 3, 5, 7, 9] (capture: dflash) "
        "has 5 layers, so shards hold 6 (aux layers + final state); use a reference sample with 6 tensors or "
        "change aux_layers")


def test_default_config_keeps_its_list(cfg: dict, tmp_path: Path) -> None:
    write_reference(tmp_path / "ref.pt")
    assert cfg["capture"] == "custom" and check(cfg).aux_layers == [1, 5, 7]
