"""Response regeneration: a tiny random Llama (transformers generate), a scripted generator for the turn logic,
and the SGLang client against a local fake server."""

from __future__ import annotations

import functools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from chatfix import BOS, CORPUS, EOS, SPECIALS, TEMPLATES, make_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hsextract.config.settings import from_config
from hsextract.engines.transformers_generate import TransformersGenerator
from hsextract.errors import ConfigError, EngineError
from hsextract.masks.masker import ChatMasker
from hsextract.prepare.conversations import Conversation, conversation_hash
from hsextract.prepare.run import num_chunks, run_prepare
from hsextract.regenerate import (
    RegenStats,
    chunk_name,
    concat_chunks,
    cut_at_stop,
    end_of_turn_ids,
    regenerate_chunk,
    run_regenerate_chunk,
    stats_path,
)
from hsextract.regenerate.template import tool_call_opener
from hsextract.sglang.generate import SGLangGenerator, request_id
from hsextract.sglang_plugin import plugin

# ------------------------------------------------------------------------------------------------ fixtures


@functools.cache
def _bpe() -> str:
    # Alphabet = the corpus characters only (no byte fallback): any token sequence decodes to valid text,
    # so a random model's generations can round-trip through the template.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 3 + ["line one\nline two\n\nend"],
                            trainer=trainers.BpeTrainer(vocab_size=200, min_frequency=1, show_progress=False))
    return tok.to_str()


def make_tok(name: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer.from_str(_bpe())
    tok.add_special_tokens(SPECIALS[name])
    kw = {"eos_token": EOS[name]}
    if BOS[name]:
        kw["bos_token"] = BOS[name]
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=(TEMPLATES / f"{name}.jinja").read_text(),
                                   **kw)


@functools.cache
def tiny_llama(vocab: int, eot: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=eot)  # saved: its generation_config.json names the tokenizer's eos, as a real one
    m = LlamaForCausalLM(cfg).eval()
    # Make the end-of-turn token likely enough that some turns stop on it and some run to max_new_tokens
    # (measured: at 0.04 half of the turns of CONVS stop; at 0.03 none of CONVS[:3], at 0.06 nearly all).
    with torch.no_grad():
        m.lm_head.weight[eot] = m.model.norm.weight * 0.04
    return m


def model_for(tok) -> LlamaForCausalLM:
    """A random model that never opens a tool call (the regenerator cuts a conversation where one does:
    test_a_tool_call_the_target_makes_cuts_the_conversation_before_it): its logit is -inf."""
    m = tiny_llama(len(tok), tok.eos_token_id)
    opener = tool_call_opener(ChatMasker(tok))
    if opener is not None:
        m.lm_head.register_forward_hook(lambda _mod, _inp, out: out.index_fill_(-1, torch.tensor([opener]),
                                                                                float("-inf")))
    return m


class Recording:
    """Wraps a generator; records (prompt, output) pairs; optionally fails on call number `fail_on`."""

    def __init__(self, inner, fail_on: int | None = None) -> None:
        self.inner, self.fail_on, self.calls, self.pairs = inner, fail_on, 0, []

    def generate(self, prompts, seeds=None):
        self.calls += 1
        if self.fail_on is not None and self.calls == self.fail_on:
            raise RuntimeError("injected failure")
        outs = self.inner.generate(prompts, seeds)
        self.pairs.extend(zip(map(list, prompts), outs, strict=True))
        return outs


class Scripted:
    """Answers each prompt with the next scripted text (tokenized) + the stop token."""

    def __init__(self, tok, texts, stop: bool | list[bool] = True) -> None:
        self.tok, self.texts, self.k, self.stop = tok, list(texts), 0, stop
        self.prompts: list[list[int]] = []

    def generate(self, prompts, seeds=None):
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            text = self.texts[self.k]
            stop = self.stop if isinstance(self.stop, bool) else self.stop[self.k]
            self.k += 1
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            out.append(ids + ([self.tok.eos_token_id] if stop else []))
        return out


CONVS = [
    {"messages": [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi."},
                  {"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "four"}]},
    {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is the weather in Paris?"}]},
    {"messages": [{"role": "user", "content": "How are you today?"}, {"role": "assistant", "content": "fine"}]},
    {"messages": [{"role": "user", "content": "get weather Paris"},
                  {"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                    "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": '{"temperature": 21}'},
                  {"role": "assistant", "content": "It is 21 degrees."}]},
    {"messages": [{"role": "user", "content": "Let me think about this step by step."},
                  {"role": "assistant", "content": "ok"}]},
]


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _config(src: Path, **regen) -> dict:
    # `model` names no folder: the test tokenizers are no checkpoint's (no generation_config.json to read)
    return {"sources": [{"path": str(src), "name": "d"}], "seed": 5, "prompts_per_chunk": 2, "engine": "transformers",
            "model": str(src.parent / "no-model"),
            "regenerate": {"enabled": True, "max_new_tokens": 6, "batch_size": 3, **regen}}


def regen_settings(**regen):
    """The `regenerate:` section of a config holding only these keys (the rest: the schema's defaults)."""
    return from_config({"regenerate": regen}).regenerate


def _read_jsonl(p: Path) -> list[dict]:
    return [json.loads(line) for line in p.read_text().splitlines()]


# ------------------------------------------------------------------------------------------------ tests


def test_stop_token_is_the_templates_end_of_turn():
    got = {name: make_tok(name).convert_ids_to_tokens(end_of_turn_ids(make_tok(name)))
           for name in ("llama3", "qwen3", "deepseek_v3", "kimi_k25")}
    assert got == {"llama3": ["<|eot_id|>"], "qwen3": ["<|im_end|>"], "deepseek_v3": ["<｜end▁of▁sentence｜>"],
                   "kimi_k25": ["<|im_end|>"]}
    # GLM-4.5 writes no token after a turn: the model stops by writing the next message's header (a tokenizer
    # with byte fallback: the template probe's sentinels must survive tokenization)
    glm = make_tokenizer("glm45")
    assert glm.convert_ids_to_tokens(end_of_turn_ids(glm)) == ["<|user|>", "<|observation|>", "<|endoftext|>"]
    assert cut_at_stop([5, 6, 7, 6, 8], [6]) == [5, 6] and cut_at_stop([5, 7], [6]) == [5, 7]


def test_stop_tokens_add_the_checkpoints_generation_config(tmp_path):
    # gpt-oss ships eos_token_id [<|return|>, <|endoftext|>, <|call|>]: a turn that ends in a tool call stops at
    # <|call|>, which the template does not write after a plain turn; SGLang stops there too
    tok = make_tokenizer("harmony")
    ids = tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    assert tok.convert_ids_to_tokens(end_of_turn_ids(tok)) == ["<|return|>"]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[0], ids[1]]}))
    assert tok.convert_ids_to_tokens(end_of_turn_ids(tok, model_dir=tmp_path)) == ["<|return|>", "<|call|>"]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[1]}))
    assert tok.convert_ids_to_tokens(end_of_turn_ids(tok, model_dir=str(tmp_path))) == ["<|return|>", "<|call|>"]
    assert end_of_turn_ids(tok, model_dir=tmp_path / "absent") == end_of_turn_ids(tok)  # no folder: none read
    repair = ". Repair it, or set `regenerate.stop_token_ids`"
    for bad, said in (
            ("{", "not a JSON object (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
                  "it gives the ids generation stops at" + repair),
            ("[1]", "not a JSON object ('list' object has no attribute 'get'); it gives the ids generation stops at"
                    + repair),
            ('{"eos_token_id": [true]}', "eos_token_id = [True] is not a token id or a list of them" + repair),
            ('{"eos_token_id": 4096}', f"eos_token_id = 4096 is outside the tokenizer's vocabulary (ids 0.."
                                       f"{len(tok) - 1}): the tokenizer is not this model's (config keys `tokenizer`, "
                                       "`model`)")):
        (tmp_path / "generation_config.json").write_text(bad)
        with pytest.raises(ConfigError) as e:
            end_of_turn_ids(tok, model_dir=tmp_path)
        assert str(e.value) == f"{tmp_path / 'generation_config.json'}: {said}"


def test_stop_tokens_of_a_hub_id_come_from_the_hubs_cache(tmp_path, monkeypatch, capsys):
    """A hub id (`org/name`): its generation_config.json is read from the hub's cache (huggingface_hub's own
    layout, read by its own function), as the tokenizer is; one the cache knows the repo lacks adds nothing; the hub
    unreachable adds nothing, with a warning that says what to set."""
    import huggingface_hub
    from huggingface_hub import constants

    tok = make_tokenizer("harmony")
    call = tok.convert_tokens_to_ids("<|call|>")
    repo = tmp_path / "hub" / "models--org--gpt-tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "generation_config.json").write_text(json.dumps({"eos_token_id": call}))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert tok.convert_ids_to_tokens(end_of_turn_ids(tok, model_dir="org/gpt-tiny")) == ["<|return|>", "<|call|>"]
    (repo / "snapshots" / ("0" * 40) / "generation_config.json").unlink()
    (repo / ".no_exist" / ("0" * 40)).mkdir(parents=True)
    (repo / ".no_exist" / ("0" * 40) / "generation_config.json").touch()
    assert end_of_turn_ids(tok, model_dir="org/gpt-tiny") == end_of_turn_ids(tok)

    def unreachable(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    assert end_of_turn_ids(tok, model_dir="org/other") == end_of_turn_ids(tok)
    assert capsys.readouterr().err == (
        "WARNING: regenerate: generation_config.json of 'org/other' not read (OSError): its eos ids are not among "
        "the stop ids; set `regenerate.stop_token_ids` if the model stops at others\n")


def test_turns_are_what_model_generate_gives_for_the_rendered_context():
    tok = make_tok("deepseek_v3")
    model = model_for(tok)
    settings = regen_settings(max_new_tokens=6, batch_size=4)
    stop = end_of_turn_ids(tok)
    rec = Recording(TransformersGenerator(model, settings, stop))
    convs = [Conversation([dict(m) for m in c["messages"]]) for c in CONVS[:3]]
    stats = RegenStats()
    out = regenerate_chunk(convs, rec, settings, tokenizer=tok, sample_ids=["a", "b", "c"], stats=stats)

    masker = ChatMasker(tok)
    by_prompt = {tuple(p): o for p, o in rec.pairs}
    n_stopped = 0
    for conv, new in zip(convs, out, strict=True):
        # Non-assistant messages unchanged, in place; conversation 1 gets an appended final turn.
        assert [m for m in new.messages if m["role"] != "assistant"] == \
            [m for m in conv.messages if m["role"] != "assistant"]
        for j, m in enumerate(new.messages):
            if m["role"] != "assistant":
                assert m == (conv.messages[j] if j < len(conv.messages) else None)
                continue
            prompt = tok(masker.render(new.messages[:j], add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
            gen = by_prompt[tuple(prompt)]  # the context holds the regenerated earlier turns
            direct = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    do_sample=False, max_new_tokens=6, eos_token_id=stop, pad_token_id=stop[0])
            direct_ids = cut_at_stop(direct[0, len(prompt):].tolist(), stop)
            assert gen == direct_ids
            stopped = direct_ids[-1] in stop
            n_stopped += stopped
            body = direct_ids[:-1] if stopped else direct_ids
            assert m == {"role": "assistant", "content": tok.decode(body, skip_special_tokens=False)}
    assert len(rec.pairs) == 4 and stats.turns_regenerated == 3 and stats.turns_appended == 1
    assert stats.generated_tokens == sum(len(o) for _, o in rec.pairs)
    assert stats.turns_hit_max_new_tokens == 4 - n_stopped
    assert 0 < n_stopped < 4, "the eot bias should make some but not all turns stop"
    assert sum(stats.roundtrip.values()) == 4 and stats.roundtrip.get("none", 0) == 0


def _chunk_paths(tmp: Path, n: int) -> list[Path]:
    return [tmp / "regen" / chunk_name(k) for k in range(n)]


def test_chunks_then_prepare_uses_the_same_template(tmp_path):
    tok = make_tok("deepseek_v3")
    model = model_for(tok)
    src = _write_jsonl(tmp_path / "in.jsonl", CONVS)
    cfg = from_config(_config(src))
    n = num_chunks(cfg.prepare)
    assert n == 3
    rec = Recording(TransformersGenerator(model, cfg.regenerate, end_of_turn_ids(tok)))
    for k, p in enumerate(_chunk_paths(tmp_path, n)):
        st = run_regenerate_chunk(cfg, k, p, tokenizer=tok, generator=rec)
        assert json.loads(stats_path(p).read_text()) == json.loads(json.dumps(st))
    out = tmp_path / "regenerated.jsonl"
    total = concat_chunks(_chunk_paths(tmp_path, n), out)
    records = _read_jsonl(out)
    assert len(records) == len(CONVS) and total["records"] == 5 and total["chunks"] == 3
    assert total["turns_kept_tool_calls"] == 1 and total["turns_regenerated"] + total["turns_appended"] == 6
    assert sorted(r["id"] for r in records) == [f"d:{i}" for i in range(5)]
    # The tool-call turn and the tool result are kept verbatim (tool_turns: keep).
    tool_rec = next(r for r in records if r["id"] == "d:3")
    assert tool_rec["messages"][1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                     "arguments": {"city": "Paris"}}
    assert tool_rec["messages"][2] == CONVS[3]["messages"][2]

    # prepare reads the regenerated file with the same tokenizer/template: every prompt the model saw is a
    # prefix of a stored sample, and when the re-tokenized turn equals the generated ids, so is prompt+turn.
    prepare = from_config({"sources": [{"path": str(out), "name": "r"}], "seed": 1, "prompts_per_chunk": 2,
                           "dedup": False}).prepare
    summary = run_prepare(prepare, tok, tmp_path / "prompts", 3)
    rows = [r for k in range(3) for r in pq.read_table(tmp_path / "prompts" / f"chunk-{k:05d}.parquet").to_pylist()]
    assert summary["kept"] == 5 and len(rows) == 5
    stored = [r["input_ids"] for r in rows]
    stop = end_of_turn_ids(tok)
    exact = 0
    for prompt, gen in rec.pairs:
        hits = [ids for ids in stored if ids[:len(prompt)] == prompt]
        assert hits, "a generation prompt is not a prefix of any prepared sample"
        body = gen[:-1] if gen[-1] in stop else gen
        # the generated ids are stored as they were generated (re-tokenizing the decoded text gave them back)
        exact += any(ids[:len(prompt) + len(body)] == prompt + body for ids in hits)
    assert exact == total["roundtrip"]["tokens"] >= 1
    assert sum(total["roundtrip"].values()) == len(rec.pairs) == 6


def test_a_weights_repeats_stay_repeats_after_greedy_regeneration(tmp_path):
    """weight 2 and greedy regeneration: each record's two lines are the same conversation, which prepare keeps
    twice (as without regeneration) when it knows the file is regenerate's; as a plain file, the second copy of
    each is a duplicate."""
    tok = make_tok("deepseek_v3")
    src = _write_jsonl(tmp_path / "in.jsonl", [CONVS[0], CONVS[2]])
    base = {"sources": [{"path": str(src), "name": "d", "weight": 2.0}], "seed": 1, "prompts_per_chunk": 8,
            "share_prefixes": False, "model": str(tmp_path / "no-model")}
    cfg = from_config({**base, "regenerate": {"enabled": True}})
    paths = _chunk_paths(tmp_path, 1)
    run_regenerate_chunk(cfg, 0, paths[0], tokenizer=tok, generator=Scripted(tok, ["Same."] * 6))
    out = tmp_path / "conversations.jsonl"
    concat_chunks(paths, out)
    assert sorted(r["id"] for r in _read_jsonl(out)) == ["d:0", "d:0#1", "d:1", "d:1#1"]
    as_workflow = from_config({**base, "sources": [{"path": str(out), "name": "regenerated", "format": "messages"}]})
    kept = run_prepare(as_workflow.prepare, tok, tmp_path / "p", 1, regenerated=True)
    assert (kept["kept"], dict(kept["dropped"])) == (4, {})
    # each sample keeps the id of the input record it regenerates, not its line in the regenerated file
    rows = pq.read_table(tmp_path / "p" / "chunk-00000.parquet").to_pylist()
    by_id = {r["id"]: r["messages"] for r in _read_jsonl(out)}
    assert sorted(r["sample_id"] for r in rows) == ["d:0", "d:0#1", "d:1", "d:1#1"]
    masker = ChatMasker(tok)
    for r in rows:
        assert r["input_ids"] == masker.encode(Conversation(by_id[r["sample_id"]]))[0].input_ids
    plain = run_prepare(as_workflow.prepare, tok, tmp_path / "q", 1)
    assert (plain["kept"], dict(plain["dropped"])) == (2, {"duplicate": 2})


def test_duplicate_inputs_stay_duplicates_when_their_sampled_generations_differ(tmp_path):
    """Two equal input records (not a weight's repeats) sampled at temperature > 0 get different generations (each
    record its own seed): prepare compares the inputs they were regenerated from (`input_sha256`), so the second
    is a duplicate, as without regeneration."""
    tok = make_tok("deepseek_v3")
    src = _write_jsonl(tmp_path / "in.jsonl", [CONVS[2], CONVS[0], CONVS[2]])
    base = {"sources": [{"path": str(src), "name": "d"}], "seed": 1, "prompts_per_chunk": 8,
            "share_prefixes": False, "model": str(tmp_path / "no-model")}
    cfg = from_config({**base, "regenerate": {"enabled": True, "temperature": 0.8}})
    paths = _chunk_paths(tmp_path, 1)
    run_regenerate_chunk(cfg, 0, paths[0], tokenizer=tok, generator=Scripted(tok, ["One.", "Two.", "Three.", "Four."]))
    out = tmp_path / "conversations.jsonl"
    concat_chunks(paths, out)
    recs = {r["id"]: r for r in _read_jsonl(out)}
    assert recs["d:0"]["messages"] != recs["d:2"]["messages"]  # the generations differ
    assert recs["d:0"]["input_sha256"] == recs["d:2"]["input_sha256"] == conversation_hash(Conversation(
        CONVS[2]["messages"])) != recs["d:1"]["input_sha256"]
    as_workflow = from_config({**base, "sources": [{"path": str(out), "name": "regenerated", "format": "messages"}]})
    kept = run_prepare(as_workflow.prepare, tok, tmp_path / "p", 1, regenerated=True)
    assert (kept["kept"], dict(kept["dropped"])) == (2, {"duplicate": 1})
    rows = pq.read_table(tmp_path / "p" / "chunk-00000.parquet").to_pylist()
    assert sorted(r["sample_id"] for r in rows) == ["d:0", "d:1"]
    # the joined file with a line lost (by hand): its stats say 3 were joined; refused, not a smaller dataset
    out.write_bytes(b"".join(out.read_bytes().splitlines(keepends=True)[1:]))
    with pytest.raises(ConfigError) as e:
        run_prepare(as_workflow.prepare, tok, tmp_path / "r", 1, regenerated=True)
    assert str(e.value) == (f"{out}: 2 records, but conversations.stats.json beside it says regenerate joined 3 (one "
                            "line per input record): the file was edited or damaged since. Delete it and rerun: its "
                            "chunks are joined again")


def test_a_turn_whose_context_reaches_max_seq_len_is_not_generated(tmp_path):
    """A context of max_seq_len tokens or more leaves no room for a trained token in the sample (prepare drops or
    truncates it) and may exhaust the engine's memory: the conversation is cut before that turn, no prompt of it is
    sent, and the cut is counted."""
    tok = make_tok("deepseek_v3")
    long_user = {"role": "user", "content": "What is two plus two? " * 40}
    recs = [CONVS[2], {"messages": [CONVS[0]["messages"][0], CONVS[0]["messages"][1], long_user,
                                    {"role": "assistant", "content": "four"}]}]
    src = _write_jsonl(tmp_path / "in.jsonl", recs)
    cfg = from_config({"sources": [{"path": str(src), "name": "d"}], "seed": 1, "prompts_per_chunk": 8,
                       "model": str(tmp_path / "no-model"), "max_seq_len": 100,
                       "regenerate": {"enabled": True}})
    long_ids = ChatMasker(tok).renderer.render_ids(recs[1]["messages"][:3], add_generation_prompt=True)
    assert len(long_ids) >= 100
    gen = Scripted(tok, ["A.", "B."])
    stats = run_regenerate_chunk(cfg, 0, _chunk_paths(tmp_path, 1)[0], tokenizer=tok, generator=gen)
    assert stats["conversations_cut"] == {"context_too_long": 1}
    assert len(gen.prompts) == 2 and all(len(p) < 100 for p in gen.prompts)  # two first turns, the long one never
    out = {r["id"]: r for r in _read_jsonl(_chunk_paths(tmp_path, 1)[0])}
    assert [m["role"] for m in out["d:1"]["messages"]] == ["user", "assistant", "user"]  # cut before the long turn


def test_same_config_identical_files_and_per_sample_seeds(tmp_path):
    tok = make_tok("deepseek_v3")
    model = model_for(tok)
    src = _write_jsonl(tmp_path / "in.jsonl", CONVS)

    def run(name: str, **regen) -> bytes:
        cfg = from_config(_config(src, **regen))
        gen = TransformersGenerator(model, cfg.regenerate, end_of_turn_ids(tok))
        paths = [tmp_path / name / chunk_name(k) for k in range(3)]
        for k, p in enumerate(paths):
            run_regenerate_chunk(cfg, k, p, tokenizer=tok, generator=gen)
        concat_chunks(paths, tmp_path / name / "all.jsonl")
        return (tmp_path / name / "all.jsonl").read_bytes()

    assert run("g1") == run("g2")
    sampled = run("s1", temperature=1.0, top_p=0.9, seed=7)
    assert sampled == run("s2", temperature=1.0, top_p=0.9, seed=7)
    assert sampled != run("g3")
    assert sampled != run("s3", temperature=1.0, top_p=0.9, seed=8)
    # Seeds are per (sample, turn): the batch composition does not change what is drawn.
    assert sampled == run("s4", temperature=1.0, top_p=0.9, seed=7, batch_size=1)


def test_failed_chunk_leaves_nothing_and_reruns_alone(tmp_path):
    tok = make_tok("deepseek_v3")
    model = model_for(tok)
    src = _write_jsonl(tmp_path / "in.jsonl", CONVS)
    cfg = from_config(_config(src))
    base = TransformersGenerator(model, cfg.regenerate, end_of_turn_ids(tok))
    paths = _chunk_paths(tmp_path, 3)
    # Mixture order (seed 5): chunk 0 = d:4, d:3; chunk 1 = d:1, d:2; chunk 2 = d:0 (two assistant turns).
    for k in (0, 1):
        run_regenerate_chunk(cfg, k, paths[k], tokenizer=tok, generator=base)
    before = [p.stat().st_mtime_ns for p in paths[:2]]
    # Fail on chunk 2's second generate call: mid-chunk, after its first turn was generated.
    failing = Recording(base, fail_on=2)
    with pytest.raises(RuntimeError, match="injected failure"):
        run_regenerate_chunk(cfg, 2, paths[2], tokenizer=tok, generator=failing)
    assert failing.calls == 2 and len(failing.pairs) == 1
    assert sorted(p.name for p in (tmp_path / "regen").iterdir()) == [
        "chunk-00000.jsonl", "chunk-00000.stats.json", "chunk-00001.jsonl", "chunk-00001.stats.json"]
    with pytest.raises(ConfigError, match=r"chunk files missing: \[.*chunk-00002.jsonl"):
        concat_chunks(paths, tmp_path / "all.jsonl")
    assert not (tmp_path / "all.jsonl").exists()
    rerun = Recording(base)
    run_regenerate_chunk(cfg, 2, paths[2], tokenizer=tok, generator=rerun)
    assert len(rerun.pairs) == 2 and rerun.pairs[0] == failing.pairs[0]
    assert [p.stat().st_mtime_ns for p in paths[:2]] == before
    # The rerun chunk equals a clean run of it.
    clean = tmp_path / "clean.jsonl"
    run_regenerate_chunk(cfg, 2, clean, tokenizer=tok, generator=base)
    assert paths[2].read_bytes() == clean.read_bytes()
    concat_chunks(paths, tmp_path / "all.jsonl")
    assert [r["id"] for r in _read_jsonl(tmp_path / "all.jsonl")] == ["d:4", "d:3", "d:1", "d:2", "d:0"]
    # a whole line lost from a chunk file (by hand: no write cuts one): its stats' count tells, not a smaller dataset
    whole = paths[0].read_bytes()
    paths[0].write_bytes(whole.split(b"\n", 1)[1])
    with pytest.raises(ConfigError) as e:
        concat_chunks(paths, tmp_path / "all.jsonl")
    assert str(e.value) == (f"{paths[0]}: 1 lines, but its chunk-00000.stats.json records 2 (one line per input "
                            "record): the file was edited or damaged since. Delete it and rerun its chunk")
    assert len(_read_jsonl(tmp_path / "all.jsonl")) == 5  # the joined file as it was
    paths[0].write_bytes(whole)
    # a chunk without stats (by hand): joined, and no total of records that prepare would hold the file to
    assert concat_chunks(paths, tmp_path / "all.jsonl")["records"] == 5
    stats_path(paths[0]).unlink()
    assert "records" not in concat_chunks(paths, tmp_path / "all.jsonl")
    with pytest.raises(ConfigError, match="chunk 3 does not exist: the sources hold 5 records = 3 chunks of 2"):
        run_regenerate_chunk(cfg, 3, tmp_path / "x.jsonl", tokenizer=tok, generator=base)


def test_a_turn_that_ends_inside_its_reasoning_is_never_an_answer():
    """Kimi's generation prompt opens <think>: a turn that reaches max_new_tokens before </think> has no answer, and
    rendered back it would close the reasoning and end the turn where the model did neither: cut, whatever
    drop_truncated says. One that ends there (its stop token) is cut too: rendered back, `</think>` would be
    trained before the stop where the model wrote none."""
    tok = make_tok("kimi_k25")
    conv = Conversation([{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "4"},
                         {"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi."}])
    for drop in (False, True):
        stats = RegenStats()
        gen = Scripted(tok, ["Let me think</think>Two plus two is four.", "The weather in"], stop=[True, False])
        (new,) = regenerate_chunk([conv], gen, regen_settings(drop_truncated=drop), tokenizer=tok, stats=stats)
        assert new.messages == [conv.messages[0], {"role": "assistant", "reasoning_content": "Let me think",
                                                   "content": "Two plus two is four."}, conv.messages[2]]
        assert stats.conversations_cut == {"max_new_tokens_in_reasoning": 1} and stats.turns_hit_max_new_tokens == 1
    stats = RegenStats()
    (new,) = regenerate_chunk([Conversation(conv.messages[:2])], Scripted(tok, ["Let me think"]), regen_settings(),
                              tokenizer=tok, stats=stats)
    assert new.messages == conv.messages[:1]
    assert stats.conversations_cut == {"stopped_in_reasoning": 1, "no_assistant_turn": 1}
    # truncated after its reasoning closed: an answer, kept unless drop_truncated (as any truncated turn)
    stats = RegenStats()
    (new,) = regenerate_chunk([Conversation(conv.messages[:2])], Scripted(tok, ["Hm</think>Two plus"], stop=False),
                              regen_settings(), tokenizer=tok, stats=stats)
    assert new.messages[1] == {"role": "assistant", "reasoning_content": "Hm", "content": "Two plus"}
    assert stats.turns_hit_max_new_tokens == 1 and not stats.conversations_cut


def test_the_regenerated_file_keeps_the_key_order_the_template_rendered(tmp_path):
    """A template's tojson keeps a dict's key order (tool declarations, tool-call arguments): the regenerated
    record keeps it, so prepare renders the context the target answered."""
    tok = make_tok("kimi_k25")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"unit": "C", "city": "Paris"}}}
    src = _write_jsonl(tmp_path / "in.jsonl", [{"tools": tools, "messages": [
        {"role": "user", "content": "get weather Paris"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "21"}, {"role": "assistant", "content": "It is 21 degrees."}]}])
    cfg = from_config({**_config(src), "prompts_per_chunk": 1})
    run_regenerate_chunk(cfg, 0, tmp_path / "out.jsonl", tokenizer=tok,
                         generator=Scripted(tok, ["Hot.</think>It is warm."]))
    (rec,) = _read_jsonl(tmp_path / "out.jsonl")
    assert json.dumps(rec["tools"]) == json.dumps(tools)  # the same keys in the same order
    assert json.dumps(rec["messages"][1]["tool_calls"][0]["function"]["arguments"]) == json.dumps(
        call["function"]["arguments"])
    assert rec["messages"][3]["content"] == "It is warm."


def test_a_chunk_stops_at_the_checkpoints_generation_config_ids_too(tmp_path):
    tok = make_tok("deepseek_v3")
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, 7]}))
    src = _write_jsonl(tmp_path / "in.jsonl", CONVS)
    st = run_regenerate_chunk(from_config({**_config(src), "model": str(model)}), 0, tmp_path / "out.jsonl",
                              tokenizer=tok, generator=Scripted(tok, ["Fine."] * 4))
    assert st["settings"]["stop_token_ids"] == [tok.eos_token_id, 7]


class Fixed:
    """Answers each prompt with the next of the given id lists, as they are."""

    def __init__(self, outs: list[list[int]]) -> None:
        self.outs = list(outs)

    def generate(self, prompts, seeds=None):
        return [self.outs.pop(0) for _ in prompts]


def test_a_turn_whose_rendering_trains_other_ids_than_generated_counts_as_text(tmp_path, capsys):
    """Prepare trains the rendering's ids: where they are not the generated ones and the stop token the model
    wrote (ids the tokenizer merges otherwise, eos where the template writes its end-of-turn), the turn counts as
    roundtrip "text" and the job says so."""
    tok = make_tok("phi3")  # the template ends a turn with <|end|>; eos <|endoftext|> stops a generation too
    end, eos = tok.convert_tokens_to_ids("<|end|>"), tok.eos_token_id
    fine = tok("the answer", add_special_tokens=False)["input_ids"]
    split = [tok.convert_tokens_to_ids(c) for c in "the"] + fine[2:]  # "t" "h" "e" where the tokenizer has "t" "he"
    assert tok.decode(split) == tok.decode(fine) and split != fine
    user = Conversation([{"role": "user", "content": "Hello there!"}])
    for out, want in (([*fine, end], {"tokens": 1}), ([*fine, eos], {"text": 1}), ([*split, end], {"text": 1})):
        stats = RegenStats()
        (new,) = regenerate_chunk([user], Fixed([out]), regen_settings(), tokenizer=tok, stats=stats)
        assert new.messages[1] == {"role": "assistant", "content": "the answer"} and stats.roundtrip == want
    src = _write_jsonl(tmp_path / "in.jsonl", [{"messages": user.messages}])
    st = run_regenerate_chunk(from_config({**_config(src), "prompts_per_chunk": 1}), 0, tmp_path / "out.jsonl",
                              tokenizer=tok, generator=Fixed([[*fine, eos]]))
    assert st["roundtrip"] == {"text": 1}
    assert capsys.readouterr().err == (
        "WARNING: regenerate chunk 0: 1 turns whose rendering trains other ids than the generated ones (roundtrip "
        f"text); {tmp_path / 'out.stats.json'}\n")


def test_a_tool_call_the_target_makes_cuts_the_conversation_before_it():
    """Where the recorded turn is plain and the target calls a tool, the recorded messages after it answer no such
    call, and the call as a plain message's content would not render back as written (this Kimi-shaped template
    keeps reasoning in tool-call turns only): cut before the turn. A template that writes calls as plain text
    (Llama 3) has no markup to find."""
    tok = make_tok("kimi_k25")
    call = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    conv = Conversation([{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sunny."},
                         {"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": "Rain."}])
    stats = RegenStats()
    (new,) = regenerate_chunk([conv], Scripted(tok, ["Let me look.</think>It is sunny.", "Hm.</think>" + call]),
                              regen_settings(), tokenizer=tok, stats=stats)
    assert new.messages == [*conv.messages[:1], {"role": "assistant", "reasoning_content": "Let me look.",
                                                 "content": "It is sunny."}, conv.messages[2]]
    assert stats.conversations_cut == {"tool_call_generated": 1} and stats.turns_regenerated == 1
    # gpt-oss: the call's mark, <|call|>, is also a stop token (its generation_config): the turn ends on it
    harmony = make_tok("harmony")
    call_id, return_id = harmony.convert_tokens_to_ids(["<|call|>", "<|return|>"])
    assert tool_call_opener(ChatMasker(harmony)) == call_id
    stats = RegenStats()
    fine = harmony("Sure", add_special_tokens=False)["input_ids"]
    (new,) = regenerate_chunk([Conversation(conv.messages[:3])], Fixed([fine + [return_id], fine + [call_id]]),
                              regen_settings(stop_token_ids=[return_id, call_id]), tokenizer=harmony, stats=stats)
    assert len(new.messages) == 3 and stats.conversations_cut == {"tool_call_generated": 1}
    openers = {name: tool_call_opener(ChatMasker(make_tok(name))) for name in ("kimi_k25", "deepseek_v3", "qwen3")}
    assert {name: make_tok(name).convert_ids_to_tokens(t) for name, t in openers.items()} == {
        "kimi_k25": "<|tool_calls_section_begin|>", "deepseek_v3": "<｜tool▁calls▁begin｜>", "qwen3": "<tool_call>"}
    assert tool_call_opener(ChatMasker(make_tok("llama3"))) is None


def test_reasoning_split_tool_turns_and_cut_conversations():
    tok = make_tok("kimi_k25")
    settings = regen_settings()
    conv = Conversation([{"role": "user", "content": "What is two plus two?"},
                         {"role": "assistant", "content": "four", "reasoning_content": "old"},
                         {"role": "user", "content": "Hello there!"}])
    gen = Scripted(tok, ["Let me think</think>Two plus two is four.", "The weather</think>How are you today?"])
    stats = RegenStats()
    (new,) = regenerate_chunk([conv], gen, settings, tokenizer=tok, stats=stats)
    assert new.messages[1] == {"role": "assistant", "reasoning_content": "Let me think",
                               "content": "Two plus two is four."}
    assert new.messages[3] == {"role": "assistant", "reasoning_content": "The weather",
                               "content": "How are you today?"}
    # Kimi's generation prompt opens <think> and the model's text continues it; but this template renders
    # a finished plain turn as history with an empty <think></think>: what is stored is not what was
    # generated, and the stats say so. (The masker would put the reasoning back, but this fixture's alphabet
    # has no characters for the template probe's sentinels, so it cannot find where.)
    assert stats.roundtrip == {"none": 2}
    masker = ChatMasker(tok)
    p = masker.render(new.messages[:1], add_generation_prompt=True)
    assert p.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert masker.render(new.messages[:2]) == p + "</think>Two plus two is four.<|im_end|>"

    # DeepSeek-R1: the prompt ends with <think>\n and every turn is rendered without its reasoning; the stored
    # message is the one whose sample holds the generated text: split where the usual layout holds, else raw.
    rtok = make_tok("deepseek_r1")
    for text, want in [("Let me think\n</think>\n\nIt is four.",
                        {"reasoning_content": "Let me think", "content": "It is four."}),
                       ("Let me think\n\n</think>It is four.",
                        {"content": "Let me think\n\n</think>It is four."})]:
        stats = RegenStats()
        (rn,) = regenerate_chunk([Conversation(conv.messages[:2])], Scripted(rtok, [text]), settings, tokenizer=rtok,
                                 stats=stats)
        assert rn.messages[1] == {"role": "assistant", **want} and stats.roundtrip == {"tokens": 1}
        rm = ChatMasker(rtok)
        rp = rm.render(rn.messages[:1], add_generation_prompt=True)
        (sample,) = rm.encode(rn)
        assert sample.input_ids == rtok(rp + text + "<｜end▁of▁sentence｜>", add_special_tokens=False)["input_ids"]

    # Qwen3: the model writes the think block itself; the template renders it back exactly (the newlines it
    # adds are stripped from the fields), token for token.
    qtok = make_tok("qwen3")
    text = "<think>\nThe user asks.\n</think>\n\nIt is four."
    q = Scripted(qtok, [text])
    stats = RegenStats()
    (qn,) = regenerate_chunk([Conversation(conv.messages[:2])], q, settings, tokenizer=qtok, stats=stats)
    assert qn.messages[1] == {"role": "assistant", "reasoning_content": "The user asks.", "content": "It is four."}
    assert stats.roundtrip == {"tokens": 1}
    qm = ChatMasker(qtok)
    assert qm.render(qn.messages) == qm.render(qn.messages[:1], add_generation_prompt=True) + text + "<|im_end|>\n"

    # Tool-call turns: kept (default) or the conversation is cut before them.
    dtok = make_tok("deepseek_v3")
    tool_conv = Conversation([dict(m) for m in CONVS[3]["messages"]])
    kept = regenerate_chunk([tool_conv], Scripted(dtok, ["It is warm."]), settings, tokenizer=dtok)[0]
    assert kept.messages[:3] == CONVS[3]["messages"][:3] and kept.messages[3]["content"] == "It is warm."
    trunc = regen_settings(tool_turns="truncate", complete_last_turn=False)
    st = RegenStats()
    cut = regenerate_chunk([tool_conv], Scripted(dtok, []), trunc, tokenizer=dtok, stats=st)[0]
    assert cut.messages == CONVS[3]["messages"][:1] and st.conversations_cut == {"no_assistant_turn": 1}

    # Empty generation cuts the conversation before the turn; max_new_tokens with drop_truncated too.
    two = Conversation([dict(m) for m in CONVS[0]["messages"]])
    st = RegenStats()
    out = regenerate_chunk([two], Scripted(dtok, ["Hi.", ""]), settings, tokenizer=dtok, stats=st)[0]
    assert out.messages == CONVS[0]["messages"][:3] and st.conversations_cut == {"empty_generation": 1}
    st = RegenStats()
    out = regenerate_chunk([two], Scripted(dtok, ["Hi.", "four"], stop=[True, False]),
                           regen_settings(drop_truncated=True), tokenizer=dtok, stats=st)[0]
    assert out.messages == CONVS[0]["messages"][:3] and st.conversations_cut == {"max_new_tokens": 1}
    assert st.turns_hit_max_new_tokens == 1


@pytest.mark.parametrize("family", ["glm45", "glm47"])
def test_template_without_a_stop_token_regenerates_and_masks_what_the_model_wrote(family):
    """GLM-4.5/4.7 write no token after a turn: the generated text (its stop, a header, is cut) is stored as
    reasoning + content that render back token for token, and the sample of a turn followed by a message ends
    with the header the model stopped with."""
    tok = make_tokenizer(family)
    conv = Conversation([{"role": "user", "content": "What is two plus two?"},
                         {"role": "assistant", "content": "four", "reasoning_content": "old"},
                         {"role": "user", "content": "Hello there!"}])
    nl = "\n" if family == "glm45" else ""
    opener = "\n<think>" if family == "glm45" else ""  # GLM-4.7's generation prompt ends with <think>
    texts = [f"{opener}Let me think</think>{nl}It is four.", f"{opener}Greet.</think>{nl}Hello!"]
    stats = RegenStats()
    (new,) = regenerate_chunk([conv], Scripted(tok, texts), regen_settings(), tokenizer=tok, stats=stats)
    assert new.messages[1::2] == [{"role": "assistant", "reasoning_content": "Let me think", "content": "It is four."},
                                  {"role": "assistant", "reasoning_content": "Greet.", "content": "Hello!"}]
    assert stats.roundtrip == {"tokens": 2}
    m = ChatMasker(tok, split_turns="always")
    for j, text, stop, sample in zip((1, 3), texts, ("<|user|>", ""), m.encode(new), strict=True):
        prompt = m.render(new.messages[:j], add_generation_prompt=True)
        assert sample.input_ids == tok(prompt + text + stop, add_special_tokens=False)["input_ids"]


def test_malformed_records_lenient_keep_one_line_each(tmp_path):
    tok = make_tok("deepseek_v3")
    src = tmp_path / "in.jsonl"
    src.write_bytes(json.dumps(CONVS[2]).encode() + b"\n{not json\n")
    cfg = {**_config(src), "strict": False, "prompts_per_chunk": 4}
    st = run_regenerate_chunk(from_config(cfg), 0, tmp_path / "c.jsonl", tokenizer=tok,
                              generator=Scripted(tok, ["I am fine."]))
    recs = {r["id"]: r for r in _read_jsonl(tmp_path / "c.jsonl")}
    assert recs["d:1"] == {"id": "d:1", "source": "d", "messages": [], "malformed": "bad_json"}
    assert recs["d:0"]["messages"][1] == {"role": "assistant", "content": "I am fine."}
    assert st["malformed"] == {"bad_json": 1} and st["records"] == 2
    from hsextract.prepare.conversations import MalformedRecordError
    with pytest.raises(MalformedRecordError, match=r"in.jsonl:2: malformed record \(bad_json\)"):
        run_regenerate_chunk(from_config({**cfg, "strict": True}), 0, tmp_path / "s.jsonl", tokenizer=tok,
                             generator=Scripted(tok, ["x"]))
    assert not (tmp_path / "s.jsonl").exists()


def test_a_record_the_template_refuses_is_counted_as_prepare_counts_it(tmp_path):
    """gemma3's template refuses roles that do not alternate: prepare drops such a record (strict: false) and
    names it (strict); regeneration of the same chunk does the same instead of failing the chunk."""
    tok = make_tokenizer("gemma3")
    src = tmp_path / "in.jsonl"
    good = {"messages": [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "hi"}]}
    bad = {"messages": [{"role": "user", "content": "Hello"}, {"role": "user", "content": "there"},
                        {"role": "assistant", "content": "hi"}]}
    src.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    cfg = {"sources": [{"path": str(src), "name": "d"}], "prompts_per_chunk": 8, "strict": False,
           "model": str(tmp_path / "no-model"), "regenerate": {"enabled": True}}
    prepared = run_prepare(from_config(cfg).prepare, tok, tmp_path / "p", 1)
    assert (prepared["kept"], dict(prepared["dropped"])) == (1, {"template_error": 1})

    st = run_regenerate_chunk(from_config(cfg), 0, tmp_path / "c.jsonl", tokenizer=tok,
                              generator=Scripted(tok, ["fine"]))
    recs = {r["id"]: r for r in _read_jsonl(tmp_path / "c.jsonl")}
    assert recs["d:1"] == {"id": "d:1", "source": "d", "messages": [], "malformed": "template_error"}
    assert recs["d:0"]["messages"][1] == {"role": "assistant", "content": "fine"}
    assert st["refused"] == {"template_error": 1} and st["turns_regenerated"] == 1
    # prepare on the regenerated file counts the record under the same reason as prepare on the input did
    out = tmp_path / "conversations.jsonl"
    concat_chunks([tmp_path / "c.jsonl"], out)
    again = from_config({**cfg, "sources": [{"path": str(out), "name": "regenerated", "format": "messages"}]})
    after = run_prepare(again.prepare, tok, tmp_path / "q", 1, regenerated=True)
    assert (after["kept"], dict(after["dropped"])) == (1, {"template_error": 1})

    with pytest.raises(ConfigError, match=r"in\.jsonl:2: regenerate: the context of messages\[2\]: the chat "
                                          r"template refused it: Conversation roles must alternate"):
        run_regenerate_chunk(from_config({**cfg, "strict": True}), 0, tmp_path / "s.jsonl", tokenizer=tok,
                             generator=Scripted(tok, ["fine"]))
    assert not (tmp_path / "s.jsonl").exists()


def test_settings_defaults_and_stop_tokens_fill():
    s = regen_settings()
    assert (s.enabled, s.engine, s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.seed, s.batch_size) == \
        (False, None, 0.0, 1.0, 0, 1024, 0, 8)
    assert (s.tool_turns, s.complete_last_turn, s.drop_truncated, s.stop_token_ids, s.think_start, s.think_end) == \
        ("keep", True, False, None, "<think>", "</think>")
    assert (s.device, s.dtype, s.server_url, s.request_timeout_s, s.retries, s.send_seed) == \
        ("auto", "auto", None, 600, 3, True)
    assert regen_settings(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


# Every value the regenerate stage refused by hand before the settings tree is refused by the schema.
@pytest.mark.parametrize(("section", "message"), [
    ({"temp": 1}, "regenerate.temp: unknown key; config/README.md lists every key"),
    ({"temperature": -0.5}, "regenerate.temperature: -0.5 is less than the minimum of 0"),
    ({"temperature": 101}, "regenerate.temperature: 101 is greater than the maximum of 100"),
    ({"top_p": 1.5}, "regenerate.top_p: 1.5 is greater than the maximum of 1"),
    ({"top_p": 0}, "regenerate.top_p: 0 is less than or equal to the minimum of 0"),
    ({"top_k": -1}, "regenerate.top_k: -1 is less than the minimum of 0"),
    ({"top_k": 2**31 + 1}, "regenerate.top_k: 2147483649 is greater than the maximum of 2147483648"),
    ({"top_k": 1.5}, "regenerate.top_k: 1.5 is not of type 'integer'"),
    ({"max_new_tokens": 0}, "regenerate.max_new_tokens: 0 is less than the minimum of 1"),
    ({"max_new_tokens": 2**31 + 1},
     "regenerate.max_new_tokens: 2147483649 is greater than the maximum of 2147483648"),
    ({"seed": -1}, "regenerate.seed: -1 is less than the minimum of 0"),
    ({"seed": 2**63}, "regenerate.seed: 9223372036854775808 is greater than the maximum of 9223372036854775807"),
    ({"seed": True}, "regenerate.seed: True is not of type 'integer'"),
    ({"batch_size": 0}, "regenerate.batch_size: 0 is less than the minimum of 1"),
    ({"batch_size": 2**20 + 1}, "regenerate.batch_size: 1048577 is greater than the maximum of 1048576"),
    ({"request_timeout_s": 0.0001}, "regenerate.request_timeout_s: 0.0001 is less than the minimum of 0.001"),
    ({"request_timeout_s": "10"}, "regenerate.request_timeout_s: '10' is not of type 'number'; if given with "
     "--config: a mapping there reaches the workflow as text (Snakemake reads its items as strings): put the mapping "
     "in a --configfile"),
    ({"retries": -1}, "regenerate.retries: -1 is less than the minimum of 0"),
    ({"retries": 101}, "regenerate.retries: 101 is greater than the maximum of 100"),
    ({"enabled": "yes"}, "regenerate.enabled: 'yes' is not of type 'boolean'"),
    ({"complete_last_turn": 1}, "regenerate.complete_last_turn: 1 is not of type 'boolean'"),
    ({"drop_truncated": "no"}, "regenerate.drop_truncated: 'no' is not of type 'boolean'"),
    ({"send_seed": None}, "regenerate.send_seed: None is not of type 'boolean'"),
    ({"engine": "vllm"}, "regenerate.engine: 'vllm' is not one of ['transformers', 'sglang', None]"),
    ({"tool_turns": "drop"}, "regenerate.tool_turns: 'drop' is not one of ['keep', 'truncate']"),
    ({"stop_token_ids": []}, "regenerate.stop_token_ids: [] should be non-empty"),
    ({"stop_token_ids": [3, -1]}, "regenerate.stop_token_ids[1]: -1 is less than the minimum of 0"),
    ({"stop_token_ids": [3, True]}, "regenerate.stop_token_ids[1]: True is not of type 'integer'"),
    ({"stop_token_ids": 3}, "regenerate.stop_token_ids: 3 is not of type 'array', 'null'"),
    ({"think_start": ""}, "regenerate.think_start: '' should be non-empty"),
    ({"think_end": 5}, "regenerate.think_end: 5 is not of type 'string'"),
])
def test_bad_regenerate_values_are_refused_by_the_schema(section: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        from_config({"regenerate": section})
    assert str(e.value) == f"{message} (workflow/schemas/config.schema.yaml)"


@pytest.mark.parametrize(("config", "message"), [
    ({"regenerate": None}, "regenerate: None is not of type 'object'"),
    ({"prompts_per_chunk": 0}, "prompts_per_chunk: 0 is less than the minimum of 1"),
    ({"prompts_per_chunk": True}, "prompts_per_chunk: True is not of type 'integer'"),
    ({"seed": "5"}, "seed: '5' is not of type 'integer'"),
    ({"strict": "yes"}, "strict: 'yes' is not of type 'boolean'"),
    ({"chat_template_kwargs": ["thinking"]}, "chat_template_kwargs: ['thinking'] is not of type 'object'"),
])
def test_bad_run_keys_regeneration_reads_are_refused_by_the_schema(config: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        from_config(config)
    assert str(e.value) == f"{message} (workflow/schemas/config.schema.yaml)"


# ------------------------------------------------------------------------------------------------ sglang


class _FakeSGLang(BaseHTTPRequestHandler):
    """/generate: output_ids = a deterministic function of input_ids and the seed, then the first stop id.
    Modes (server.mode): "ok", "trim" (stop token left out, reported in finish_reason), "flaky" (one 503, whose
    request lives on in the server, as one a client timed out: SGLang 0.5.16 refuses its rid again with a 400)."""

    def do_POST(self):  # the name BaseHTTPRequestHandler dispatches POST to
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            srv.requests.append(body)
            duplicate = body.get("rid") in srv.live
            flaky = srv.mode == "flaky" and not srv.failed
            if flaky:
                srv.failed = True
                srv.live.add(body.get("rid"))
        if duplicate:  # tokenizer_manager.py: "Duplicate request ID detected", answered 400 (http_server.py)
            return self._send(400, {"error": {"message": f"Duplicate request ID detected: {body['rid']}"}})
        if srv.key is not None and self.headers.get("Authorization") != f"Bearer {srv.key}":
            return self._send(401, {"error": "Unauthorized"})  # as SGLang started with --api-key
        if self.path != "/generate" or "input_ids" not in body:
            return self._send(400, {"error": "bad request"})
        if flaky:
            return self._send(503, {"error": "busy"})
        ids, sp = body["input_ids"], body["sampling_params"]
        x = sum(ids) + sp.get("sampling_seed", 0) % 97
        out = [(x + 7 * i) % srv.vocab for i in range(3)]
        stop = sp["stop_token_ids"][0]
        out = [t for t in out if t not in sp["stop_token_ids"]]
        reason = {"type": "stop", "matched": stop}
        if srv.mode != "trim":
            out.append(stop)
        return self._send(200, {"text": "", "output_ids": out, "meta_info": {"finish_reason": reason}})

    def do_GET(self):  # /server_info as SGLang's: every server argument, the key included
        srv = self.server
        if srv.key is not None and self.headers.get("Authorization") != f"Bearer {srv.key}":
            return self._send(401, {"error": "Unauthorized"})
        if self.path != "/server_info" or srv.server_info is None:
            return self._send(404, {"detail": "Not Found"})
        return self._send(200, srv.server_info)

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def fake_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    srv.requests, srv.lock, srv.mode, srv.failed, srv.vocab, srv.key = [], threading.Lock(), "ok", False, 150, None
    srv.live = set()
    srv.server_info = {"enable_deterministic_inference": True, "api_key": None, "model_path": "/m"}
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_sglang_generator_against_a_fake_server(fake_server, tmp_path):
    tok = make_tok("deepseek_v3")
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    src = _write_jsonl(tmp_path / "in.jsonl", CONVS)
    cfg = {**_config(src, temperature=0.8, top_p=0.95, top_k=20, seed=3, max_new_tokens=9, retries=2),
           "engine": "sglang"}
    cfg["regenerate"]["server_url"] = url
    run_regenerate_chunk(from_config(cfg), 0, tmp_path / "a.jsonl", tokenizer=tok)
    stop = end_of_turn_ids(tok)
    reqs = list(fake_server.requests)
    assert len(reqs) == 2  # chunk 0 = d:4 (one turn), d:3 (tool-call turn kept, one turn generated)
    for r in reqs:
        sp = r["sampling_params"]
        assert {k: sp[k] for k in ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids")} == \
            {"max_new_tokens": 9, "temperature": 0.8, "top_p": 0.95, "top_k": 20, "stop_token_ids": stop}
        assert isinstance(sp["sampling_seed"], int) and r["rid"].startswith("regen-")
    # Each regenerated turn is the decoded fake output for exactly the rendered prompt.
    masker = ChatMasker(tok)
    by_prompt = {tuple(r["input_ids"]): r for r in reqs}
    for rec in _read_jsonl(tmp_path / "a.jsonl"):
        msgs = rec["messages"]
        for j, m in enumerate(msgs):
            if m["role"] != "assistant" or m.get("tool_calls"):  # tool-call turns are kept, not generated
                continue
            prompt = tok(masker.render(msgs[:j], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            r = by_prompt[tuple(prompt)]
            x = sum(prompt) + r["sampling_params"]["sampling_seed"] % 97
            want = [t for t in ((x + 7 * i) % 150 for i in range(3)) if t not in stop]
            assert m["content"] == tok.decode(want, skip_special_tokens=False)
    stats = json.loads(stats_path(tmp_path / "a.jsonl").read_text())
    assert stats["turns_hit_max_new_tokens"] == 0  # every fake output ends on the stop token

    # A server that trims the stop token from output_ids: finish_reason.matched puts it back.
    fake_server.mode = "trim"
    g = SGLangGenerator(url, regen_settings(retries=0), stop)
    (out,) = g.generate([[1, 2, 3]])
    assert out[-1] == stop[0]
    # A 503 is retried; a 4xx is not.
    fake_server.mode, fake_server.failed = "flaky", False
    n = len(fake_server.requests)
    with pytest.raises(EngineError, match=r"/generate failed for request regen-\S+ after 1 attempts: "
                                          r"POST /generate returned HTTP 503"):
        g.generate([[1, 2, 3]])
    fake_server.failed = False
    g2 = SGLangGenerator(url, regen_settings(retries=1), stop)
    assert g2.generate([[1, 2, 3]]) == [out]  # the retry under a rid of its own: no "Duplicate request ID"
    assert len(fake_server.requests) == n + 1 + 2
    assert [r["rid"][-3:] for r in fake_server.requests[-2:]] == ["-a0", "-a1"]
    bad = SGLangGenerator(url + "/nope", regen_settings(retries=3), stop)
    with pytest.raises(EngineError, match=r"/nope/generate answered 400 for request regen-"):
        bad.generate([[1]])


def test_seeds_go_only_to_a_server_that_uses_them(fake_server, capsys):
    """SGLang uses sampling_seed only with --enable-deterministic-inference: a server whose /server_info says it
    runs without is refused before any request (with a temperature above 0 and send_seed); one that does not say
    gets the seeds, with a warning; without seeds or sampling nothing is asked."""
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    fake_server.server_info["enable_deterministic_inference"] = False
    g = SGLangGenerator(url, regen_settings(temperature=0.7, retries=0), [5])
    with pytest.raises(EngineError) as e:
        g.generate([[1, 2, 3]])
    assert str(e.value) == (
        f"regenerate: the server at {url} ignores the per-request sampling_seed: SGLang uses it only when started "
        "with --enable-deterministic-inference (it then samples with its pytorch backend), so regenerate.seed would "
        "not decide what is sampled (temperature 0.7), how the server batches would. Restart the server with that "
        "flag, or set regenerate.send_seed: false to sample without seeds")
    assert fake_server.requests == []
    # no seeds to send (send_seed false, or greedy): nothing asked, the requests go out without a seed
    for s in (regen_settings(temperature=0.7, send_seed=False, retries=0), regen_settings(temperature=0.0, retries=0)):
        (out,) = SGLangGenerator(url, s, [5]).generate([[1, 2, 3]], seeds=[11])
        assert "sampling_seed" not in fake_server.requests[-1]["sampling_params"] and out[-1] == 5
    # a server that does not say: the seeds go, with a warning
    fake_server.server_info = None
    capsys.readouterr()
    SGLangGenerator(url, regen_settings(temperature=0.7, retries=0), [5]).generate([[1, 2, 3]], seeds=[11])
    assert fake_server.requests[-1]["sampling_params"]["sampling_seed"] == 11
    assert (f"WARNING: regenerate: cannot tell whether {url} uses the per-request sampling_seed (GET /server_info "
            "was refused with HTTP 404); SGLang uses it only when started with --enable-deterministic-inference"
            ) in capsys.readouterr().err


def test_a_regeneration_server_with_a_key_gets_it_from_its_key_file(fake_server, tmp_path):
    tok = make_tok("deepseek_v3")
    fake_server.key = "regen-key-0123456789abcdef"
    src = _write_jsonl(tmp_path / "in.jsonl", CONVS)
    cfg = {**_config(src, max_new_tokens=9, retries=0), "engine": "sglang"}
    cfg["regenerate"]["server_url"] = f"http://127.0.0.1:{fake_server.server_address[1]}"
    with pytest.raises(EngineError, match=r"/generate answered 401 for request regen-"):  # no key: refused
        run_regenerate_chunk(from_config(cfg), 0, tmp_path / "a.jsonl", tokenizer=tok)
    refused = len(fake_server.requests)
    key_file = tmp_path / "regen-key"
    key_file.write_text(fake_server.key + "\n")
    key_file.chmod(0o600)
    cfg["regenerate"]["api_key_file"] = str(key_file)
    run_regenerate_chunk(from_config(cfg), 0, tmp_path / "b.jsonl", tokenizer=tok)
    # chunk 0's two generated turns, accepted (the server refuses any request without the key)
    assert len(fake_server.requests) == refused + 2 and (tmp_path / "b.jsonl").is_file()
    key_file.chmod(0o644)
    with pytest.raises(ConfigError, match=rf"^regenerate.api_key_file: {key_file} has mode 0644: other users"):
        run_regenerate_chunk(from_config(cfg), 0, tmp_path / "c.jsonl", tokenizer=tok)


def test_regenerate_requests_are_never_dumped_by_the_plugin(tmp_path):
    # A patched server dumps hidden states for every rid with the plugin's prefix; regenerate may run on
    # the same server as extraction, so its rids must not carry that prefix.
    dumper = plugin.Dumper(plugin.PluginConfig(tmp_path, (1, 2)), pin=False)
    rids = [request_id([1, 2, 3], 7, 0), request_id([4], None, 12)]
    assert [r[:6] for r in rids] == ["regen-", "regen-"] and [dumper.accept(r) for r in rids] == [False, False]
    assert dumper.accept(f"{plugin.DEFAULT_RID_PREFIX}run-c00000-0a1b2c3d-x0-i0-a0")  # a capture rid is dumped


def test_default_transformers_engine_loads_model_and_tokenizer_from_a_directory(tmp_path):
    tok = make_tok("deepseek_v3")
    model = model_for(tok)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    src = _write_jsonl(tmp_path / "in.jsonl", CONVS)
    raw = {**_config(src), "model": str(tmp_path / "model")}
    cfg = from_config(raw)
    st = run_regenerate_chunk(cfg, 2, tmp_path / "a.jsonl")  # generator and tokenizer from the settings
    run_regenerate_chunk(cfg, 2, tmp_path / "b.jsonl", tokenizer=tok,
                         generator=TransformersGenerator(model, cfg.regenerate, end_of_turn_ids(tok)))
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert st["turns_regenerated"] == 2 and st["settings"]["stop_token_ids"] == [tok.eos_token_id]
    with pytest.raises(ConfigError, match="`regenerate.server_url` must be set"):
        run_regenerate_chunk(from_config({**raw, "engine": "sglang"}), 2, tmp_path / "c.jsonl", tokenizer=tok)
    # and at parse time, before any job (the workflow's checks)
    from hsextract.config.checks import check_engine

    for engines in ({"engine": "sglang"}, {"regenerate": {**raw["regenerate"], "engine": "sglang"}}):
        with pytest.raises(ConfigError) as e:
            check_engine(from_config({**raw, **engines}))
        assert str(e.value) == ("config key `regenerate.server_url` must be set (http://host:port of the SGLang "
                                "server) when regeneration runs on the sglang engine")


def test_config_readme_gives_the_schemas_regenerate_defaults():
    import re

    import yaml

    from hsextract.config.settings import schema

    readme = (Path(__file__).resolve().parents[1] / "config/README.md").read_text()
    documented = {}
    for keys, defaults in re.findall(r"^\| (`regenerate\.[^|]+) \| ([^|]+) \|", readme, re.M):
        names = [k.strip(" `").removeprefix("regenerate.") for k in keys.split(" / ")]
        values = [yaml.safe_load(v.strip(" `")) for v in defaults.split(" / ")]
        documented.update(zip(names, values, strict=True))
    props = schema()["properties"]["regenerate"]["properties"]
    assert documented == {key: prop["default"] for key, prop in props.items()}


def test_a_stop_token_id_outside_the_vocabulary_is_refused(tmp_path):
    """An id the model never generates: every turn would run to max_new_tokens (junk, behind a warning)."""
    tok = make_tok("deepseek_v3")
    src = _write_jsonl(tmp_path / "in.jsonl", [CONVS[0]])
    cfg = from_config(_config(src, stop_token_ids=[3, len(tok), 999_999]))
    with pytest.raises(ConfigError) as e:
        run_regenerate_chunk(cfg, 0, _chunk_paths(tmp_path, 1)[0], tokenizer=tok, generator=Scripted(tok, ["x"]))
    assert str(e.value) == (
        f"regenerate.stop_token_ids: [{len(tok)}, 999999] are not in the tokenizer's vocabulary (ids 0.."
        f"{len(tok) - 1}), so no generation would stop there; give the ids of the tokens that end a turn (or leave "
        "the key out: the template's are found)")


def test_a_conversation_opening_with_an_assistant_turn_is_refused_saying_why(tmp_path):
    tok = make_tok("deepseek_v3")
    src = _write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "assistant", "content": "Welcome!"},
                                                              {"role": "user", "content": "Hi."}]}])
    cfg = from_config(_config(src))
    with pytest.raises(ConfigError) as e:
        run_regenerate_chunk(cfg, 0, _chunk_paths(tmp_path, 1)[0], tokenizer=tok, generator=Scripted(tok, ["A."]))
    assert str(e.value) == (
        f"{src}:1: regenerate: the context of messages[0]: messages[0] is an assistant turn: nothing comes before "
        "it for the model to have answered (a conversation opens with a user or system message). Remove the "
        "opening assistant message, or set `strict: false` to drop such records")


def test_weight_zero_stays_on_the_turns_kept_as_they_were():
    """`weight: 0` marks a turn of the input as not to train: a turn regenerated is the target's own and trained; a
    tool-call turn kept word for word (tool_turns: keep) stays untrained, written back with its weight."""
    from hsextract.prepare.conversations import normalize_record
    from hsextract.regenerate.files import record

    tok = make_tok("deepseek_v3")
    msgs = [dict(m) for m in CONVS[3]["messages"]]
    msgs[1]["weight"] = msgs[3]["weight"] = 0
    conv = normalize_record({"messages": msgs})
    assert conv.untrained == frozenset({1, 3})
    (out,) = regenerate_chunk([conv], Scripted(tok, ["It is warm."]), regen_settings(max_new_tokens=6),
                              tokenizer=tok, sample_ids=["w"])
    assert out.messages[3]["content"] == "It is warm." and out.untrained == frozenset({1})
    rec = record("w", "d", out)
    assert [m.get("weight") for m in rec["messages"]] == [None, 0, None, None]
    assert normalize_record(json.loads(json.dumps(rec))).untrained == frozenset({1})
