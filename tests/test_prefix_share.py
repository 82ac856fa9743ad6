"""Shared prefixes end to end on the CPU (docs/SHARED_PREFIX.md): prepare's parents (hsextract.prepare.prefix_share),
the `share_prefixes` key, and extract with the transformers engine writing a version-2 shard whose samples read back as
the flat run's: reused rows equal to the parent's tensor for tensor, computed rows within the dense bound of an
independent full forward."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from chatfix import make_tokenizer
from conftest import shard_metadata

from hsextract.config.settings import from_config
from hsextract.errors import ConfigError
from hsextract.extract.run import ChunkPrompts, extract_chunk, read_prompts
from hsextract.prepare.prefix_share import MIN_PREFIX, distinct_tokens, find_parents
from hsextract.prepare.run import SCHEMA, SHARED_SCHEMA, run_prepare
from hsextract.shard import ShardReader

CONVERSATIONS = Path(__file__).resolve().parents[1] / "data" / "conversations.jsonl"
TOL = 1e-2  # tests/test_transformers_suffix.py: measured 0.0 on this model


def test_parents_are_the_longest_earlier_prefix_within_the_chunk() -> None:
    tools = list(range(1000, 1100))  # a 100-token declaration two records open with
    turn1 = tools + list(range(1, 60))
    turn2 = turn1[:130] + list(range(200, 250))  # the next turn of the same record: history, then its own
    other = tools + list(range(300, 340))  # another record, same declaration
    short = list(range(1000, 1030)) + [5] * 40  # 30 tokens in common only: below MIN_PREFIX
    dup = list(other)  # a repeat: it must still compute one token of its own
    tail_ = turn2 + [7]  # extends turn2, and shares 100 tokens with everything else
    ids = [turn1, turn2, other, short, dup, tail_]
    refs = find_parents(ids, records=[0, 0, 1, 2, 3, 4])
    # `other` shares the declaration with turn1 and turn2 alike: the shallower one (turn1, no reference above it)
    assert refs == [(-1, 0), (0, 130), (0, 100), (-1, 0), (2, len(other) - 1), (1, len(turn2))]
    assert MIN_PREFIX == 64
    assert distinct_tokens([len(x) for x in ids], refs) == sum(map(len, ids)) - 130 - 100 - 139 - 180
    # ties go to the shallower sample, then the later: samples that open alike hang from the first of them
    # (depth 1 each) instead of from one another; the previous turn is a candidate below a whole block too
    assert find_parents([tools, tools + [1], tools + [2], tools + [3]]) == [(-1, 0), (0, 100), (0, 100), (0, 100)]
    assert find_parents([list(range(70)), list(range(70)) + [9]], records=[0, 0], min_prefix=10) == [(-1, 0),
                                                                                                     (0, 70)]


def test_references_never_nest_deeper_than_a_reader_walks() -> None:
    """A conversation of more turns than MAX_REFERENCE_DEPTH starts a new chain there; the writer and the reader
    refuse a deeper one (tests/test_hostile_shard.py)."""
    from hsextract.shard.format import MAX_REFERENCE_DEPTH as D

    turns = [list(range(100 + 2 * t)) for t in range(D + 3)]  # each turn: the last one's ids, then two more
    refs = find_parents(turns, records=[0] * len(turns))
    depth = []
    for p, _ in refs:
        depth.append(0 if p < 0 else depth[p] + 1)
    assert max(depth) == D and refs[D] == (D - 1, 100 + 2 * (D - 1))
    # the turn past the limit takes its prefix from the first turn that holds it whole (the same rows), not its
    # previous turn, which is D deep
    assert refs[D + 1][0] != D and depth[D + 1] < D and refs[D + 1][1] >= MIN_PREFIX
    # conversations that open alike: each hangs from the first, whatever their number
    opening = list(range(5000, 5100))
    many = [opening + [k] for k in range(2 * D)]
    assert {p for p, _ in find_parents(many)[1:]} == {0}


def _system_conversations(n: int) -> list[dict]:
    """Multi-turn conversations with reasoning (the Qwen3-style template drops it from history: one sample per
    turn) that open with one long system prompt."""
    rules = " ".join(f"rule {k}: answer briefly and check the units." for k in range(12))
    system = {"role": "system", "content": rules}
    out = []
    for c in range(n):
        msgs = [system]
        for t in range(3):
            msgs += [{"role": "user", "content": f"Question {c}.{t}: what is {c} plus {t}?"},
                     {"role": "assistant", "content": f"It is {c + t}.", "reasoning_content": f"Add {c} and {t}."}]
        out.append({"messages": msgs})
    return out


def test_prepare_records_parents_only_with_share_prefixes(tmp_path: Path) -> None:
    convs = _system_conversations(4)
    for name, part in (("a", convs[:3]), ("b", convs[3:])):  # a chunk of both: b's sample takes a's prefix
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in part))
    tok = make_tokenizer("qwen3")

    def prepare(out: str, **kw: object) -> dict:
        cfg = from_config({"sources": [{"path": str(tmp_path / f"{n}.jsonl"), "name": n} for n in "ab"], "seed": 1,
                           "prompts_per_chunk": 2, **kw}).prepare
        summary = run_prepare(cfg, tok, tmp_path / out, 2)
        assert json.loads((tmp_path / out / "summary.json").read_text()) == json.loads(json.dumps(summary))
        return summary

    flat = prepare("flat", share_prefixes=False)
    shared = prepare("shared")  # the default
    for entry in [flat, *flat["per_source"].values(), *flat["per_chunk"]]:  # sharing off: the summary as before
        assert "distinct_tokens" not in entry and "shared_samples" not in entry
    assert shared["kept"] == flat["kept"] == 12 and shared["tokens"] == flat["tokens"]
    assert shared["settings"]["share_prefixes"] is True and flat["settings"]["share_prefixes"] is False
    expected = {"total": [0, 0], "a": [0, 0], "b": [0, 0]}  # distinct tokens, shared samples
    for k in range(2):
        a = pq.read_table(tmp_path / "flat" / f"chunk-{k:05d}.parquet")
        b = pq.read_table(tmp_path / "shared" / f"chunk-{k:05d}.parquet")
        assert a.schema.equals(SCHEMA) and b.schema.equals(SHARED_SCHEMA)
        assert b.select(list(SCHEMA.names)).equals(a)  # the same rows, two more columns
        rows = b.to_pylist()
        refs = [(r["parent"], r["prefix_len"]) for r in rows]
        assert refs == find_parents([r["input_ids"] for r in rows], [r["sample_id"].split(":t")[0] for r in rows])
        assert refs[0] == (-1, 0) and all(p >= 0 for p, _ in refs[1:])  # one system prompt, then turns
        for r, (p, k_) in zip(rows, refs, strict=True):
            if p >= 0:
                assert k_ >= MIN_PREFIX and r["input_ids"][:k_] == rows[p]["input_ids"][:k_]
        chunk = read_prompts(tmp_path / "shared" / f"chunk-{k:05d}.parquet")
        assert list(zip(chunk.parents or [], chunk.prefix_lens or [], strict=True)) == refs
        assert read_prompts(tmp_path / "flat" / f"chunk-{k:05d}.parquet").parents is None
        # counted here from the columns: each row's ids less the prefix it takes; rows with a parent
        own = [len(r["input_ids"]) - r["prefix_len"] for r in rows]
        assert [shared["per_chunk"][k][key] for key in ("distinct_tokens", "shared_samples")] == [
            sum(own), sum(r["parent"] >= 0 for r in rows)]
        for r, n in zip(rows, own, strict=True):
            for key in ("total", r["source"]):
                expected[key][0] += n
                expected[key][1] += r["parent"] >= 0
    assert [shared["distinct_tokens"], shared["shared_samples"]] == expected["total"] == [
        sum(c["distinct_tokens"] for c in shared["per_chunk"]), 10]
    assert shared["distinct_tokens"] < 0.6 * shared["tokens"]
    for name in "ab":
        st = shared["per_source"][name]
        assert [st["distinct_tokens"], st["shared_samples"]] == expected[name]
        assert 0 < st["distinct_tokens"] < st["tokens"] == flat["per_source"][name]["tokens"]
    assert shared["per_source"]["b"]["shared_samples"] == 3  # its first sample's prefix is a's system prompt


def test_share_prefixes_with_the_sglang_engine_and_the_retired_opt_in_key() -> None:
    """The SGLang path ran on a GPU (bench/README.md), so share_prefixes alone turns it on; the opt-in key it
    needed before is refused with why it went."""
    from hsextract.config.checks import check_engine

    on = from_config({"engine": "sglang"})  # the default since the production command ran with it
    check_engine(on)
    assert on.extract.share_prefixes is True and from_config({"share_prefixes": False}).extract.share_prefixes is False
    from hsextract.sglang.config import server_config_from

    assert server_config_from(on.extract, python="python3").share_prefixes is True
    with pytest.raises(ConfigError) as e:
        from_config({"engine": "sglang", "sglang": {"share_prefixes_untested_on_gpu": True}})
    assert str(e.value) == (
        "sglang.share_prefixes_untested_on_gpu: removed; share_prefixes alone decides, with either engine: the "
        "SGLang path ran on a GPU (bench/README.md, SGLang shared prefixes); remove the key "
        "(workflow/schemas/config.schema.yaml)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hsextract.tinymodel.build import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", CONVERSATIONS, num_hidden_layers=4,
                           hidden_size=128)


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> dict:
    """A chunk of per-turn samples and a shared opening, extracted flat and shared on the tiny model."""
    from transformers import AutoTokenizer

    from hsextract.engines.base import CaptureSpec
    from hsextract.engines.transformers_engine import TransformersEngine

    tmp_path = tmp_path_factory.mktemp("extract")
    tok = AutoTokenizer.from_pretrained(tiny)
    convs = [tok.apply_chat_template(json.loads(line)["messages"], return_dict=False)
             for line in CONVERSATIONS.read_text(encoding="utf-8").splitlines()[:5]]
    head = convs[0][:90]
    ids = [head + convs[1][:40], head + convs[1][:40] + convs[2][:50], head + convs[3][:30], convs[4][:70]]
    ids.append(ids[1] + convs[2][50:90])
    refs = find_parents(ids, records=[0, 0, 1, 2, 0])
    assert [p for p, _ in refs] == [-1, 0, 0, -1, 1]  # 2 shares the head with 0 and 1 alike: the shallower
    masks = [[0] * (len(x) - 5) + [1] * 5 for x in ids]
    sids = [f"s{k}" for k in range(len(ids))]
    meta = shard_metadata(hidden_size=128, aux_layers=[1, 3], final_state="post_norm", vocab_size=tok.vocab_size,
                          layer_convention="hidden_states")
    spec = CaptureSpec((1, 3), "post_norm")
    out = {}
    with TransformersEngine(tiny, spec, token_budget=512) as eng:
        for name, prompts in (("flat", ChunkPrompts(sids, ids, masks)),
                              ("shared", ChunkPrompts(sids, ids, masks, [p for p, _ in refs], [k for _, k in refs]))):
            t = time.perf_counter()
            out[name] = extract_chunk(prompts, tmp_path / f"{name}.hss", eng, meta | {"chunk": len(out)},
                                      progress=False)
            out[name]["wall_s"] = time.perf_counter() - t
    return {"dir": tmp_path, "ids": ids, "refs": refs, "out": out, "model": tiny}


def test_extract_stores_and_computes_each_shared_prefix_once(extracted: dict) -> None:
    """The shared shard is version 2, stores and computes the distinct tokens only, and every sample reads back as
    the flat one (rows it takes from its parent equal to the parent's, bit for bit; all rows within the bound of the
    flat run's independent forward)."""
    tmp_path, ids, refs, out = extracted["dir"], extracted["ids"], extracted["refs"], extracted["out"]
    flat, shared = ShardReader(tmp_path / "flat.hss"), ShardReader(tmp_path / "shared.hss")
    distinct = distinct_tokens([len(x) for x in ids], refs)
    assert (flat.metadata["format_version"], shared.metadata["format_version"]) == (1, 2)
    assert out["flat"]["computed_tokens"] == flat.stored_tokens == out["flat"]["tokens"] == sum(map(len, ids))
    assert out["shared"]["computed_tokens"] == shared.stored_tokens == distinct < 0.6 * sum(map(len, ids))
    assert out["shared"]["bytes"] < 0.7 * out["flat"]["bytes"]
    for s in out.values():  # the chunk's own time (a sample's first row once shadowed its start time)
        assert 0 < s["seconds"] <= s["wall_s"] + 1e-3  # rounded to ms
        assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["seconds"], rel=0.05)  # seconds rounded to ms
        assert s["computed_tokens_per_s"] == pytest.approx(s["computed_tokens"] / s["seconds"], rel=0.05)
    assert (shared.parents, shared.prefix_lens) == ([p for p, _ in refs], [k for _, k in refs])
    for i, (p, k) in enumerate(refs):
        a, b = flat[i], shared[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for j, (ta, tb) in enumerate(zip(a["hidden_states"], b["hidden_states"], strict=True)):
            assert ta.shape == tb.shape and tb.dtype == torch.bfloat16
            assert ((ta.float() - tb.float()).norm() / ta.float().norm()).item() <= TOL
            if p >= 0:  # the reused rows are the parent's stored rows
                assert torch.equal(tb[:k], shared[p]["hidden_states"][j][:k])
    shared.verify()


def test_stats_inspect_validate_manifest_and_report_count_distinct_tokens(extracted: dict, tmp_path: Path) -> None:
    """docs/SHARED_PREFIX.md, "What is reported": chunk stats, the aggregate tables, inspect, validate and
    dataset.json give materialized and distinct tokens and their ratio, exactly; a dataset of a version-1 and a
    version-2 shard is one dataset (a chunk without references is written as version 1)."""
    from hsextract.prepare.vocab import save_token_freq
    from hsextract.report.manifest import build_manifest
    from hsextract.report.stats import ChunkTotals, chunk_stats
    from hsextract.report.tables import table_html
    from hsextract.report.validate import validate_shard
    from hsextract.shard.inspect import format_info, shard_info

    d, ids, refs = extracted["dir"], extracted["ids"], extracted["refs"]
    tokens, distinct = sum(map(len, ids)), distinct_tokens([len(x) for x in ids], refs)
    assert [k for _, k in refs] == [0, 130, 94, 0, 180]  # sample 2 shares 4 template tokens past the 90-token head
    assert (tokens, distinct) == (720, 720 - 130 - 94 - 180)
    paths = [d / "flat.hss", d / "shared.hss"]
    stats = [chunk_stats(p) for p in paths]
    assert [(s["format_version"], s["tokens"], s["stored_tokens"]) for s in stats] == [(1, tokens, tokens),
                                                                                        (2, tokens, distinct)]
    tables = ChunkTotals(stats).tables({})
    summary = dict(zip(tables["summary"]["metric"], tables["summary"]["value"], strict=True))
    assert (summary["tokens"], summary["stored_tokens"], summary["share_saving"]) == (
        2 * tokens, tokens + distinct, round(2 * tokens / (tokens + distinct), 4))
    assert list(tables["chunks"]["stored_tokens"]) == [tokens, distinct]
    assert "<td>stored_tokens</td><td class=\"num\">1,036</td>" in table_html(tables["summary"])
    # the codec's ratio apart from the sharing: stored bytes over the raw bytes of what is stored (ids and mask of
    # every token, 16 B; the hidden rows of the stored tokens, 3 tensors x 128 x 2 B)
    raw_of = [16 * tokens + 768 * tokens, 16 * tokens + 768 * distinct]
    assert [s["bytes_raw_stored"] for s in stats] == raw_of and stats[0]["bytes_raw"] == raw_of[0]
    size = [p.stat().st_size for p in paths]
    assert list(tables["chunks"]["codec_ratio"]) == [round(n / r, 4) for n, r in zip(size, raw_of, strict=True)]
    assert list(tables["chunks"]["stored_over_raw"]) == [round(n / raw_of[0], 4) for n in size]
    assert summary["codec_ratio"] == round(sum(size) / sum(raw_of), 4)
    older = [{k: v for k, v in s.items() if k != "bytes_raw_stored"} for s in stats]  # an earlier release's stats
    old = ChunkTotals(older).tables({})
    assert list(old["chunks"]["codec_ratio"].isna()) == [False, True]
    assert dict(zip(old["summary"]["metric"], old["summary"]["value"], strict=True))["codec_ratio"] is None

    info = shard_info(paths[1], samples=True)
    assert (info["format_version"], info["num_tokens"], info["distinct_tokens"], info["shared_samples"]) == (
        2, tokens, distinct, 3)
    assert [(s["parent"], s["prefix_len"]) for s in info["samples"]] == refs
    text = format_info(info).splitlines()
    assert ("samples        5 (3 take a prefix from an earlier one; that their ids equal it over the prefix is "
            "checked by `hsextract validate`, not here)") in text
    assert f"tokens         {tokens} materialized, {distinct} distinct (stored)" in text
    assert info["codec_ratio"] == round(size[1] / raw_of[1], 4)
    assert (f"codec ratio    {info['codec_ratio']:.4f} (stored over the raw bytes of what is stored: each shared "
            "prefix once)") in text

    reference = ShardReader(paths[0])[0]
    reports, stat_files = [], []
    for k, (p, s) in enumerate(zip(paths, stats, strict=True)):
        report = validate_shard(p, reference, report_path=tmp_path / f"v{k}.json")
        assert report["passed"] and (report["num_tokens"], report["distinct_tokens"]) == (tokens, s["stored_tokens"])
        reports.append(tmp_path / f"v{k}.json")
        stat_files.append(tmp_path / f"s{k}.json")
        stat_files[-1].write_text(json.dumps(s))
    (tmp_path / "summary.json").write_text(json.dumps({"read": 6, "tokens": 2 * tokens}))
    save_token_freq(ChunkTotals(stats).token_freq(), tmp_path / "token_freq.pt")
    settings = from_config({"model": str(extracted["model"]), "capture": "custom", "aux_layers": [1, 3],
                            "aux_layers_convention": "hidden_states", "final_state": "post_norm"})
    manifest = build_manifest(settings, shards=paths, validation=reports, chunk_stats=stat_files, prompts=None,
                              prepare_summary=tmp_path / "summary.json", token_freq=tmp_path / "token_freq.pt",
                              out_path=tmp_path / "dataset.json")
    counts = manifest["counts"]
    assert (counts["tokens"], counts["distinct_tokens"], counts["share_saving"]) == (
        2 * tokens, tokens + distinct, round(2 * tokens / (tokens + distinct), 4))
    assert counts["codec_ratio"] == summary["codec_ratio"]
    from hsextract import open_dataset

    meta = open_dataset(paths).metadata  # the reader says the versions as dataset.json does
    assert (meta["format_version"], meta["format_versions"]) == (2, [1, 2])
    assert (manifest["shard_format_version"], manifest["shard_format_versions"]) == (2, [1, 2])
    assert [(e["format_version"], e["tokens"], e["distinct_tokens"]) for e in manifest["shards"]] == [
        (1, tokens, tokens), (2, tokens, distinct)]
