"""Layer ids in one stated convention (hsextract.layers): each consumer's ids for the stored layers, exports that
hand them over, and shards written before the convention was recorded, read and inspected with their meaning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import finish_run, make_sample, shard_metadata

from hsextract.dataset import open_dataset
from hsextract.errors import ShardError
from hsextract.layers import describe, drafter_config, sglang_eagle3_ids
from hsextract.shard import ShardReader, ShardWriter
from hsextract.shard.inspect import format_info, shard_info

OLD_SHARD = Path(__file__).parent / "fixtures" / "shards" / "before-layer-convention.hss"
KIMI = "KimiK25ForConditionalGeneration"


def test_each_consumer_gets_its_own_ids_for_kimi_k25() -> None:
    d = drafter_config([2, 30, 58], 61, KIMI)
    assert d["stored"] == {"convention": "hidden_states", "aux_layers": [2, 30, 58],
                           "meaning": "hidden_states[2, 30, 58] = outputs of decoder layers 1, 29, 57"}
    assert d["vllm"] == {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}
    # SGLang 0.5.16's DeepseekV2 (KimiK25 delegates): ids as given unless the first is 1
    assert d["sglang_0.5.16"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert d["sglang_dflash"] == {"target_layer_ids": [1, 29, 57]}
    # SpecForge 0.2.0 hands its ids to SGLang's rule; before it, an HF backend hooked layer outputs and an SGLang
    # backend handed the list to SGLang's rule
    assert d["specforge"] == {"0.2.0": {"aux_hidden_state_layer_ids": [2, 30, 58]},
                              "hf_backend": {"aux_hidden_states_layers": [1, 29, 57]},
                              "sglang_backend": {"aux_hidden_states_layers": [2, 30, 58]}}
    assert d["speculators_0.4_data_config"] == {"layer_ids": [1, 29, 57, 60]}
    assert d["speculators_0.4_drafter"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]  # its trainer writes none


def test_sglangs_rules_per_class() -> None:
    assert sglang_eagle3_ids([2, 16, 29], "LlamaForCausalLM") == [1, 15, 28]  # +1 each
    assert sglang_eagle3_ids([2, 16, 29], "DeepseekV3ForCausalLM") == [2, 16, 29]  # raw
    # a DeepSeek-family target whose first layer is hidden_states[1]: [1, ..] gets +1, [0, ..] stays: none can
    assert sglang_eagle3_ids([1, 5, 7], "DeepseekV3ForCausalLM") is None
    assert sglang_eagle3_ids([0, 5], "LlamaForCausalLM") is None  # +1 never reaches the embeddings
    assert sglang_eagle3_ids([2, 5], None) is None  # the class decides: unknown
    d = drafter_config([1, 5, 7], 10, "DeepseekV3ForCausalLM")
    why = ("SGLang adds 1 to a list whose first id is 1, so no list in depth order makes DeepseekV3ForCausalLM "
           "capture [1, 5, 7]")
    assert d["sglang_0.5.16"]["note"] == why
    assert d["specforge"]["sglang_backend"] == {"aux_hidden_states_layers": None, "note": why}
    assert d["specforge"]["0.2.0"] == {"aux_hidden_state_layer_ids": None, "note": why}
    # the older choice for Kimi (outputs of layers 2, 30, 58): the backends' values differ by one
    assert drafter_config([3, 31, 59], 61, KIMI)["specforge"] == {
        "0.2.0": {"aux_hidden_state_layer_ids": [3, 31, 59]},
        "hf_backend": {"aux_hidden_states_layers": [2, 30, 58]},
        "sglang_backend": {"aux_hidden_states_layers": [3, 31, 59]}}
    # the embeddings are no layer's output
    emb = drafter_config([0, 2], 4, "LlamaForCausalLM")
    note = "hidden_states[0] is the embeddings, no decoder layer's output"
    assert emb["specforge"]["hf_backend"] == {"aux_hidden_states_layers": None, "note": note}
    assert emb["sglang_dflash"] == {"target_layer_ids": None, "note": note}


def _kimi_run(tmp_path: Path) -> Path:
    shards = tmp_path / "run" / "shards"
    shards.mkdir(parents=True)
    meta = shard_metadata(aux_layers=[2, 30, 58], num_hidden_layers=61, architecture=KIMI, final_state="post_norm",
                          layer_convention="hidden_states")
    with ShardWriter(shards / "chunk-00000.hss", meta) as w:
        for k in range(2):
            w.add(*make_sample(5 + k, seed=k), sample_id=f"id{k}")
    return finish_run(tmp_path / "run")


@pytest.mark.parametrize("fmt,consumer,ids", [
    ("speculators-v1", "speculators_0.4_data_config", {"layer_ids": [1, 29, 57, 60]}),
    ("speculators-safetensors", "vllm", {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}),
    ("specforge", "specforge", {"0.2.0": {"aux_hidden_state_layer_ids": [2, 30, 58]},
                                "hf_backend": {"aux_hidden_states_layers": [1, 29, 57]},
                                "sglang_backend": {"aux_hidden_states_layers": [2, 30, 58]}}),
])
def test_every_export_writes_its_consumers_ids_and_the_drafter_config(
        tmp_path: Path, capsys: pytest.CaptureFixture, fmt: str, consumer: str, ids: dict) -> None:
    from hsextract.cli import main

    run = _kimi_run(tmp_path)
    assert main(["export", "--format", fmt, str(run), str(tmp_path / "out")]) == 0
    layers = json.loads((tmp_path / "out" / "layers.json").read_text())
    assert layers == {"format": fmt, "consumer": consumer, **drafter_config([2, 30, 58], 61, KIMI)}
    assert layers[consumer] == ids
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"layers: hidden_states[2, 30, 58] = outputs of decoder layers 1, 29, 57; {consumer}: {ids}"
    assert out[2] == ("drafter config eagle_aux_hidden_state_layer_ids: vLLM [2, 30, 58], SGLang 0.5.16 [2, 30, 58] "
                      f"(all in {tmp_path / 'out'}/layers.json)")
    if fmt == "speculators-v1":
        cfg = json.loads((tmp_path / "out" / "data" / "data_config.json").read_text())
        assert cfg["hidden_states"]["layer_ids"] == [1, 29, 57, 60]


def test_a_shard_written_before_the_convention_reads_with_its_recorded_meaning(tmp_path: Path) -> None:
    r = ShardReader(OLD_SHARD)
    assert "layer_convention" not in r.metadata and r.metadata["aux_layers"] == [1, 5, 7]
    info = shard_info(OLD_SHARD)
    assert info["layers"]["recorded"] == {"aux_layers": [1, 5, 7], "convention": "layer_output",
                                          "convention_recorded": False}
    assert info["layers"]["stored"]["aux_layers"] == [2, 6, 8]
    text = format_info(info).splitlines()
    i = next(k for k, line in enumerate(text) if line.startswith("aux_layers"))
    assert text[i:i + 2] == [
        "aux_layers     [1, 5, 7] (layer_output ids, not recorded: written before hsextract recorded it)",
        "               = hidden_states[2, 6, 8] = outputs of decoder layers 1, 5, 7"]
    assert text[i + 2] == ("drafter config eagle_aux_hidden_state_layer_ids: vLLM [2, 6, 8]; SGLang 0.5.16 the "
                           "target's architecture is not recorded: its class decides SGLang's rule")
    assert text[i + 3] == ("               SpecForge 0.2.0 aux_hidden_state_layer_ids None; earlier SpecForge "
                           "aux_hidden_states_layers: HF backend [1, 5, 7], SGLang backend None")
    # in a dataset: the same layers under their hidden_states ids, the recorded convention kept beside
    (tmp_path / "a").mkdir()
    shutil.copy(OLD_SHARD, tmp_path / "a" / "chunk-00000.hss")
    meta = open_dataset(tmp_path / "a").metadata
    assert (meta["aux_layers"], meta["layer_convention"], meta["recorded_layer_convention"]) == (
        [2, 6, 8], "hidden_states", "layer_output")


def _new_shard(path: Path, aux: list[int]) -> None:
    old = ShardReader(OLD_SHARD).metadata
    meta = {k: old[k] for k in ("model", "engine", "engine_version", "final_state", "hidden_size", "dtype",
                                "config_hash", "tokenizer_hash", "chat_template_hash")}
    with ShardWriter(path, {**meta, "aux_layers": aux, "layer_convention": "hidden_states"}) as w:
        w.add(torch.arange(3), [torch.zeros(3, 8, dtype=torch.bfloat16) + k for k in range(4)],
              torch.ones(3, dtype=torch.int64), sample_id="n")


def test_old_and_new_shards_mix_only_when_they_hold_the_same_layers(tmp_path: Path) -> None:
    same, shifted = tmp_path / "same", tmp_path / "shifted"
    for d, aux in ((same, [2, 6, 8]), (shifted, [1, 5, 7])):
        d.mkdir()
        shutil.copy(OLD_SHARD, d / "chunk-00000.hss")
        _new_shard(d / "chunk-00001.hss", aux)
    assert len(open_dataset(same)) == 3
    with pytest.raises(ShardError) as e:
        open_dataset(shifted)
    assert str(e.value) == (
        f"{shifted}/chunk-00001.hss: holds hidden_states[1, 5, 7] = outputs of decoder layers 0, 4, 6 but "
        f"{shifted}/chunk-00000.hss holds hidden_states[2, 6, 8] = outputs of decoder layers 1, 5, 7; shards of one "
        "dataset must come from the same model and capture settings")


def test_describe_says_both_conventions_and_the_embeddings_in_words() -> None:
    assert describe([2, 30, 58]) == "hidden_states[2, 30, 58] = outputs of decoder layers 1, 29, 57"
    # id 0 is no layer's output ("outputs of decoder layers embeddings, 4, 6" before)
    assert describe([0, 5, 7]) == "hidden_states[0, 5, 7] = the embeddings, outputs of decoder layers 4, 6"
    assert describe([0]) == "hidden_states[0] = the embeddings"
    assert describe([]) == "hidden_states[] = no layer"
