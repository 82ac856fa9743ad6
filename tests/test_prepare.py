"""The prepare stage end to end on small JSONL sources with a locally trained tokenizer."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pyarrow.parquet as pq
import pytest
import torch
from chatfix import make_tokenizer

from hsextract.config.settings import from_config
from hsextract.errors import ConfigError
from hsextract.masks.masker import ChatMasker
from hsextract.masks.refusals import TemplateError
from hsextract.prepare.conversations import Conversation, MalformedRecordError
from hsextract.prepare.run import SCHEMA, num_chunks, run_prepare
from hsextract.provenance import sha256_file


def conv(q, a):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


RECORDS = [
    conv("Hello there!", "How are you today?"),
    conv("What is two plus two?", "Two plus two is four."),
    conv("Hello there!", "How are you today?"),  # duplicate of record 0
    {"messages": [{"role": "user", "content": "Only a question?"}]},  # nothing to train
    conv("What is the weather in Paris?", "The weather in Paris is sunny and warm. " * 4),  # long
]


def _write(tmp_path, lines):
    p = tmp_path / "data.jsonl"
    p.write_bytes(b"".join(x if isinstance(x, bytes) else (json.dumps(x) + "\n").encode() for x in lines))
    return p


def _cfg(path, **kw):  # the flat layout's columns (share_prefixes' two more: tests/test_prefix_share.py)
    return from_config({"sources": [{"path": str(path), "name": "d"}], "seed": 3, "prompts_per_chunk": 2,
                        "share_prefixes": False, **kw}).prepare


def _rows(out, n):
    rows = []
    for k in range(n):
        t = pq.read_table(out / f"chunk-{k:05d}.parquet")
        assert t.schema.equals(SCHEMA)
        rows.append(t.to_pylist())
    return rows


def test_chunks_filters_and_summary(tmp_path):
    src = _write(tmp_path, RECORDS + [b"{not json\n"])
    cfg = _cfg(src, max_seq_len=30, truncate=False, strict=False)
    assert num_chunks(cfg) == 3
    tok = make_tokenizer("llama3")
    summary = run_prepare(cfg, tok, tmp_path / "out", 3)
    chunks = _rows(tmp_path / "out", 3)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "chunk-00000.parquet", "chunk-00001.parquet", "chunk-00002.parquet", "summary.json", "token_freq.pt"]
    kept = [r for c in chunks for r in c]
    # d:0 and d:2 are the same conversation: the first one in mixture order (seed 3: d:2) is kept.
    assert sorted(r["sample_id"] for r in kept) == ["d:1", "d:2"]
    masker = ChatMasker(tok)
    for r in kept:
        i = int(r["sample_id"].split(":")[1])
        (want,) = masker.encode(Conversation(RECORDS[i]["messages"]))
        assert r["input_ids"] == want.input_ids and r["loss_mask"] == want.loss_mask
        assert r["num_tokens"] == len(want.input_ids) and r["num_trained"] == sum(want.loss_mask)
        assert r["source"] == "d"
    assert summary["read"] == 6 and summary["kept"] == 2
    assert summary["dropped"] == {"bad_json": 1, "duplicate": 1, "no_trained_tokens": 1, "too_long": 1}
    assert summary["tokens"] == sum(r["num_tokens"] for r in kept)
    assert summary["trained_tokens"] == sum(r["num_trained"] for r in kept)
    assert summary["per_source"]["d"]["kept"] == 2
    assert [c["records"] for c in summary["per_chunk"]] == [2, 2, 2]
    assert [c["rows"] for c in summary["per_chunk"]] == [len(c) for c in chunks]
    assert [c["sha256"] for c in summary["per_chunk"]] == [  # what extract compares its prompts file with
        sha256_file(tmp_path / "out" / f"chunk-{k:05d}.parquet") for k in range(3)]
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (written["dropped_records"], written["dropped_samples"]) == (2, 2)  # bad_json, duplicate; the filters'
    # the data itself, for dataset.json's provenance (a source edited in place later no longer matches)
    assert written["source_files"] == {"d": {"path": str(src), "sha256": hashlib.sha256(src.read_bytes()).hexdigest()}}
    trained = Counter(t for c in chunks for row in c
                      for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m)
    assert torch.load(tmp_path / "out" / "token_freq.pt", weights_only=True) == dict(trained)
    # Same seed, same chunks; the mixture order decides which chunk a record lands in.
    run_prepare(cfg, tok, tmp_path / "again", 3)
    assert _rows(tmp_path / "again", 3) == chunks


def test_fewer_chunks_than_before_removes_the_earlier_chunks_prompts(tmp_path, capsys):
    """A run of 3 chunks, then of 1 in the same folder: chunks 1 and 2's prompts go, one line each; the rest stays."""
    src = _write(tmp_path, RECORDS)
    tok = make_tokenizer("llama3")
    out = tmp_path / "out"
    run_prepare(_cfg(src, strict=False, max_seq_len=30), tok, out, 3)
    (out / "chunk-00001.parquet.keep").write_text("not a chunk's file")
    capsys.readouterr()
    run_prepare(_cfg(src, strict=False, max_seq_len=30, prompts_per_chunk=5), tok, out, 1)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("removed ")]
    assert lines == [f"removed {out / f'chunk-0000{k}.parquet'}: chunk {k} of an earlier configuration (now 1 chunks)"
                     for k in (1, 2)]
    assert sorted(p.name for p in out.iterdir()) == [
        "chunk-00000.parquet", "chunk-00001.parquet.keep", "summary.json", "token_freq.pt"]


def test_truncation_inside_an_assistant_turn(tmp_path):
    src = _write(tmp_path, [RECORDS[4]])
    tok = make_tokenizer("llama3")
    (full,) = ChatMasker(tok).encode(Conversation(RECORDS[4]["messages"]))
    first_trained = full.loss_mask.index(1)
    cut = first_trained + 5  # inside the answer
    summary = run_prepare(_cfg(src, max_seq_len=cut, truncate=True), tok, tmp_path / "out", 1)
    (row,) = _rows(tmp_path / "out", 1)[0]
    assert row["input_ids"] == full.input_ids[:cut] and row["loss_mask"] == full.loss_mask[:cut]
    assert row["loss_mask"][-5:] == [1] * 5 and row["num_trained"] == 5
    assert summary["truncated"] == 1 and summary["dropped"] == {}
    # a cut that leaves fewer than min_trained_tokens: dropped under its own reason, not also counted as truncated
    with pytest.raises(ConfigError) as e:  # nothing kept: said by reason
        run_prepare(_cfg(src, max_seq_len=cut, truncate=True, min_trained_tokens=6), tok, tmp_path / "none", 1)
    assert str(e.value) == (
        "prepare kept no sample of the 1 records read (dropped: truncated_untrained 1): config/README.md says what "
        "each reason means (filters drop whatever `strict` says; a malformed record or a template's refusal stops a "
        "strict run, naming it)")
    # beside one that fits (23 tokens, 8 trained): kept, and the cut one counted once, as truncated_untrained
    short = _write(tmp_path, [RECORDS[4], conv("Hi", "Yes it is.")])
    summary = run_prepare(_cfg(short, max_seq_len=cut, truncate=True, min_trained_tokens=6), tok, tmp_path / "few", 1)
    assert (summary["kept"], summary["truncated"], summary["dropped"]) == (1, 0, {"truncated_untrained": 1})


def test_strict_raises_with_location_and_chunk_count_mismatch(tmp_path):
    src = _write(tmp_path, [RECORDS[0], b'{"messages": [{"role": "robot", "content": "x"}]}\n'])
    tok = make_tokenizer("qwen3")
    with pytest.raises(MalformedRecordError, match=rf"{src}:2: malformed record \(unknown_role\)"):
        run_prepare(_cfg(src), tok, tmp_path / "out", 1)
    with pytest.raises(ConfigError, match="num_chunks is 2 but the sources now hold 2 records = 1 chunks of 2"):
        run_prepare(_cfg(src), tok, tmp_path / "out", 2)


def test_tokenizer_from_a_directory(tmp_path):
    tok = make_tokenizer("qwen3")
    tok.save_pretrained(tmp_path / "tok")
    src = _write(tmp_path, RECORDS[:2])
    run_prepare(_cfg(src), str(tmp_path / "tok"), tmp_path / "a", 1)
    run_prepare(_cfg(src), tok, tmp_path / "b", 1)
    assert _rows(tmp_path / "a", 1) == _rows(tmp_path / "b", 1)


def test_progress_bar_on_a_terminal_only(tmp_path, monkeypatch):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    src = _write(tmp_path, [RECORDS[4]])
    tok = make_tokenizer("llama3")
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    run_prepare(_cfg(src), tok, tmp_path / "a", 1)
    assert log.getvalue() == ""
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    run_prepare(_cfg(src), tok, tmp_path / "b", 1)
    assert "\rprepare:   0%|          | 0/1 [" in tty.getvalue()


def _multi(reasoning=True):
    a1 = {"role": "assistant", "content": "How are you today?"}
    a2 = {"role": "assistant", "content": "Two plus two is four."}
    if reasoning:
        a1["reasoning_content"], a2["reasoning_content"] = "The user greets.", "Add them."
    return {"messages": [{"role": "user", "content": "Hello there!"}, a1,
                         {"role": "user", "content": "What is two plus two?"}, a2]}


def test_split_turns_rows_ids_and_counters(tmp_path):
    src = _write(tmp_path, [_multi(), conv("Hello there!", "How are you today?")])
    tok = make_tokenizer("qwen3")
    summary = run_prepare(_cfg(src, prompts_per_chunk=4), tok, tmp_path / "out", 1)
    (rows,) = _rows(tmp_path / "out", 1)
    # The Qwen3-style template drops the first turn's reasoning once a later query exists: one row per turn.
    assert sorted(r["sample_id"] for r in rows) == ["d:0:t1", "d:0:t3", "d:1"]
    want = ChatMasker(tok).encode(Conversation(_multi()["messages"]))
    by_id = {r["sample_id"]: r for r in rows}
    for s in want:
        assert by_id[f"d:0:t{s.turn}"]["input_ids"] == s.input_ids
        assert by_id[f"d:0:t{s.turn}"]["loss_mask"] == s.loss_mask
    assert summary["read"] == 2 and summary["kept"] == 3
    assert summary["masks"] == {"conversations": 2, "samples": 3, "split_conversations": 1, "turns": 3}
    never = run_prepare(_cfg(src, prompts_per_chunk=4, split_turns="never"), tok, tmp_path / "never", 1)
    assert never["kept"] == 2 and never["masks"]["turns_history_fallback"] == 1
    with pytest.raises(ConfigError,
                       match=r"split_turns: 'yes' is not one of \['auto', 'never', 'always'\] \(workflow/schemas/"):
        run_prepare(_cfg(src, split_turns="yes"), tok, tmp_path / "bad", 1)


def test_not_prefix_stable_dropped_and_counted(tmp_path):
    src = _write(tmp_path, [_multi(), _multi(reasoning=False)])
    tok = make_tokenizer("qwen3")
    kw = {"prompts_per_chunk": 4, "chat_template_kwargs": {"enable_thinking": False}}
    with pytest.raises(ConfigError, match=rf"{src}:1: assistant turn 1: the template is not prefix-stable"):
        run_prepare(_cfg(src, **kw), tok, tmp_path / "strict", 1)
    summary = run_prepare(_cfg(src, strict=False, **kw), tok, tmp_path / "out", 1)
    assert summary["dropped"] == {"not_prefix_stable": 1}
    assert summary["kept"] == 2  # the record without reasoning, split into its two turns


def test_an_error_inside_the_chat_template_is_named_as_the_templates(tmp_path):
    tool = {"messages": [{"role": "user", "content": "What is the weather in Paris?"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                         {"role": "tool", "content": "21", "tool_call_id": "c1"},
                         {"role": "assistant", "content": "Sunny."}]}
    src = _write(tmp_path, [tool])
    tok = make_tokenizer("qwen3")
    tok.chat_template = (  # reads a tool message's name, which this record does not give
        "{%- for m in messages -%}{%- if m.role == 'tool' -%}{{ '<|im_start|>tool ' + m.name + '\n' + m.content }}"
        "{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content }}{{ m.tool_calls | tojson if m.tool_calls }}{%- endif -%}"
        "<|im_end|>\n{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
    with pytest.raises(ConfigError) as e:
        run_prepare(_cfg(src, prompts_per_chunk=4), tok, tmp_path / "out", 1)
    assert str(e.value) == (f"{src}:1: the chat template failed on it (UndefinedError: 'dict object' has no "
                            "attribute 'name'); a field it reads may be missing from the record (a tool message's "
                            "name, a tool call's id) or hold another type (or set `strict: false` to drop such "
                            "records, counted as template_error)")


def test_a_template_joining_tool_call_arguments_as_a_string_is_named_and_counted(tmp_path):
    from test_loss_mask_families import CONCATENATING_TEMPLATE, STRING_ARGUMENTS

    call = {"messages": [{"role": "user", "content": "What is the weather in Paris?"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                         {"role": "tool", "content": "21", "tool_call_id": "c1"},
                         {"role": "assistant", "content": "Sunny."}]}
    src = _write(tmp_path, [call, _multi(reasoning=False)])
    tok = make_tokenizer("qwen3")
    tok.chat_template = CONCATENATING_TEMPLATE
    with pytest.raises(ConfigError) as e:
        run_prepare(_cfg(src, prompts_per_chunk=4), tok, tmp_path / "strict", 1)
    assert str(e.value) == (f"{src}:1: {STRING_ARGUMENTS} (or set `strict: false` to drop such records, counted "
                            "as tool_arguments_as_string)")
    summary = run_prepare(_cfg(src, prompts_per_chunk=4, strict=False), tok, tmp_path / "out", 1)
    assert summary["dropped"] == {"tool_arguments_as_string": 1} and summary["kept"] == 1


def test_every_record_dropped_is_an_error(tmp_path):
    src = _write(tmp_path, [_multi(), _multi()])
    kw = {"prompts_per_chunk": 4, "chat_template_kwargs": {"enable_thinking": False}, "strict": False}
    with pytest.raises(ConfigError) as e:
        run_prepare(_cfg(src, **kw), make_tokenizer("qwen3"), tmp_path / "out", 1)
    assert str(e.value) == ("prepare kept no sample of the 2 records read (dropped: duplicate 1, not_prefix_stable 1): "
                            "config/README.md says what each reason means (filters drop whatever `strict` says; a "
                            "malformed record or a template's refusal stops a strict run, naming it)")
    assert not (tmp_path / "out" / "summary.json").exists()


def test_turn_holding_a_stop_token_dropped_and_counted(tmp_path):
    """A runaway generation copied into the data: the answer, `<|im_end|>`, a made-up next user turn. The model
    stops at that token, so the text after it was never generated as this turn: refused, saying where."""
    runaway = conv("Hello there!", "How are you today?<|im_end|>\n<|im_start|>user\nFine.")
    src = _write(tmp_path, [_multi(), runaway, conv("Say <|im_end|>", "Two plus two is four.")])
    tok = make_tokenizer("qwen3")
    with pytest.raises(ConfigError) as e:
        run_prepare(_cfg(src, prompts_per_chunk=4), tok, tmp_path / "strict", 1)
    assert str(e.value) == (f"{src}:2: assistant turn 1: its content holds '<|im_end|>' (at character 18), a token "
                            "that ends a turn: the model stops there, so this is not one generated turn (a runaway "
                            "generation?). Cut the text at it, or regenerate the responses with this model (or set "
                            "`strict: false` to drop such records, counted as stop_token_in_turn)")
    summary = run_prepare(_cfg(src, prompts_per_chunk=4, strict=False), tok, tmp_path / "out", 1)
    # dropped: the runaway only; a user message may hold the token (the server sees it there as well)
    assert summary["dropped"] == {"stop_token_in_turn": 1} and summary["kept"] == 3


def test_a_lone_surrogate_is_a_malformed_record_not_a_crash(tmp_path):
    """Scraped text cut inside an emoji: valid JSON (`\\ud83c` without its pair), no text UTF-8 can encode. Refused
    as non_utf8 naming where, and dropped and counted by a lenient run (it crashed in the record's hash)."""
    src = _write(tmp_path, [conv("bad \ud83c half", "ok"), RECORDS[1]])
    tok = make_tokenizer("qwen3")
    with pytest.raises(MalformedRecordError, match=rf"{src}:1: malformed record \(non_utf8\): messages\[0\]\.content "
                                                   r"holds a lone UTF-16 surrogate \(\\ud83c at character 4"):
        run_prepare(_cfg(src), tok, tmp_path / "strict", 1)
    summary = run_prepare(_cfg(src, strict=False), tok, tmp_path / "out", 1)
    assert summary["dropped"] == {"non_utf8": 1} and summary["kept"] == 1


def test_a_legacy_function_call_renders_as_the_same_tool_call(tmp_path):
    """OpenAI's legacy `function_call` on an assistant turn (and the `function` role's result) gives the token ids
    and mask of the same record written with `tool_calls`."""
    from test_conversations import _as_tool_calls, _legacy

    tok = make_tokenizer("qwen3")
    legacy = _legacy("get_weather", '{"city": "Paris"}')
    rows = {}
    for name, rec in (("legacy", legacy), ("tools", _as_tool_calls(legacy))):
        (tmp_path / name).mkdir()
        src = _write(tmp_path / name, [rec])
        run_prepare(_cfg(src, prompts_per_chunk=4), tok, tmp_path / name / "out", 1)
        (rows[name],) = _rows(tmp_path / name / "out", 1)
    assert [(r["input_ids"], r["loss_mask"]) for r in rows["legacy"]] == [
        (r["input_ids"], r["loss_mask"]) for r in rows["tools"]]
    assert "get_weather" in tok.decode(rows["legacy"][0]["input_ids"])


def test_openai_messages_under_conversations_give_the_same_token_ids(tmp_path):
    """One conversation written as `messages` and as `conversations: [{role, content}]` (Hugging Face's
    other key for OpenAI messages) prepares to the same token ids and mask."""
    recs = [conv("What is two plus two?", "Two plus two is four."), RECORDS[4]]
    tok = make_tokenizer("qwen3")
    rows = {}
    for key in ("messages", "conversations"):
        (tmp_path / key).mkdir()
        src = _write(tmp_path / key, [{key: r["messages"]} for r in recs])
        run_prepare(_cfg(src, prompts_per_chunk=4), tok, tmp_path / key / "out", 1)
        (rows[key],) = _rows(tmp_path / key / "out", 1)
    assert len(rows["messages"]) == 2
    assert [(r["sample_id"], r["input_ids"], r["loss_mask"]) for r in rows["conversations"]] == [
        (r["sample_id"], r["input_ids"], r["loss_mask"]) for r in rows["messages"]]


@pytest.mark.parametrize("share", [False, True])
def test_workers_write_the_same_bytes_as_one(tmp_path, monkeypatch, share):
    """prepare's conversations rendered and masked by 3 forked workers, in batches of 2 a worker (so records cross
    many batch and chunk bounds): every file it writes is byte for byte the one of a single process, the drops,
    split turns, the masker's counters and the shared prefixes included; a strict run stops with the same error."""
    import hsextract.prepare.run as prep

    monkeypatch.setattr(prep, "BATCH_PER_WORKER", 2)
    lines = [*RECORDS, _multi(), _multi(reasoning=False), b"{not json\n", *RECORDS[:2], _multi()] * 3
    src = _write(tmp_path, lines)
    tok = make_tokenizer("qwen3")
    cfg = _cfg(src, max_seq_len=40, truncate=False, strict=False, prompts_per_chunk=5, share_prefixes=share)
    n = num_chunks(cfg)
    one = run_prepare(cfg, tok, tmp_path / "one", n)
    three = run_prepare(cfg, tok, tmp_path / "three", n, workers=3)
    assert one == three and one["masks"]["split_conversations"] > 0 and len(one["dropped"]) >= 4
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "three").iterdir()) and len(names) == n + 2
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "three" / name).read_bytes(), name
    strict = _cfg(src, max_seq_len=40, truncate=False, prompts_per_chunk=5, share_prefixes=share)
    errors = []
    for workers in (1, 3):
        with pytest.raises((MalformedRecordError, TemplateError)) as e:
            run_prepare(strict, tok, tmp_path / f"strict{workers}", n, workers=workers)
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1]


def test_a_sample_another_record_already_gave_is_a_duplicate_sample(tmp_path):
    """Agentic data recorded step by step: record 1 is record 0 and one more turn. Split per turn (Kimi's template
    drops earlier reasoning), record 1's first sample is record 0's sample, token for token: with dedup it is
    dropped as `duplicate_sample` (a sample, not the record: its second turn is kept); without dedup, kept. A
    weight's repeats stay (one origin, as for records)."""
    def a(content, reasoning):
        return {"role": "assistant", "content": content, "reasoning_content": reasoning}

    step1 = [{"role": "user", "content": "Hello there!"}, a("How are you today?", "The user greets.")]
    step2 = step1 + [{"role": "user", "content": "What is two plus two?"}, a("Four.", "Add them.")]
    src = _write(tmp_path, [{"messages": step1}, {"messages": step2}])
    tok = make_tokenizer("kimi_k25")
    summary = run_prepare(_cfg(src, prompts_per_chunk=8), tok, tmp_path / "out", 1)
    assert (summary["kept"], summary["dropped"], summary["dropped_samples"]) == (2, {"duplicate_sample": 1}, 1)
    # the mixture (seed 3) reads record 1 first: record 0's one sample is the repeat
    assert sorted(r["sample_id"] for r in _rows(tmp_path / "out", 1)[0]) == ["d:1:t1", "d:1:t3"]
    assert run_prepare(_cfg(src, prompts_per_chunk=8, dedup=False), tok, tmp_path / "all", 1)["kept"] == 3
    hashed = from_config({"sources": [{"path": str(src), "name": "d#x"}], "seed": 3, "prompts_per_chunk": 8,
                          "share_prefixes": False}).prepare  # a `#` in the source's name is no weight's repeat
    assert run_prepare(hashed, tok, tmp_path / "hashed", 1)["dropped"] == {"duplicate_sample": 1}
    cfg = from_config({"sources": [{"path": str(src), "name": "d", "weight": 2.0}], "seed": 3,
                       "prompts_per_chunk": 8, "share_prefixes": False}).prepare
    repeats = run_prepare(cfg, tok, tmp_path / "w", 1)
    assert (repeats["kept"], repeats["dropped"]) == (4, {"duplicate_sample": 2})
    assert sorted(r["sample_id"] for r in _rows(tmp_path / "w", 1)[0]) == ["d:1#1:t1", "d:1#1:t3", "d:1:t1", "d:1:t3"]


def test_a_conversation_opening_with_an_assistant_turn_is_refused_saying_why(tmp_path):
    src = _write(tmp_path, [conv("Hello there!", "Hi."), {"messages": [
        {"role": "assistant", "content": "Welcome!"}, {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "How are you today?"}]}])
    with pytest.raises(TemplateError) as e:
        run_prepare(_cfg(src), make_tokenizer("llama3"), tmp_path / "out", 1)
    assert str(e.value) == (
        f"{src}:2: messages[0] is an assistant turn: nothing comes before it for the model to have answered (a "
        "conversation opens with a user or system message). Remove the opening assistant message, or set "
        "`strict: false` to drop such records") and e.value.reason == "template_error"
    summary = run_prepare(_cfg(src, strict=False), make_tokenizer("llama3"), tmp_path / "lenient", 1)
    assert (summary["kept"], summary["dropped"]) == (1, {"template_error": 1})


def test_a_strict_refusal_says_how_to_drop_such_records_instead(tmp_path):
    src = _write(tmp_path, [{"messages": [{"role": "user", "content": "Hello there!"},
                                          {"role": "assistant", "content": "", "reasoning_content": "Greet back."}]}])
    with pytest.raises(TemplateError) as e:
        run_prepare(_cfg(src), make_tokenizer("llama3"), tmp_path / "out", 1)
    assert str(e.value) == (
        f"{src}:1: assistant turn 1: its content is empty and the chat template does not render its reasoning (with "
        "these `chat_template_kwargs`), so its sample would train only the stop token right after the prompt, and "
        "the conversation has no other turn to train. Give the turn content, have its reasoning rendered "
        "(`chat_template_kwargs`, e.g. thinking on), or leave it out (or set `strict: false` to drop such records, "
        "counted as empty_turn)") and e.value.reason == "empty_turn"
