"""The final norm recorded in shards: read from the checkpoint, and applied at export to pre_norm data.

Tolerance, MEASURED here (tiny 4-layer DeepseekV3, hidden 128, 20 shipped conversations cut to 300 tokens,
bf16 on the CPU): norm(pre-norm capture) and the post-norm capture of the same forward are bitwise equal
(0 of 682,368 values differ), because FinalNorm.apply computes what transformers' RMSNorm computes, in the
same order. So the export test asserts exact equality. SGLang's fused RMSNorm rounds once (weight multiplied
in float32) where transformers rounds twice; that variant is measured below: at most 1 bf16 ulp apart.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# before the imports below: huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported
os.environ["HF_HUB_OFFLINE"] = "1"

import torch
from conftest import shard_metadata, tiny_checkpoint

from hsextract import open_dataset
from hsextract.engines.base import CaptureSpec, Prompt
from hsextract.engines.transformers_engine import TransformersEngine
from hsextract.errors import ConfigError, ShardError
from hsextract.export import export
from hsextract.extract.final_norm import NORM_KINDS, FinalNorm, final_norm_metadata, read_final_norm
from hsextract.shard import ShardWriter
from hsextract.tinymodel.build import make_tiny_model

CONVERSATIONS = Path(__file__).resolve().parents[1] / "data" / "conversations.jsonl"
AUX = (0, 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", CONVERSATIONS, num_hidden_layers=4, hidden_size=128)


@pytest.fixture(scope="module")
def captures(model_dir: Path) -> dict[str, list[list[torch.Tensor]]]:
    """The same prompts, same batches, captured pre_norm and post_norm: {final_state: [sample tensors]}."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    lines = CONVERSATIONS.read_text(encoding="utf-8").splitlines()[:12]
    prompts = [Prompt(i, f"c{i}", tok.apply_chat_template(json.loads(line)["messages"], return_dict=False)[:200])
               for i, line in enumerate(lines)]
    out = {}
    for fs in ("pre_norm", "post_norm"):
        with TransformersEngine(model_dir, CaptureSpec(AUX, fs), token_budget=1024) as e:
            out[fs] = [c.hidden_states for c in e.extract(prompts)]
    out["ids"] = [torch.tensor(p.input_ids) for p in prompts]
    return out


def test_read_final_norm_is_the_norm_the_model_runs(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    norm = read_final_norm(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    assert norm.kind == "rms_norm" and norm.eps == model.model.norm.variance_epsilon == 1e-6
    assert norm.weight.dtype == torch.bfloat16 and torch.equal(norm.weight, model.model.norm.weight.detach())
    assert norm.source == "model.safetensors:model.norm.weight"
    x = torch.randn(5, 128).to(torch.bfloat16)
    assert torch.equal(norm.apply(x), model.model.norm(x).detach())


def test_metadata_round_trip_is_exact_and_damage_is_named(model_dir: Path) -> None:
    norm = read_final_norm(str(model_dir))
    entry = norm.to_metadata()
    json.dumps(entry)
    back = FinalNorm.from_metadata(json.loads(json.dumps(entry)), "x.hss")
    assert (back.kind, back.eps, back.source) == (norm.kind, norm.eps, norm.source)
    assert torch.equal(back.weight, norm.weight)
    with pytest.raises(ShardError, match=r"^x.hss: final_norm weight holds 127 values, hidden_size says 128$"):
        FinalNorm.from_metadata({**entry, "hidden_size": 128,
                                 "weight": FinalNorm("rms_norm", 1e-6, norm.weight[:127]).to_metadata()["weight"]},
                                "x.hss")
    with pytest.raises(ShardError, match="the final_norm metadata entry is damaged"):
        FinalNorm.from_metadata({**entry, "weight": "not base64!"}, "x.hss")


# Kimi's checkpoints ship custom code (trust_remote_code) around the DeepseekV3 norm: covered by deepseek_v3.
@pytest.mark.parametrize("model_type", sorted(set(NORM_KINDS) - {"kimi_k2", "kimi_k25", "kimi_vl"}))
def test_every_listed_family_norm_is_the_models_own(tmp_path: Path, model_type: str) -> None:
    """For each model_type the table knows: a random-weight checkpoint of that family (transformers' own
    modeling code), its final norm as recorded, applied to bf16 states, equals the model's norm bit for bit,
    and no other kind does."""
    model = tiny_checkpoint(model_type, tmp_path)
    norm = read_final_norm(str(tmp_path))
    assert norm.kind == NORM_KINDS[model_type] and norm.source == "model.safetensors:model.norm.weight"
    x = (torch.randn(16, 64) * 3).to(torch.bfloat16)
    want = model.model.norm(x).detach()
    assert torch.equal(norm.apply(x), want)
    others = {k for k in NORM_KINDS.values() if k != norm.kind}
    assert all(not torch.equal(FinalNorm(k, norm.eps, norm.weight).apply(x), want) for k in others)


def test_unreadable_norm_is_reported_not_guessed(tmp_path: Path, model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))  # a LayerNorm
    entry, why = final_norm_metadata(str(tmp_path))
    assert entry is None and "model_type 'falcon' has no known final-norm formula" in why
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    entry, why = final_norm_metadata(str(tmp_path))
    assert entry is None and why == (f"model {tmp_path}: no safetensors weights found (model.safetensors or its "
                                     "index), so its final norm cannot be recorded")


def test_kimi_style_nested_weight_name_is_found(tmp_path: Path, model_dir: Path) -> None:
    """A multimodal checkpoint (Kimi-K2.5): text config nested, weights under language_model., sharded index."""
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": cfg}))
    w = torch.arange(128, dtype=torch.float32) / 64
    save_file({"language_model.model.norm.weight": w,
               "language_model.model.layers.3.post_attention_layernorm.weight": w + 1}, str(tmp_path / "b.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "language_model.model.norm.weight": "b.safetensors",
        "language_model.model.layers.3.post_attention_layernorm.weight": "b.safetensors"}}))
    norm = read_final_norm(str(tmp_path))
    assert norm.source == "b.safetensors:language_model.model.norm.weight"
    assert torch.equal(norm.weight, w.to(torch.bfloat16))


def test_norm_of_pre_norm_capture_equals_post_norm_capture(captures: dict, model_dir: Path) -> None:
    norm = read_final_norm(str(model_dir))
    for pre, post in zip(captures["pre_norm"], captures["post_norm"], strict=True):
        for a, b in zip(pre[:-1], post[:-1], strict=True):
            assert torch.equal(a, b)  # aux layers do not depend on final_state
        assert not torch.equal(pre[-1], post[-1])
        assert torch.equal(norm.apply(pre[-1]), post[-1])


def test_sglang_style_single_rounding_is_within_one_bf16_ulp(captures: dict, model_dir: Path) -> None:
    """SGLang's RMSNorm: (x32 * rsqrt(mean(x32^2) + eps) * w32).to(bf16). Measured: <= 1 ulp from ours."""
    norm = read_final_norm(str(model_dir))
    worst_ulps = 0.0
    for pre in captures["pre_norm"]:
        x = pre[-1].float()
        sgl = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()).to(torch.bfloat16)
        ours = norm.apply(pre[-1])
        ulp = torch.ldexp(torch.ones_like(sgl.float()), torch.frexp(sgl.float())[1] - 8)  # spacing of bf16 at |sgl|
        worst_ulps = max(worst_ulps, ((ours.float() - sgl.float()).abs() / ulp).max().item())
    assert worst_ulps <= 1.0


def _write_run(path: Path, final_state: str, samples: list[list[torch.Tensor]], ids: list[torch.Tensor],
               norm: dict | None) -> Path:
    path.mkdir(parents=True)
    meta = shard_metadata(final_state=final_state, aux_layers=list(AUX), hidden_size=128, final_norm=norm)
    with ShardWriter(path / "chunk-00000.hss", meta) as w:
        for i, (hs, x) in enumerate(zip(samples, ids, strict=True)):
            w.add(x, hs, torch.ones_like(x), sample_id=f"c{i}")
    return path


def test_pre_norm_exported_to_specforge_equals_post_norm_capture(tmp_path: Path, captures: dict, model_dir: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    entry = read_final_norm(str(model_dir)).to_metadata()
    pre_run = _write_run(tmp_path / "pre", "pre_norm", captures["pre_norm"], captures["ids"], entry)
    summary = export(pre_run, tmp_path / "sf", "specforge")
    assert summary["warning"] is None and summary["final_norm_applied"] is True
    # no final-norm warning; the note that SpecForge 0.2.0's draft model takes 3 aux layers, not these 2
    assert capsys.readouterr().err == f"WARNING: export specforge: {summary['notes'][0]}\n"
    assert summary["notes"][0].startswith(f"{pre_run} holds 2 aux layers")
    for i, post in enumerate(captures["post_norm"]):
        got = torch.load(tmp_path / "sf" / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        assert torch.equal(got["hidden_state"][0], post[-1])  # bitwise: see the module docstring
        assert torch.equal(got["aux_hidden_state"][0], torch.cat(post[:-1], dim=-1))
    # the same pre_norm data to speculators: as captured, and no final-norm warning (the aux layers' note alone)
    summary = export(pre_run, tmp_path / "sp", "speculators-v1")
    assert summary["warning"] is None and summary["final_norm_applied"] is False
    assert capsys.readouterr().err == f"WARNING: export speculators-v1: {summary['notes'][0]}\n"
    got = torch.load(tmp_path / "sp" / "data" / "data_0.pt", weights_only=True)
    assert torch.equal(got["hidden_states"][-1], captures["pre_norm"][0][-1])


def test_pre_norm_without_recorded_norm_still_warns(tmp_path: Path, captures: dict,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(tmp_path / "old", "pre_norm", captures["pre_norm"][:2], captures["ids"][:2], None)
    with pytest.warns(UserWarning, match="do not record the norm"):
        summary = export(run, tmp_path / "sf", "specforge")
    assert summary["final_norm_applied"] is False
    assert "expects final_state=post_norm" in capsys.readouterr().err
    got = torch.load(tmp_path / "sf" / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    assert torch.equal(got["hidden_state"][0], captures["pre_norm"][0][-1])


def test_shards_with_another_final_norm_do_not_mix(tmp_path: Path, captures: dict, model_dir: Path) -> None:
    entry = read_final_norm(str(model_dir)).to_metadata()
    a = _write_run(tmp_path / "a", "pre_norm", captures["pre_norm"][:1], captures["ids"][:1], entry)
    b = _write_run(tmp_path / "b", "pre_norm", captures["pre_norm"][:1], captures["ids"][:1], {**entry, "eps": 1e-5})
    with pytest.raises(ShardError, match=r"b/chunk-00000.hss: final_norm = \{'dtype': 'bfloat16', 'eps': 1e-05,") as e:
        open_dataset([a / "chunk-00000.hss", b / "chunk-00000.hss"])
    assert entry["weight"] not in str(e.value)


def test_mtp_data_refuses_every_export_format(tmp_path: Path, captures: dict) -> None:
    run = tmp_path / "mtp"
    run.mkdir()
    meta = shard_metadata(final_state="pre_norm", aux_layers=[], hidden_size=128)
    with ShardWriter(run / "chunk-00000.hss", meta) as w:
        w.add(captures["ids"][0], [captures["pre_norm"][0][-1]], torch.ones_like(captures["ids"][0]), sample_id="c0")
    assert open_dataset(run)[0]["hidden_states"][0].shape == (len(captures["ids"][0]), 128)
    for fmt in ("speculators-v1", "speculators-safetensors", "specforge"):
        with pytest.raises(ConfigError) as e:
            export(run, tmp_path / fmt, fmt)
        assert str(e.value).startswith(f"export format {fmt}: {run} holds the final state only (capture: mtp, no "
                                       f"aux layers), but {fmt} stores EAGLE-3 training data")
        assert not (tmp_path / fmt).exists()
