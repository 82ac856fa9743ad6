"""TransformersEngine against an independent, unbatched forward of the same model.

Tolerance (relative error ||got - ref|| / ||ref|| per sample and tensor), MEASURED on the
4-layer, hidden-128 tiny model of this file's fixture, 60 shipped conversations cut to 400
tokens, token_budget 2048 (batches of 4-6 with right padding), bf16 on the CPU, against each
sample run alone: aux layers 0..3 at most 2.3e-4, 1.1e-3, 2.0e-3, 3.3e-3; final post-norm
3.7e-3, pre-norm 3.3e-3. A neighbouring (wrong) layer is at least 0.50 away. Bound used
below: 1e-2 (2.7x the worst measured), and a wrong layer must fail it by 20x or more.
(On the default 10-layer model the batched error grows with depth, up to 1e-1 at the
final state, because a bf16 rounding difference can flip an expert's route on a near-tie
and attention spreads it; see the report. The small model here has no such flip.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# before the imports below: huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from conftest import tiny_checkpoint

from hsextract.engines.base import Captured, CaptureSpec, Prompt
from hsextract.engines.transformers_engine import TransformersEngine
from hsextract.errors import ConfigError, EngineError
from hsextract.tinymodel.build import make_tiny_model

CONVERSATIONS = Path(__file__).resolve().parents[1] / "data" / "conversations.jsonl"
NUM_LAYERS = 4
TOL = 1e-2
WRONG_LAYER_MARGIN = 20


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("m") / "tiny", CONVERSATIONS, num_hidden_layers=NUM_LAYERS, hidden_size=128
    )


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[Prompt]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    lines = CONVERSATIONS.read_text(encoding="utf-8").splitlines()[:14]
    out = []
    for i, line in enumerate(lines):
        ids = tok.apply_chat_template(json.loads(line)["messages"], return_dict=False)[:300]
        out.append(Prompt(index=i, sample_id=f"conv-{i}", input_ids=ids))
    return out


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts: list[Prompt]) -> list[list[torch.Tensor]]:
    """Each sample alone, unpadded, straight through transformers: [emb, out0, .., out(n-2), pre, post]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    seen: dict[str, torch.Tensor] = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: seen.__setitem__("pre", o))
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model(torch.tensor([p.input_ids]), output_hidden_states=True, use_cache=False)
            hs = [h[0] for h in out.hidden_states]
            refs.append(hs[:-1] + [seen["pre"][0], hs[-1]])
    hook.remove()
    assert len(refs[0]) == NUM_LAYERS + 2
    return refs


def _ref_layer(ref: list[torch.Tensor], aux: int) -> torch.Tensor:
    # aux ids are hidden_states ids (hsextract.layers): hidden_states[aux], the input of decoder layer aux
    return ref[aux]


def test_batched_padded_matches_each_sample_alone(
    model_dir: Path, prompts: list[Prompt], reference: list[list[torch.Tensor]]
) -> None:
    spec = CaptureSpec(aux_layers=(0, 1, 2, 3), final_state="post_norm")
    seen: list[int] = []
    with TransformersEngine(model_dir, spec, token_budget=1024, on_sample=lambda c: seen.append(c.index)) as eng:
        batches = [len(b) for b in eng._batches(prompts)]
        got = list(eng.extract(prompts))
    assert max(batches) >= 3 and sum(batches) == len(prompts)  # really batched, with mixed lengths
    assert len({len(p.input_ids) for p in prompts}) > 5
    assert [c.index for c in got] == list(range(len(prompts))) == seen
    assert [c.sample_id for c in got] == [p.sample_id for p in prompts]
    worst = [0.0] * 5
    for p, c, ref in zip(prompts, got, reference, strict=True):
        assert len(c.hidden_states) == 5
        for t in c.hidden_states:
            assert t.shape == (len(p.input_ids), 128) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
            assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * 2  # own storage, no padding
        targets = [_ref_layer(ref, i) for i in spec.aux_layers] + [ref[-1]]
        for k, (t, r) in enumerate(zip(c.hidden_states, targets, strict=True)):
            worst[k] = max(worst[k], rel(t, r))
        # a neighbouring (wrong) layer fails the bound by a wide margin
        for k in range(NUM_LAYERS - 1):
            assert rel(c.hidden_states[k], _ref_layer(ref, k + 1)) > WRONG_LAYER_MARGIN * TOL
            assert rel(c.hidden_states[k + 1], _ref_layer(ref, k)) > WRONG_LAYER_MARGIN * TOL
        assert rel(c.hidden_states[-1], ref[-2]) > WRONG_LAYER_MARGIN * TOL  # post-norm is not pre-norm
    # With MLA widths 32+32 the padded attention happens to be bit-exact on this CPU (worst == 0); the
    # wrong-layer assertions above keep the comparison from being vacuous either way.
    assert max(worst) <= TOL, worst


def test_single_sample_is_bit_exact_layer_mapping(
    model_dir: Path, prompts: list[Prompt], reference: list[list[torch.Tensor]]
) -> None:
    # batch of one, no padding: the engine must return exactly transformers' tensors
    spec = CaptureSpec(aux_layers=(2, 0, 3), final_state="pre_norm")
    with TransformersEngine(model_dir, spec, token_budget=1) as eng:
        got = list(eng.extract(prompts[:3]))
    for c, ref in zip(got, reference[:3], strict=True):
        assert torch.equal(c.hidden_states[0], ref[2])  # hidden_states[2]: the output of layer 1
        assert torch.equal(c.hidden_states[1], ref[0])  # hidden_states[0]: the embeddings
        assert torch.equal(c.hidden_states[2], ref[3])  # hidden_states[3]: the output of layer 2
        assert not torch.equal(c.hidden_states[2], ref[-2])  # not the last layer's own output
        assert torch.equal(c.hidden_states[3], ref[-2])  # pre-norm: the last layer's output


def test_pre_norm_vs_post_norm(model_dir: Path, prompts: list[Prompt]) -> None:
    from transformers import AutoModelForCausalLM

    norm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).model.norm
    out = {}
    for fs in ("pre_norm", "post_norm"):
        with TransformersEngine(model_dir, CaptureSpec((1,), fs), token_budget=1024) as eng:
            out[fs] = list(eng.extract(prompts[:6]))
    for pre, post in zip(out["pre_norm"], out["post_norm"], strict=True):
        assert torch.equal(pre.hidden_states[0], post.hidden_states[0])  # aux unaffected
        with torch.no_grad():
            normed = norm(pre.hidden_states[1])
        assert rel(post.hidden_states[1], normed) <= 1e-6  # same batch, same op: exact in practice
        assert rel(post.hidden_states[1], pre.hidden_states[1]) > 0.5  # and they really differ


@pytest.mark.parametrize("aux", [(), (0, 1, 2, 3), (3, 0, 2)], ids=["mtp", "four", "three-unsorted"])
def test_any_number_of_aux_layers_then_the_pre_norm_state(
    model_dir: Path, prompts: list[Prompt], reference: list[list[torch.Tensor]], aux: tuple[int, ...]
) -> None:
    """capture: mtp (no aux) up to every layer of the model; the last tensor is the pre-norm state."""
    with TransformersEngine(model_dir, CaptureSpec(aux, "pre_norm"), token_budget=2048) as eng:
        got = list(eng.extract(prompts[:5]))
    for c, ref in zip(got, reference, strict=False):
        assert len(c.hidden_states) == len(aux) + 1
        for t, i in zip(c.hidden_states, aux, strict=False):
            assert rel(t, _ref_layer(ref, i)) <= TOL
        assert rel(c.hidden_states[-1], ref[-2]) <= TOL  # pre-norm (forward hook on the last layer)
        assert rel(c.hidden_states[-1], ref[-1]) > TOL * WRONG_LAYER_MARGIN  # not the post-norm state


def test_both_final_states_of_one_forward(model_dir: Path, prompts: list[Prompt],
                                         reference: list[list[torch.Tensor]]) -> None:
    """final_state "both" (the fidelity benchmark's diagnostic): aux, then pre-norm, then post-norm."""
    with TransformersEngine(model_dir, CaptureSpec((1,), "both"), token_budget=1024) as eng:
        got = list(eng.extract(prompts[:4]))
    with TransformersEngine(model_dir, CaptureSpec((1,), "pre_norm"), token_budget=1024) as eng:
        pre = list(eng.extract(prompts[:4]))
    for c, p, ref in zip(got, pre, reference, strict=False):
        assert len(c.hidden_states) == 3 and torch.equal(c.hidden_states[1], p.hidden_states[1])
        assert rel(c.hidden_states[2], ref[-1]) <= TOL


def test_more_than_eight_aux_layers_is_a_config_error(tmp_path_factory: pytest.TempPathFactory) -> None:
    deep = make_tiny_model(tmp_path_factory.mktemp("deep") / "m", CONVERSATIONS, num_hidden_layers=10, hidden_size=64)
    with pytest.raises(ConfigError, match=r"^aux_layers: 9 layers; at most 8 are supported.$"):
        TransformersEngine(deep, CaptureSpec(tuple(range(9)), "post_norm"))


def test_extracting_twice_is_bit_identical(model_dir: Path, prompts: list[Prompt]) -> None:
    spec = CaptureSpec((0, 2), "post_norm")
    with TransformersEngine(model_dir, spec, token_budget=900) as eng:
        a = list(eng.extract(prompts[:6]))
        b = list(eng.extract(iter(prompts[:6])))  # also from a one-shot iterator
    for x, y in zip(a, b, strict=True):
        assert all(torch.equal(s, t) for s, t in zip(x.hidden_states, y.hidden_states, strict=True))


def test_aux_beyond_depth_is_a_config_error(model_dir: Path) -> None:
    with pytest.raises(ConfigError) as e:
        TransformersEngine(model_dir, CaptureSpec((1, 2, 4), "post_norm"))
    assert str(e.value) == (
        f"aux_layers: layer id 4 is out of range for {model_dir}, which has 4 decoder layers; "
        "allowed ids are 0..3 (id i = hidden_states[i], the output of decoder layer i-1)."
    )
    with pytest.raises(ConfigError, match=r"aux_layers: layer id -1 is out of range"):
        TransformersEngine(model_dir, CaptureSpec((-1,), "post_norm"))
    with pytest.raises(ConfigError, match=r"aux_layers: \[1, 1\] repeats a layer id"):
        TransformersEngine(model_dir, CaptureSpec((1, 1), "post_norm"))
    with pytest.raises(ConfigError, match=r"final_state: 'normed' is not allowed"):
        TransformersEngine(model_dir, CaptureSpec((1,), "normed"))  # type: ignore[arg-type]


def test_bad_prompts_are_engine_errors(model_dir: Path) -> None:
    with TransformersEngine(model_dir, CaptureSpec((1,), "post_norm")) as eng:
        with pytest.raises(EngineError) as e:
            list(eng.extract([Prompt(0, "ok", [5, 6]), Prompt(1, "empty-one", [])]))
        assert str(e.value) == (
            "sample 'empty-one' (index 1): input_ids is empty; a sample needs at least one token. "
            "Filter empty conversations in prepare."
        )
        with pytest.raises(EngineError, match=r"sample 'big' \(index 0\): token id 999999 is outside"):
            list(eng.extract([Prompt(0, "big", [5, 999999])]))


def test_batching_respects_budget_and_order(model_dir: Path) -> None:
    with TransformersEngine(model_dir, CaptureSpec((1,), "post_norm"), token_budget=100, max_batch=3) as eng:
        lens = [10, 20, 30, 5, 5, 5, 5, 150, 40, 50, 1]
        ps = [Prompt(i, str(i), [9] * n) for i, n in enumerate(lens)]
        batches = [[p.index for p in b] for b in eng._batches(ps)]
        assert batches == [[0, 1, 2], [3, 4, 5], [6], [7], [8, 9], [10]]
        for b in batches:
            assert len(b) == 1 or len(b) * max(lens[i] for i in b) <= 100
        got: list[Captured] = list(eng.extract(ps))
        assert [c.hidden_states[0].shape[0] for c in got] == lens
        assert eng.version().startswith("transformers ") and " / torch " in eng.version()
        assert (eng.num_layers, eng.hidden_size) == (4, 128)


def test_config_errors_for_budget(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^token_budget: 0 must be >= 1"):
        TransformersEngine(model_dir, CaptureSpec((1,), "post_norm"), token_budget=0)
    with pytest.raises(ConfigError, match=r"^dtype: 'int8' is not supported"):
        TransformersEngine(model_dir, CaptureSpec((1,), "post_norm"), dtype="int8")


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "glm4_moe", "minimax_m2", "gpt_oss", "gemma3_text",
                                        "qwen3_next"])
def test_other_families_capture_the_right_layers_and_final_norm(tmp_path: Path, model_type: str) -> None:
    """Families other than the tiny DeepseekV3 (GLM-4.5, MiniMax-M2, gpt-oss: eager attention, it has no sdpa
    path; Gemma-3 and Qwen3-Next: a 1 + weight norm; Qwen3-Next: linear attention layers): one sample, every aux
    layer equals transformers' `hidden_states[i]` bit for bit, the post-norm state its last entry, and the
    final norm as shards record it, applied to the pre-norm state, gives the post-norm state bit for bit."""
    from transformers import AutoModelForCausalLM

    from hsextract.engines.base import BOTH
    from hsextract.extract.final_norm import read_final_norm

    tiny_checkpoint(model_type, tmp_path, num_hidden_layers=4)
    ids = torch.randint(1, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with TransformersEngine(tmp_path, CaptureSpec((0, 2), BOTH)) as e:
        (c,) = list(e.extract([Prompt(0, "a", ids)]))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)(
            torch.tensor([ids]), output_hidden_states=True).hidden_states
    aux0, aux2, pre, post = c.hidden_states
    assert torch.equal(aux0, ref[0][0]) and torch.equal(aux2, ref[2][0]) and torch.equal(post, ref[-1][0])
    assert not torch.equal(aux0, ref[1][0]) and not torch.equal(aux2, ref[3][0]) and not torch.equal(pre, post)
    assert torch.equal(read_final_norm(str(tmp_path)).apply(pre), post)


def test_a_gemma3_wrapper_whose_text_config_names_no_class_is_read_as_its_text_model(tmp_path: Path) -> None:
    """Gemma-3 as saved (`Gemma3ForConditionalGeneration`: text_config without `architectures`, weights under
    `language_model.`): the engine loads its text model by the text config's model_type (it failed at extract,
    after prepare, for want of `model.layers`), and captures exactly the wrapper's own text forward (float32)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    from hsextract.extract.text_model import find_wrapped_text_model

    text = Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=512, num_hidden_layers=4, sliding_window=16,
                            max_position_embeddings=512, pad_token_id=0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    torch.manual_seed(0)
    wrapper = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                          mm_tokens_per_image=4, image_token_index=511,
                                                          boi_token_index=509, eoi_token_index=510)).eval()
    with torch.no_grad():
        wrapper.model.language_model.norm.weight.copy_(torch.randn(64) * 0.3)
    wrapper.save_pretrained(tmp_path / "gemma3")
    saved = json.loads((tmp_path / "gemma3" / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3ForConditionalGeneration"] and "architectures" not in saved["text_config"]
    w = find_wrapped_text_model(str(tmp_path / "gemma3"))
    assert (w.wrapper, w.architecture, w.prefix) == ("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM",
                                                     "language_model.")
    # a wrapper transformers' AutoModelForCausalLM itself loads as its text model (Llama-4: "llama4" ->
    # Llama4ForCausalLM, with the quantization_config the wrapper path would drop) is left to it
    llama4 = tmp_path / "llama4"
    llama4.mkdir()
    (llama4 / "config.json").write_text(json.dumps({
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
        "text_config": {"model_type": "llama4_text", "hidden_size": 64, "num_hidden_layers": 2},
        "quantization_config": {"quant_method": "fbgemm_fp8"}}))
    assert find_wrapped_text_model(str(llama4)) is None
    ids = torch.randint(1, 500, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = wrapper(input_ids=ids, output_hidden_states=True).hidden_states
    spec = CaptureSpec(aux_layers=(1, 2, 3), final_state="post_norm")
    with TransformersEngine(str(tmp_path / "gemma3"), spec, token_budget=64, dtype="float32") as eng:
        (got,) = eng.extract([Prompt(index=0, sample_id="g", input_ids=ids[0].tolist())])
    for k, layer in enumerate((1, 2, 3, 4)):
        assert rel(got.hidden_states[k], ref[layer][0]) < 1e-5, layer
    assert rel(got.hidden_states[2], ref[2][0]) > 0.1  # a neighbouring layer is far off
