"""Shared prefixes in the transformers engine (docs/SHARED_PREFIX.md): a prompt with a parent computes only its
positions from prefix_len on, on its parent's keys and values, and those rows equal an independent full forward
of the whole prompt within the dense bound.

Tolerance, MEASURED: on the 4-layer, hidden-128 tiny model of the fixture below (bf16, CPU) the rows a child
computes on its parent's cut cache are bit-identical to the same rows of its own full forward (worst 0.0), as the
padded batches of tests/test_transformers_engine.py are on it. On the default 10-layer model (hidden_states
[2, 5, 7], prompts of 210-500 tokens, prefixes of 60-400): up to 1.7e-3 at hidden_states[2], 3.4e-2 at [5], 4.4e-2
at the final states, where today's padded batch of the same prompts gave up to 7.4e-3 and that model's batched
error reaches 1e-1 (routing flips, tests/test_transformers_engine.py); in float32 the same comparison gives at
most 3.6e-7, so the difference is bf16 rounding of a differently split attention, amplified by the routers, and
no misplaced row. Bound here: 1e-2, as in tests/test_transformers_engine.py; a neighbouring (wrong) layer fails it
by 20x or more, and a suffix run without the parent's keys and values fails it too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# the 4-layer, hidden-128 tiny model, its bound and the relative error of tests/test_transformers_engine.py
from test_transformers_engine import CONVERSATIONS, NUM_LAYERS, TOL, WRONG_LAYER_MARGIN, rel

from hsextract.engines.base import BOTH, CaptureSpec, Prompt
from hsextract.engines.transformers_engine import TransformersEngine
from hsextract.errors import EngineError
from hsextract.tinymodel.build import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", CONVERSATIONS, num_hidden_layers=NUM_LAYERS,
                           hidden_size=128)


@pytest.fixture(scope="module")
def family(model_dir: Path) -> list[Prompt]:
    """A conversation's turns and a shared opening: 0 a root; 1 its next turn (on 0); 2 the turn after (on 1,
    taking rows from 1's own and from 0 through it); 3 a sibling of 1 on a short prefix of 0; 4 outside any
    family; 5 on 2 with a prefix shorter than 2's own start (its rows come from 0 and 1, none from 2)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    convs = [tok.apply_chat_template(json.loads(line)["messages"], return_dict=False)
             for line in CONVERSATIONS.read_text(encoding="utf-8").splitlines()[:6]]
    a = convs[0][:160]
    b = a[:120] + convs[1][:90]
    c = b[:170] + convs[2][:60]
    d = a[:40] + convs[3][:70]
    e = convs[4][:100]
    f = c[:150] + convs[5][:50]
    refs = [(-1, 0), (0, 120), (1, 170), (0, 40), (-1, 0), (2, 150)]
    return [Prompt(i, f"s{i}", ids, parent=par, prefix_len=k)
            for i, (ids, (par, k)) in enumerate(zip([a, b, c, d, e, f], refs, strict=True))]


def full_forward(model_dir: Path, prompts: list[Prompt]) -> list[list[torch.Tensor]]:
    """Each prompt alone, whole, straight through transformers: [hidden_states[0..L-1], pre-norm, post-norm]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    seen: dict[str, torch.Tensor] = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: seen.__setitem__("pre", o))
    out = []
    with torch.no_grad():
        for p in prompts:
            hs = model(torch.tensor([p.input_ids]), output_hidden_states=True, use_cache=False).hidden_states
            out.append([h[0] for h in hs[:-1]] + [seen["pre"][0], hs[-1][0]])
    hook.remove()
    return out


def test_a_child_computes_only_its_suffix_and_matches_a_full_forward(model_dir: Path, family: list[Prompt]) -> None:
    """Every aux layer and both final states (one forward: final_state "both"); the rows a child would get without
    its parent's keys and values (its suffix alone, at the same positions) fail the bound by a wide margin, so the
    cache is what makes them right."""
    ref = full_forward(model_dir, family)
    spec = CaptureSpec((0, 1, 2, 3), BOTH)
    seen: list[int] = []
    with TransformersEngine(model_dir, spec, token_budget=1024, on_sample=lambda c: seen.append(c.start)) as eng:
        got = list(eng.extract(family))
        alone = list(eng.extract([Prompt(0, "alone", family[2].input_ids[170:])]))[0]
    assert [c.index for c in got] == list(range(len(family))) and seen[:-1] == [p.prefix_len for p in family]
    worst = 0.0
    for p, c, r in zip(family, got, ref, strict=True):
        k = p.prefix_len
        assert c.start == k and c.sample_id == p.sample_id
        for t, want in zip(c.hidden_states, [r[i] for i in spec.aux_layers] + [r[-2], r[-1]], strict=True):
            assert t.shape == (len(p.input_ids) - k, 128) and t.is_contiguous() and t.dtype == torch.bfloat16
            worst = max(worst, rel(t, want[k:]))
        for j in range(NUM_LAYERS - 1):  # a neighbouring layer fails the bound by a wide margin
            assert rel(c.hidden_states[j], r[j + 1][k:]) > WRONG_LAYER_MARGIN * TOL
    assert worst <= TOL, worst
    assert rel(alone.hidden_states[-1], ref[2][-1][170:]) > WRONG_LAYER_MARGIN * TOL
    print(f"worst relative error of suffix rows against a full forward: {worst:.2e}")


def test_the_engine_refuses_references_it_cannot_use(model_dir: Path, family: list[Prompt]) -> None:
    a, b = family[0], family[1]
    cases = {
        "parent 5 is not an earlier prompt of this chunk": [a, Prompt(1, "x", b.input_ids, parent=5, prefix_len=9)],
        "prefix_len 0 outside [1, 160]": [a, Prompt(1, "x", b.input_ids, parent=0, prefix_len=0)],
        "prefix_len 161 outside": [a, Prompt(1, "x", b.input_ids, parent=0, prefix_len=161)],
        "its first 130 token ids differ from its parent 's0''s": [a, Prompt(1, "x", b.input_ids, parent=0,
                                                                            prefix_len=130)],
    }
    with TransformersEngine(model_dir, CaptureSpec((1,), "post_norm")) as eng:
        for message, prompts in cases.items():
            with pytest.raises(EngineError) as e:
                list(eng.extract(prompts))
            assert str(e.value).startswith("sample 'x' (index 1): ") and message in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("cache_tokens", "starts", "peak"),
    [
        # the family's caches: 0 (160 positions) until 3, 1 (210) until 2, 2 (230) until 5; at most 390 at once
        (None, [0, 120, 170, 40, 0, 150], 390),
        # 0 and 1 exceed 300: 0, whose child comes later, goes; 3 then runs in full
        (300, [0, 120, 170, 0, 0, 150], 230),
        # 200: only 0 fits, and goes when 1 is kept beside it; 1 and 2 do not fit alone: only 1 is computed on a cache
        (200, [0, 120, 0, 0, 0, 0], 160),
        (0, [0, 0, 0, 0, 0, 0], 0),
    ],
)
def test_kept_caches_stay_within_the_budget(model_dir: Path, family: list[Prompt], cache_tokens: int | None,
                                            starts: list[int], peak: int) -> None:
    """The parents' caches kept at once hold at most `cache_tokens` positions (default: 1 GiB's worth); a child
    whose parent's cache was dropped is computed in full (start 0), and every sample's rows still match a full
    forward within the bound."""
    ref = full_forward(model_dir, family)
    with TransformersEngine(model_dir, CaptureSpec((1, 3), "post_norm"), token_budget=1024,
                            cache_tokens=cache_tokens) as eng:
        assert eng.cache_tokens == (4 * 1024 if cache_tokens is None else cache_tokens)
        got = list(eng.extract(family))
        # by default, raised to 1 GiB of this model's keys and values once the first cache is kept: a position
        # holds 4 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes (DeepseekV3 caches MLA's latent)
        assert eng.cache_tokens == (2**30 // (4 * (512 + 64) * 2) if cache_tokens is None else cache_tokens)
        assert eng.peak_cached_tokens == peak
    assert [c.start for c in got] == starts
    for p, c, r in zip(family, got, ref, strict=True):
        for t, want in zip(c.hidden_states, [r[1], r[3], r[-1]], strict=True):
            assert t.shape == (len(p.input_ids) - c.start, 128)
            assert rel(t, want[c.start:]) <= TOL


def test_a_chunk_says_which_samples_lost_their_parents_cache(model_dir: Path, family: list[Prompt], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """At 200 positions 2, 3 and 5 lose their parent's cache (above): the chunk's summary and a warning say so, the
    tokens computed against those prepare planned; the shard records the references used."""
    from conftest import shard_metadata

    from hsextract.extract.run import ChunkPrompts, extract_chunk
    from hsextract.shard import ShardReader

    chunk = ChunkPrompts([p.sample_id for p in family], [p.input_ids for p in family],
                         [[1] * len(p.input_ids) for p in family], [p.parent for p in family],
                         [p.prefix_len for p in family])
    meta = shard_metadata(engine="transformers", aux_layers=[1, 3], hidden_size=128, final_state="post_norm")
    with TransformersEngine(model_dir, CaptureSpec((1, 3), "post_norm"), token_budget=1024, cache_tokens=200) as eng:
        out = extract_chunk(chunk, tmp_path / "c.hss", eng, meta, progress=False)
    tokens = sum(len(p.input_ids) for p in family)
    assert (out["computed_tokens"], out["planned_computed_tokens"], out["lost_prefixes"], out["shortened_prefixes"]) \
        == (tokens - 120, tokens - 120 - 170 - 40 - 150, 3, 0)
    assert capsys.readouterr().err.endswith(
        f"WARNING: c.hss: of 4 samples that share a prefix, 3 were computed whole and 0 from inside their prefix "
        f"({tokens - 120:,} tokens computed and stored where prepare planned {tokens - 480:,}): the transformers "
        "engine keeps parents' keys and values for 200 positions at most and drops those whose next child comes "
        "last: families that interleave in a chunk, or long parents, lose theirs\n")
    with TransformersEngine(model_dir, CaptureSpec((1,), "post_norm"), token_budget=50) as eng:
        assert "for 200 positions at most (1 GiB of this model's keys and values, or 4 x transformers.token_budget " \
            "if more) and drops" in eng.lost_prefixes()
    r = ShardReader(tmp_path / "c.hss")
    assert (r.parents, r.prefix_lens) == ([-1, 0, -1, -1, -1, -1], [0, 120, 0, 0, 0, 0])


@pytest.mark.parametrize(("model_type", "config", "layers"), [
    ("llama", {}, None),  # full attention: the child runs on the parent's cut cache
    ("gemma3_text", {"sliding_window": 16}, "DynamicSlidingWindowLayer"),  # keeps the last 16 positions alone
    ("qwen3_next", {}, "LinearAttentionLayer"),  # a recurrent state, no per-position keys
])
def test_a_cache_that_cannot_be_cut_to_a_prefix_runs_the_child_in_full(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], model_type: str, config: dict[str, int],
        layers: str | None) -> None:
    """A sliding-window or linear-attention cache cut as a full one gave a child rows 0.2-1.3 off a full forward
    (sliding windows), or an AttributeError (linear attention): such a model's children run in full and are stored
    whole (start 0), said once; every child's rows equal its own forward alone."""
    from conftest import tiny_checkpoint

    tiny_checkpoint(model_type, tmp_path, num_hidden_layers=4, **config)  # Qwen3-Next: 3 linear, 1 full
    g = torch.Generator().manual_seed(3)
    parent = torch.randint(5, 300, (100,), generator=g).tolist()
    child = parent[:70] + torch.randint(5, 300, (30,), generator=g).tolist()
    with TransformersEngine(tmp_path, CaptureSpec((1,), "post_norm")) as eng:
        (alone,) = list(eng.extract([Prompt(0, "c", child)]))
        _, got = list(eng.extract([Prompt(0, "p", parent), Prompt(1, "c", child, parent=0, prefix_len=70)]))
    note = capsys.readouterr().out
    assert got.start == (70 if layers is None else 0)
    for t, want in zip(got.hidden_states, alone.hidden_states, strict=True):
        assert rel(t, want[got.start:]) <= TOL
    if layers is None:
        assert "NOTE" not in note
    else:
        assert note == (f"NOTE: {tmp_path}: its cache holds {layers} layers, which cannot be cut to a prefix; samples "
                        "that share a prefix are computed in full and stored whole (share_prefixes saves nothing "
                        "with this engine on this model)\n")


def test_a_long_prompt_runs_in_pieces_on_its_own_keys_and_values(model_dir: Path, family: list[Prompt],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ONE_FORWARD_TOKENS a prompt runs in pieces, each on the keys and values of the positions before it
    (attention holds piece x length scores, not length squared): a root alone and a child's long suffix, each
    within the bound of a full forward; the pieces are what ran (5 forwards of 32 for 160 tokens, 2 for 60)."""
    from hsextract.engines import transformers_engine

    monkeypatch.setattr(transformers_engine, "ONE_FORWARD_TOKENS", 32)
    ref = full_forward(model_dir, family)
    spec = CaptureSpec((0, 1, 2, 3), BOTH)
    prompts = [family[0], family[1], family[2]]  # 160 alone; 210 on 120 of 0 (90 own); 230 on 170 of 1 (60 own)
    with TransformersEngine(model_dir, spec, token_budget=16) as eng:
        forward, calls = eng._backbone, []
        eng._backbone = lambda **kw: calls.append(kw["input_ids"].shape[1]) or forward(**kw)
        got = list(eng.extract(prompts))
    assert calls == [32] * 5 + [32, 32, 26] + [32, 28]
    assert [c.start for c in got] == [0, 120, 170] and eng.no_pieces is None
    for p, c, r in zip(prompts, got, ref[:3], strict=True):
        for t, want in zip(c.hidden_states, [r[i] for i in spec.aux_layers] + [r[-2], r[-1]], strict=True):
            assert t.shape == (len(p.input_ids) - c.start, 128) and t.is_contiguous()
            assert rel(t, want[c.start:]) <= TOL
        assert rel(c.hidden_states[0], r[1][c.start:]) > WRONG_LAYER_MARGIN * TOL  # a neighbouring layer fails


def test_a_cache_that_cannot_hold_every_position_runs_a_long_prompt_in_one_forward(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A sliding-window cache keeps the last window's positions alone, so no piece could see the rest: the prompt
    runs in one forward (the model's reason recorded), its rows those of the same forward without pieces."""
    from conftest import tiny_checkpoint

    from hsextract.engines import transformers_engine

    tiny_checkpoint("gemma3_text", tmp_path, num_hidden_layers=4, sliding_window=16)
    ids = torch.randint(5, 300, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    with TransformersEngine(tmp_path, CaptureSpec((1,), "post_norm")) as eng:
        (whole,) = list(eng.extract([Prompt(0, "p", ids)]))
    monkeypatch.setattr(transformers_engine, "ONE_FORWARD_TOKENS", 32)
    with TransformersEngine(tmp_path, CaptureSpec((1,), "post_norm"), token_budget=16) as eng:
        (got,) = list(eng.extract([Prompt(0, "p", ids)]))
    why = "its cache holds DynamicSlidingWindowLayer layers, which cannot be cut to a prefix"
    assert eng.no_pieces == why
    assert capsys.readouterr().out == (f"NOTE: {tmp_path}: {why}; samples longer than 32 tokens run in one forward, "
                                       "whose attention memory grows with the square of their length\n")
    assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, whole.hidden_states, strict=True))


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {
    "rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1.0] * 8,
    "long_factor": [1.5] * 8}])
def test_a_rope_set_by_the_forwards_length_gives_each_sample_its_own_forwards_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], rope: dict) -> None:
    """transformers sets dynamic NTK's and longrope's frequencies from a forward's largest position (dynamic keeps a
    longer forward's until one within max_position_embeddings): pieces, batch-mates, a parent's cache and the
    forward before each changed a sample's values (audit: pieces 1.7e-3 from one forward in float32). Every sample
    equals a fresh model's forward of it alone, in float32 to the last bits' noise; a child over the limit runs in
    full (start 0), one within it on its parent's cache."""
    from conftest import tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from hsextract.engines import transformers_engine

    tiny_checkpoint("llama", tmp_path, num_hidden_layers=4, max_position_embeddings=64,
                    rope_parameters={"rope_theta": 10000.0, **rope})
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (150, 20, 100, 80, 30, 40)]
    ids.append(ids[5] + ids[0][:10])  # within the limit: on 5's cache
    ids.append(ids[6] + ids[0][:40])  # over it: in full
    ids.append(ids[0][:30] + ids[1])  # within it, on a parent over it (keys at the long frequencies): in full
    prompts = [Prompt(i, f"s{i}", x) for i, x in enumerate(ids[:6])] + [
        Prompt(6, "s6", ids[6], parent=5, prefix_len=40), Prompt(7, "s7", ids[7], parent=6, prefix_len=50),
        Prompt(8, "s8", ids[8], parent=0, prefix_len=30)]
    want = []
    for x in ids:  # a fresh model each: no forward before it
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        with torch.no_grad():
            out = model.model(torch.tensor([x]), output_hidden_states=True, use_cache=False)
        want.append([out.hidden_states[1][0], out.last_hidden_state[0]])
    monkeypatch.setattr(transformers_engine, "ONE_FORWARD_TOKENS", 32)
    with TransformersEngine(tmp_path, CaptureSpec((1,), "post_norm"), dtype="float32", token_budget=400) as eng:
        got = list(eng.extract(prompts))
    assert capsys.readouterr().out == (
        f"NOTE: {tmp_path}: its rope_type {rope['rope_type']!r} sets the rotary frequencies from a forward's length: "
        "samples over 64 tokens run alone and in one forward, without a parent's cache\n")
    assert [c.start for c in got] == [0, 0, 0, 0, 0, 0, 40, 0, 0]
    for c, w in zip(got, want, strict=True):
        assert max(rel(t, r[c.start:]) for t, r in zip(c.hidden_states, w, strict=True)) < 1e-5, c.sample_id


def test_a_rope_set_by_length_per_layer_type_is_restored_for_each_type(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3 keeps one set of frequencies per layer type (`full_attention_inv_freq`, ...): dynamic rope on its
    full-attention layers alone, each set back to the loaded one before each forward (the engine read a single
    `inv_freq` and failed to load such a model: review)."""
    from conftest import tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from hsextract.engines import transformers_engine

    tiny_checkpoint("gemma3_text", tmp_path, num_hidden_layers=4, sliding_window=16, max_position_embeddings=64,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    g = torch.Generator().manual_seed(6)
    ids = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (150, 20, 100, 80, 30)]
    want = []
    for x in ids:
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        with torch.no_grad():
            want.append(model.model(torch.tensor([x]), output_hidden_states=True, use_cache=False).last_hidden_state[0])
    monkeypatch.setattr(transformers_engine, "ONE_FORWARD_TOKENS", 32)
    with TransformersEngine(tmp_path, CaptureSpec((1,), "post_norm"), dtype="float32", token_budget=400) as eng:
        got = list(eng.extract([Prompt(i, f"s{i}", x) for i, x in enumerate(ids)]))
    assert eng.rope_limit == 64
    assert [rel(c.hidden_states[-1], w) < 1e-5 for c, w in zip(got, want, strict=True)] == [True] * 5
