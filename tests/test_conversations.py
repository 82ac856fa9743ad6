"""Input formats, normalization, malformed records (strict / lenient) and the mixture."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hsextract.errors import ConfigError, HsxError
from hsextract.prepare.conversations import (
    MalformedRecordError,
    as_openai,
    conversation_hash,
    count_records,
    iter_conversations,
    mixture,
    normalize_record,
    open_sources,
)
from hsextract.prepare.sources import parse_sources

EXPECTED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "c1"}]},
    {"role": "tool", "content": "21C", "tool_call_id": "c1"},
    {"role": "assistant", "content": "It is 21C."},
]
OPENAI = {"messages": [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    {"role": "assistant", "content": "Hello!", "thinking": "Greet back."}, {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "21C", "tool_call_id": "c1"}, {"role": "assistant", "content": "It is 21C."}]}
SHAREGPT = {"system": "Be brief.", "conversations": [
    {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!", "reasoning_content": "Greet back."},
    {"from": "human", "value": "Weather?"},
    {"from": "gpt", "value": "", "tool_calls": [
        {"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"from": "tool", "value": "21C", "tool_call_id": "c1"}, {"from": "gpt", "value": "It is 21C."}]}


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _read_all(cfg, **kw):
    return [c for _, c in iter_conversations(cfg, **kw)]


def test_formats_normalize_to_the_same_conversation(tmp_path):
    a = _read_all([{"path": _jsonl(tmp_path / "a.jsonl", [OPENAI]), "format": "messages"}])
    b = _read_all([{"path": _jsonl(tmp_path / "b.jsonl", [SHAREGPT])}])
    (tmp_path / "c.json").write_text(json.dumps([SHAREGPT]))
    c = _read_all([{"path": tmp_path / "c.json", "format": "sharegpt"}])
    assert b[0].messages == EXPECTED and c[0].messages == EXPECTED
    # content given as parts keeps them beside their text (masks.rendering passes them as SGLang does)
    assert a[0].messages == [EXPECTED[0], {**EXPECTED[1], "content_parts": ["Hi"]}, *EXPECTED[2:]]


def test_openai_messages_under_conversations_read_as_under_messages(tmp_path):
    """`conversations: [{role, content}]` (OpenAI messages under that key, as many Hugging Face datasets write
    them) was refused under every format (`conversations[0] has no `from``): read as `messages` is, by `auto` and
    `sharegpt`, from JSONL and parquet; `messages` says where to look."""
    want = normalize_record(OPENAI)
    p = _jsonl(tmp_path / "c.jsonl", [{"conversations": OPENAI["messages"]}])
    for cfg in ({"path": p}, {"path": p, "format": "sharegpt"}):
        assert _read_all([cfg]) == [want]
    pq.write_table(pa.Table.from_pylist([{"conversations": EXPECTED}]), tmp_path / "c.parquet")  # one content type
    assert [c.messages for c in _read_all([{"path": tmp_path / "c.parquet"}])] == [EXPECTED]
    # a table of both kinds: one struct type, so every message has role, content, from and value, the unused null
    pair = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    sharegpt = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    both = [{"conversations": pair}, {"conversations": sharegpt}]
    pq.write_table(pa.Table.from_pylist(both), tmp_path / "both.parquet")
    assert [c.messages for c in _read_all([{"path": tmp_path / "both.parquet"}])] == [pair, pair]
    with pytest.raises(MalformedRecordError) as e:
        _read_all([{"path": p, "format": "messages"}])
    assert (e.value.reason, e.value.detail) == (
        "missing_messages", "no `messages` list in the record; it has `conversations`: the source's `format: "
                            "sharegpt` (or `auto`) reads them")
    with pytest.raises(Exception) as e:  # and the other way round (audit: no hint then)
        normalize_record({"messages": pair}, "sharegpt")
    assert (e.value.reason, e.value.detail) == (
        "missing_messages", "no `conversations` list in the record; it has `messages`: the source's `format: "
                            "messages` (or `auto`) reads them")
    with pytest.raises(Exception) as e:  # an entry of neither kind: named as a ShareGPT one
        normalize_record({"conversations": [{"content": "hi"}]})
    assert (e.value.reason, e.value.detail) == ("missing_role", "conversations[0] has no `from`")
    with pytest.raises(Exception) as e:  # errors name the record's key
        normalize_record({"conversations": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]})
    assert e.value.detail.startswith("conversations[1] has unknown role 'bot'")


def test_content_parts_are_kept_and_written_back_as_parts():
    """OpenAI content parts (`text`, or `input_text` of the Responses API): `content` is their texts joined
    with a space (what SGLang renders for a template that takes a string), `content_parts` the texts; a
    regenerated record writes them back as the parts they were."""
    rec = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Summarise:"},
                                                     {"type": "input_text", "text": "A long text."}]},
                        {"role": "assistant", "content": [{"text": "Short."}]}]}
    conv = normalize_record(rec)
    assert conv.messages == [
        {"role": "user", "content": "Summarise: A long text.", "content_parts": ["Summarise:", "A long text."]},
        {"role": "assistant", "content": "Short.", "content_parts": ["Short."]}]
    assert [as_openai(m) for m in conv.messages] == [
        {"role": "user", "content": [{"type": "text", "text": "Summarise:"}, {"type": "text", "text": "A long text."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Short."}]}]
    assert normalize_record({"messages": [as_openai(m) for m in conv.messages]}) == conv
    # Mistral's reasoning chunks are the turn's reasoning (a reasoning field, where given, wins)
    think = {"role": "assistant", "content": [{"type": "thinking", "thinking": "Two and two."},
                                              {"type": "text", "text": "Four."}]}
    assert normalize_record({"messages": [rec["messages"][0], think]}).messages[1] == {
        "role": "assistant", "content": "Four.", "content_parts": ["Four."], "reasoning_content": "Two and two."}
    assert normalize_record({"messages": [rec["messages"][0], {**think, "reasoning_content": "R"}]}).messages[1][
        "reasoning_content"] == "R"
    with pytest.raises(Exception) as ei:  # a user's message has no reasoning
        normalize_record({"messages": [{"role": "user", "content": think["content"]}]})
    assert ei.value.reason == "wrong_type"
    # content replaced since (a regenerated turn): written as the string it now is
    assert as_openai({**conv.messages[1], "content": "New."}) == {"role": "assistant", "content": "New."}


def test_ultrachat_parquet_jsonl_and_hf_disk_agree(tmp_path):
    rows = [{"id": "0", "data": ["Hi", "Hello!", "Weather?", "Sunny."]},
            {"id": "1", "data": ["Two plus two?", "Four."]}]
    want = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}],
            [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "u.parquet")
    _jsonl(tmp_path / "u.jsonl", rows)
    for path in (tmp_path / "u.parquet", tmp_path / "u.jsonl"):
        got = _read_all([{"path": path, "format": "ultrachat"}])
        assert [c.messages for c in got] == want
    h4 = [{"messages": w} for w in want]  # ultrachat_200k style: role dicts under `messages`
    pq.write_table(pa.Table.from_pylist(h4), tmp_path / "h4.parquet")
    assert [c.messages for c in _read_all([{"path": tmp_path / "h4.parquet"}])] == want
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(h4).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(h4)}).save_to_disk(str(tmp_path / "hfd"))
    assert [c.messages for c in _read_all([{"path": tmp_path / "hf", "format": "hf_disk"}])] == want
    assert [c.messages for c in _read_all([{"path": tmp_path / "hfd"}])] == want
    assert count_records([{"path": tmp_path / "hf"}]) == 2


def test_a_parquet_source_that_cannot_fit_in_memory_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from hsextract.prepare import sources

    path = tmp_path / "big.parquet"
    pq.write_table(pa.Table.from_pylist([{"data": ["Hi " * 500, "Hello!"]}] * 40), path)
    size = sum(pq.ParquetFile(path).metadata.row_group(g).total_byte_size
               for g in range(pq.ParquetFile(path).metadata.num_row_groups))
    monkeypatch.setattr(sources, "available_memory", lambda: 2 * size - 2)
    with pytest.raises(ConfigError) as e:
        _read_all([{"path": path, "format": "ultrachat"}])
    assert str(e.value) == (
        f"{path}: its 40 records take {size / 1e9:.1f} GB decompressed, and prepare holds a parquet source in "
        f"memory, where {(2 * size - 2) / 1e9:.1f} GB are available: convert it to a save_to_disk folder, which is "
        f"read memory-mapped (python -c \"import datasets; datasets.Dataset.from_parquet('{path}')"
        f".save_to_disk('{tmp_path / 'big'}-disk')\"), and name that folder as the source's path")
    monkeypatch.setattr(sources, "available_memory", lambda: 2 * size)
    assert len(_read_all([{"path": path, "format": "ultrachat"}])) == 40


def test_tables_give_back_the_tools_and_arguments_they_were_written_from(tmp_path):
    """A column of dicts is one Arrow struct: parquet and save_to_disk give every tool-call `arguments` and every
    tool schema the keys of all the others, null where it had none, which a template would print and prepare train
    (`{"city": "Paris", "query": null}`). Read back, the records are the ones written: as JSONL gives them."""
    def rec(name, args, prop):
        return {"tools": [{"type": "function", "function": {"name": name, "parameters": {
                    "type": "object", "properties": {prop: {"type": "string"}}}}}],
                "messages": [{"role": "user", "content": "go"},
                             {"role": "assistant", "content": "", "tool_calls": [
                                 {"type": "function", "function": {"name": name, "arguments": args}}]},
                             {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "Done."}]}

    rows = [rec("weather", {"city": "Paris"}, "city"), rec("search", {"query": "cats", "limit": 3}, "query")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    assert pq.read_table(tmp_path / "t.parquet").to_pylist()[0]["messages"][1]["tool_calls"][0]["function"][
        "arguments"] == {"city": "Paris", "query": None, "limit": None}  # what Arrow makes of them
    want = _read_all([{"path": _jsonl(tmp_path / "t.jsonl", rows)}])
    assert [c.messages[1]["tool_calls"][0]["function"]["arguments"] for c in want] == [
        {"city": "Paris"}, {"query": "cats", "limit": 3}]
    got = _read_all([{"path": tmp_path / "t.parquet"}])
    assert [(c.messages, c.tools) for c in got] == [(c.messages, c.tools) for c in want]
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    got = _read_all([{"path": tmp_path / "hf"}])
    assert [(c.messages, c.tools) for c in got] == [(c.messages, c.tools) for c in want]


def test_nothing_a_record_holds_is_dropped_without_a_word():
    """A top-level `system` is the system message in every format (refused where another one opens the
    messages); an empty reasoning field gives way to the next; a tool call on a non-assistant message is refused."""
    user, answer = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}
    system = {"role": "system", "content": "SYS"}
    for rec in ({"system": "SYS", "messages": [user, answer]}, {"system": "SYS", "data": ["hi", "yo"]},
                {"system": "SYS", "messages": [system, user, answer]}):
        assert normalize_record(rec).messages == [system, user, answer]
    with pytest.raises(Exception) as e:  # normalize_record's own (MalformedRecordError at a source)
        normalize_record({"system": "other", "messages": [system, user, answer]})
    assert e.value.reason == "wrong_type" and e.value.detail == (
        "`system` and `messages[0]`, a system message, differ: which one the target saw is not known; keep one")
    conv = normalize_record({"messages": [user, {**answer, "reasoning_content": "", "reasoning": "because"}]})
    assert conv.messages[1]["reasoning_content"] == "because"
    with pytest.raises(Exception) as e:  # normalize_record's own (MalformedRecordError at a source)
        normalize_record({"messages": [{**user, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}, answer]})
    assert e.value.detail == "messages[0] (user) has tool_calls: only assistant messages call tools"
    assert normalize_record({"messages": [{**user, "tool_calls": None}, answer]}).messages == [user, answer]


def test_a_tools_empty_result_is_kept_and_rendered_as_the_model_saw_it():
    """An agent's command that printed nothing: the tool message's empty content is the context the model answered
    in (the record was refused as empty_content before, and strict lost the whole source there); an empty user or
    system message still is refused (a column read wrong)."""
    from chatfix import make_tokenizer

    from hsextract.masks.masker import ChatMasker

    calls = [{"type": "function", "function": {"name": "run", "arguments": {"cmd": "true"}}}]
    rec = {"messages": [{"role": "user", "content": "Run it."},
                        {"role": "assistant", "content": "", "tool_calls": calls},
                        {"role": "tool", "content": "", "tool_call_id": "1"},
                        {"role": "assistant", "content": "Done."}]}
    conv = normalize_record(rec)
    assert conv.messages[2] == {"role": "tool", "content": "", "tool_call_id": "1"}
    tok = make_tokenizer("qwen3")
    s = ChatMasker(tok).encode(conv)[-1]  # the last turn's sample
    text = tok.decode(s.input_ids)
    assert "<|im_start|>user\n<tool_response>\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text, text
    assert tok.decode([t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m]).endswith("Done.<|im_end|>")
    for role in ("user", "system"):
        with pytest.raises(Exception) as e:
            normalize_record({"messages": [{"role": role, "content": " "}, *rec["messages"][1:]]})
        assert e.value.reason == "empty_content" and e.value.detail == f"messages[0] ({role}) has empty content"
    # a result missing, null or an empty list: a column read wrong (the result stored under another key), refused
    for tool in ({"role": "tool", "output": "42"}, {"role": "tool", "content": None}, {"role": "tool", "content": []}):
        with pytest.raises(Exception) as e:
            normalize_record({"messages": [*rec["messages"][:2], tool, rec["messages"][3]]})
        assert e.value.reason == "empty_content" and e.value.detail == "messages[2] (tool) has empty content"
    sharegpt = [{"from": "human", "value": "Run it."}, {"from": "observation"}, {"from": "gpt", "value": "Done."}]
    with pytest.raises(Exception) as e:
        normalize_record({"conversations": sharegpt}, "sharegpt")
    assert e.value.reason == "empty_content" and e.value.detail == "conversations[1] (tool) has empty content"
    sharegpt[1]["value"] = ""
    assert normalize_record({"conversations": sharegpt}, "sharegpt").messages[1] == {"role": "tool", "content": ""}


def test_split_only_where_there_are_splits(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [OPENAI])
    with pytest.raises(ConfigError) as e:
        parse_sources([{"path": path, "split": "validation"}])
    assert str(e.value) == (f"config key `sources[0].split`: {path} is no DatasetDict (a save_to_disk folder with a "
                            "dataset_dict.json), so a split means nothing there: remove `split`")


def test_a_repeated_source_name_never_gives_two_sources_one_name(tmp_path):
    paths = [_jsonl(tmp_path / f"{n}.jsonl", [OPENAI]) for n in "xyz"]
    # a repeated name takes its index, as before, where that one is free
    assert [s.name for s in parse_sources([{"path": paths[0], "name": "b"}, {"path": paths[1], "name": "b"}])] == [
        "b", "b1"]
    with pytest.raises(ConfigError) as e:
        parse_sources([{"path": paths[0], "name": "b"}, {"path": paths[1], "name": "b2"},
                       {"path": paths[2], "name": "b"}])
    assert str(e.value) == ("config key `sources[2]`: its name 'b' is sources[0]'s, and 'b2', which it would get "
                            "instead, is sources[1]'s: give the sources distinct `name`s")


MALFORMED = [
    (b'{"messages": [}\n', "bad_json", "invalid JSON: Expecting value at column 15"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n', "non_utf8",
     "the line is not valid UTF-8 (byte 46: b'\\xe9')"),
    (b'{"messages": [{"role": "user", "content": "bad \\ud83c half"}, {"role": "assistant", "content": "ok"}]}\n',
     "non_utf8", "messages[0].content holds a lone UTF-16 surrogate (\\ud83c at character 4: half of a character "
     "cut in two, such as an emoji), which is not text UTF-8 can encode"),
    (b'{"messages": [{"content": "hi"}]}\n', "missing_role", "messages[0] has no `role`"),
    (b'{"messages": [{"role": "robot", "content": "hi"}]}\n', "unknown_role",
     "messages[0] has unknown role 'robot'; known: ['assistant', 'developer', 'function', 'system', 'tool', 'user']"),
    (b'{"messages": [{"role": "user", "content": "  "}]}\n', "empty_content", "messages[0] (user) has empty content"),
    (b'{"messages": [{"role": "user", "content": 5}]}\n', "wrong_type",
     "messages[0].content: content must be a string or a list of text parts, got int"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}]}\n',
     "wrong_type", "messages[0].content: only text content parts are supported, got {'type': 'image_url', "
     "'image_url': {'url': 'a.png'}}"),
    (b'{"messages": "hi"}\n', "wrong_type", "`messages` must be a list, got str"),
    (b'[1, 2]\n', "wrong_type", "a record must be a JSON object, got list"),
    (b'{"text": "hi"}\n', "missing_messages", "no `messages`, `conversations` or `data` key (keys: ['text'])"),
    (b'{"messages": []}\n', "missing_messages", "`messages` is empty"),
]
GOOD = b'{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}\n'


@pytest.mark.parametrize("line,reason,detail", MALFORMED)
def test_malformed_strict_error_names_file_line_reason(tmp_path, line, reason, detail):
    p = tmp_path / "d.jsonl"
    p.write_bytes(GOOD + b"\n" + line)  # the blank line 2 is skipped; the bad record is on line 3
    with pytest.raises(MalformedRecordError) as ei:
        _read_all([{"path": p}], strict=True)
    assert isinstance(ei.value, ConfigError) and isinstance(ei.value, HsxError)
    assert str(ei.value) == (f"{p}:3: malformed record ({reason}): {detail}. Fix or remove this record, or set "
                             f"`strict: false` to skip malformed records (they are counted per reason in "
                             f"summary.json).")
    assert (ei.value.location, ei.value.reason) == (f"{p}:3", reason)


def test_a_leading_byte_order_mark_is_ignored(tmp_path):
    """A UTF-8 BOM (Windows tools write one) opens the file, not its first record: a JSONL's line 1 and a JSON
    list read as without it (the line 1 was bad_json, and the list was read as JSONL: one bad record)."""
    bom = b"\xef\xbb\xbf"
    two = [json.loads(GOOD), {"messages": [{"role": "user", "content": "Two?"}, {"role": "assistant", "content": "2"}]}]
    want = [c.messages for c in _read_all([{"path": _jsonl(tmp_path / "plain.jsonl", two)}])]
    (tmp_path / "d.jsonl").write_bytes(bom + (tmp_path / "plain.jsonl").read_bytes())
    (tmp_path / "d.json").write_bytes(bom + b"\n " + json.dumps(two, indent=1).encode())
    (tmp_path / "blank.jsonl").write_bytes(bom + b"\n" + (tmp_path / "plain.jsonl").read_bytes())
    for name in ("d.jsonl", "d.json", "blank.jsonl"):  # a BOM alone on line 1 leaves it blank: no record
        cfg = [{"path": tmp_path / name}]
        assert count_records(cfg) == 2 and [c.messages for c in _read_all(cfg)] == want
    assert open_sources(cfg)[0].read(1)[0] == f"{tmp_path / 'blank.jsonl'}:3"  # lines counted as the file has them


@pytest.mark.parametrize("name,pack,what,fix", [
    ("d.jsonl.gz", gzip.compress, "gzip-compressed (it starts with the bytes 1f 8b)",
     "decompress it (`gunzip`) and give the decompressed file"),
    ("d.jsonl.bz2", bz2.compress, "bzip2-compressed (it starts with the bytes 42 5a 68)",
     "decompress it (`bunzip2`) and give the decompressed file"),
    ("d.json.xz", lzma.compress, "xz-compressed (it starts with the bytes fd 37 7a 58 5a 00)",
     "decompress it (`unxz`) and give the decompressed file"),
    ("d.jsonl.zst", lambda b: b"\x28\xb5\x2f\xfd" + b, "zstd-compressed (it starts with the bytes 28 b5 2f fd)",
     "decompress it (`zstd -d`) and give the decompressed file"),
    ("d.jsonl", lambda b: b.decode().encode("utf-16"), "UTF-16 text (it starts with the bytes ff fe)",
     "convert it to UTF-8 (`iconv -f UTF-16 -t UTF-8`) and give that file"),
])
def test_a_compressed_source_is_refused_as_a_whole(tmp_path, name, pack, what, fix):
    """Read as text, each `\\n` byte of compressed data made a line, each one a non_utf8 record: the file is
    refused when the sources are counted (the workflow's parse), saying what it is and what to do."""
    path = tmp_path / name
    path.write_bytes(pack(GOOD * 3))
    for read in (count_records, open_sources):
        with pytest.raises(ConfigError) as e:
            read([{"path": path}])
        assert str(e.value) == (f"sources[0].path: {path}: the file is {what}, and a JSONL or JSON source is read "
                                f"as UTF-8 text: {fix} as the source's `path`")


def test_a_binary_source_is_refused_as_a_whole(tmp_path):
    """A shard or another binary file named as a source was one non_utf8 record a line (thousands of lines from
    `hsextract masks --explain`): refused as a whole (a NUL byte, and bytes that are not UTF-8). A NUL in a UTF-8
    file is one malformed record, the rest read."""
    path = tmp_path / "chunk-00000.hss"
    path.write_bytes(b"HSS1" + bytes(range(256)) * 4 + b"\n" + GOOD)
    for read in (count_records, open_sources):
        with pytest.raises(ConfigError) as e:
            read([{"path": path}])
        assert str(e.value) == (f"sources[0].path: {path}: the file is binary (4 NUL bytes in its first 1,122, the "
                                "first at offset 4), and a JSONL or JSON source is read as UTF-8 text: give a "
                                "conversations file as the source's `path`")
    # a tar archive of a JSONL file: UTF-8 all through, NULs all over its headers
    import io
    import tarfile
    tar = tmp_path / "d.jsonl"
    with tarfile.open(tar, "w") as t:
        info = tarfile.TarInfo("d.jsonl")
        info.size = len(GOOD)
        t.addfile(info, io.BytesIO(GOOD))
    with pytest.raises(ConfigError, match=r"the file is binary \(\d+ NUL bytes in its first 4,096, the first at "
                                          r"offset 7\)"):
        open_sources([{"path": tar}])
    # UTF-16 without a byte-order mark (UTF-32's: binary)
    for codec in ("UTF-16LE", "UTF-16BE"):
        wide = tmp_path / f"{codec}.jsonl"
        wide.write_bytes(GOOD.decode().encode(codec))
        with pytest.raises(ConfigError) as e:
            open_sources([{"path": wide}])
        assert str(e.value) == (f"sources[0].path: {wide}: the file looks like {codec} text without a byte-order "
                                "mark (a NUL every other byte), and a JSONL or JSON source is read as UTF-8 text: "
                                f"convert it to UTF-8 (`iconv -f {codec} -t UTF-8`) and give that file as the "
                                "source's `path`")
    wide = tmp_path / "utf-32.jsonl"
    wide.write_bytes(GOOD.decode().encode("utf-32-le"))
    with pytest.raises(ConfigError, match="the file is binary"):
        open_sources([{"path": wide}])
    text = tmp_path / "text.jsonl"
    text.write_bytes(GOOD.replace(b"Hello", b"He\x00llo", 1) + b"\n" + GOOD + b"\n")
    (src,) = open_sources([{"path": text}])
    with pytest.raises(MalformedRecordError):
        src.read(0)
    assert count_records([{"path": text}]) == 2 and src.read(1)[1].messages == json.loads(GOOD)["messages"]


def test_a_json_file_of_one_object_is_refused_not_read_as_lines(tmp_path):
    """A .json file holds a list of records, or JSON lines (as `datasets` reads one): a pretty-printed object read
    as lines was one bad_json record a line. It is refused, saying whether it is one record."""
    rec = json.loads(GOOD)
    one, wrapped = tmp_path / "one.json", tmp_path / "wrapped.json"
    one.write_text(json.dumps(rec, indent=2))
    wrapped.write_text(json.dumps({"version": 2, "train": [rec, rec]}, indent=2))
    head = "a .json source holds a list of records (or one record a line, JSON lines), and this one holds one JSON " \
           "object over several lines"
    for path, tail in ((one, "which is one record (keys: ['messages']): put it in a list (`[{...}]`) or write it "
                             "on one line"),
                       (wrapped, "(keys: ['train', 'version']), not a record; if the records are the list under "
                                 "`train`, write that list as the file")):
        with pytest.raises(ConfigError) as e:
            count_records([{"path": path}])
        assert str(e.value) == f"sources[0].path: {path}: {head}{', ' if tail.startswith('which') else ' '}{tail}"
    # JSON lines in a .json file are read as such, one line or several
    for n in (1, 3):
        (tmp_path / "lines.json").write_bytes(GOOD * n)
        assert count_records([{"path": tmp_path / "lines.json"}]) == n
        assert len(_read_all([{"path": tmp_path / "lines.json"}])) == n


def test_malformed_lenient_counts_each_reason(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(GOOD + b"".join(line for line, _, _ in MALFORMED) + GOOD)
    counts: dict[str, int] = {}
    got = list(iter_conversations([{"path": p}], strict=False, counts=counts))
    assert len(got) == 14 and sum(c is not None for _, c in got) == 2
    assert counts == {"bad_json": 1, "non_utf8": 2, "missing_role": 1, "unknown_role": 1, "empty_content": 1,
                      "wrong_type": 4, "missing_messages": 2}
    assert count_records([{"path": p}]) == 14  # malformed records are input records too


HALF = "cut \ud83c"  # an emoji's first half: JSON writes it `\ud83c`, and reads it back as this lone surrogate
CALL = {"type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("rec,where", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": HALF}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": HALF}]},
     "messages[1].thinking"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": HALF, "arguments": "{}"}}]}]}, "messages[0].tool_calls[0].function.name"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": {"q": [HALF]}}}]}]},
     "messages[0].tool_calls[0].function.arguments.q[0]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": json.dumps({"q": HALF})}}]}]},  # the template parses it
     "messages[0].tool_calls[0].function.arguments (parsed as JSON).q"),
    ({"messages": [{"role": "tool", "content": "r", "tool_call_id": HALF}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "q"}], "system": HALF}, "system"),
    ({"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"properties": {HALF: {}}}}}]}, "tools[0].function.parameters.properties (a key)"),
    ({"messages": [{"role": "user", "content": "q"}], "tools": json.dumps([{"description": HALF}])},
     "tools[0].description"),
    ({"data": ["q", HALF]}, "data[1]"),
    ({"conversations": [{"from": "human", "value": HALF}]}, "conversations[0].value"),
    ({"conversations": [{"from": "function_call", "value": json.dumps({"name": "f", "arguments": HALF})}]},
     "conversations[0].value (parsed as JSON).arguments"),
])
def test_a_lone_surrogate_anywhere_a_template_reads_is_non_utf8(tmp_path, rec, where):
    """Every string that reaches the template, the tokenizer or the record's hash is text UTF-8 can encode: a
    record holding a lone surrogate is malformed (non_utf8) and names where, read from JSONL or a JSON list."""
    (tmp_path / "d.json").write_text(json.dumps([rec]))  # json.dumps writes the surrogate as the escape `\ud83c`
    for path in (_jsonl(tmp_path / "d.jsonl", [rec]), tmp_path / "d.json"):
        with pytest.raises(MalformedRecordError) as ei:
            _read_all([{"path": path}])
        assert ei.value.reason == "non_utf8" and ei.value.detail.startswith(f"{where} holds a lone UTF-16 surrogate")
        str(ei.value).encode("utf-8")  # the error itself is printable
    # a lone surrogate in a key nothing reads leaves the record as it was
    assert normalize_record({"messages": [{"role": "user", "content": "q", "meta": HALF}]}).messages == [
        {"role": "user", "content": "q"}]


def _legacy(name, args):
    """A record whose assistant calls a tool with OpenAI's legacy `function_call` and the `function` role's result."""
    return {"messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": None, "function_call": {"name": name, "arguments": args}},
                         {"role": "function", "name": name, "content": "21C"},
                         {"role": "assistant", "content": "It is 21C."}]}


def _as_tool_calls(rec):
    """The same record with the call written as `tool_calls`."""
    m = rec["messages"][1]
    return {"messages": [rec["messages"][0], {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": m["function_call"]}]}, *rec["messages"][2:]]}


def test_a_legacy_function_call_is_the_one_tool_call_it_makes(tmp_path):
    """An assistant's `function_call: {name, arguments}` (OpenAI's legacy form) was ignored, and the turn refused as
    empty_content: it is the one tool call, as `tool_calls` writes it, from JSONL and from a table."""
    rows = [_legacy("get_weather", '{"city": "Paris"}'), _legacy("search", {"query": "cats", "limit": 3})]
    want = [normalize_record(_as_tool_calls(r)) for r in rows]
    assert want[0].messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert _read_all([{"path": _jsonl(tmp_path / "f.jsonl", rows)}]) == want
    pq.write_table(pa.Table.from_pylist(rows[1:]), tmp_path / "f.parquet")  # object arguments: no nulls added
    assert _read_all([{"path": tmp_path / "f.parquet"}]) == want[1:]
    user, call = rows[0]["messages"][0], rows[0]["messages"][1]
    for msgs, detail in (
        ([user, {**call, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}],
         "messages[1] has both `function_call` (the legacy form of one tool call) and `tool_calls`: which calls the "
         "assistant made is not known; keep one"),
        ([{**user, "function_call": call["function_call"]}],
         "messages[0] (user) has function_call: only assistant messages call tools"),
        ([user, {**call, "function_call": "get_weather"}],
         "messages[1].function_call must be an object {name, arguments}, got str"),
        ([user, {**call, "function_call": {"arguments": "{}"}}], "messages[1].function_call needs name (a string)"),
        ([user, {**call, "function_call": {"name": "f", "arguments": 3}}],
         "messages[1].function_call.arguments must be a string or an object"),
    ):
        with pytest.raises(Exception) as e:  # normalize_record's own (MalformedRecordError at a source)
            normalize_record({"messages": msgs})
        assert (e.value.reason, e.value.detail) == ("wrong_type", detail)
    # a table's empty column is no call: the turn is its content
    assert normalize_record({"messages": [user, {"role": "assistant", "content": "Hi", "function_call": None}]}) == \
        normalize_record({"messages": [user, {"role": "assistant", "content": "Hi"}]})


def test_tool_call_and_reasoning_type_errors():
    with pytest.raises(Exception) as ei:
        normalize_record({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]})
    assert ei.value.reason == "wrong_type"
    with pytest.raises(Exception) as ei:
        normalize_record({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 3}]})
    assert ei.value.reason == "wrong_type"


def test_mixture_reproducible_with_weights_and_caps(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": f"a{i}"}]} for i in range(10)])
    b = _jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": f"b{i}"}]} for i in range(4)])
    cfg = [{"path": a, "weight": 0.5}, {"path": b, "weight": 2.0, "max_records": 6}]
    assert count_records(cfg) == 5 + 6
    ids1 = [e.sample_id for e in mixture(open_sources(cfg), seed=7)]
    ids2 = [e.sample_id for e in mixture(open_sources(cfg), seed=7)]
    ids3 = [e.sample_id for e in mixture(open_sources(cfg), seed=8)]
    assert ids1 == ids2 and ids1 != ids3 and len(ids1) == 11 == len(set(ids1))
    assert sum(i.startswith("a:") for i in ids1) == 5
    b_ids = [i for i in ids1 if i.startswith("b:")]
    assert sorted(i for i in b_ids if "#" not in i) == ["b:0", "b:1", "b:2", "b:3"]  # one whole pass
    assert len([i for i in b_ids if i.endswith("#1")]) == 2  # then a seeded subset of 2


def test_a_source_is_the_settings_source_named_and_the_same_from_settings_or_a_mapping(tmp_path):
    """One type for a source: parse_sources takes the settings' Sources (or config mappings, or paths) and gives
    settings.Source back, the name filled from the file name, a repeated name with its index."""
    from hsextract.config.settings import Source, from_config

    a = _jsonl(tmp_path / "a.part.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    entries = [{"path": str(a), "weight": 2.0}, {"path": str(a), "max_records": 1}, {"path": str(a), "name": "z"}]
    want = [Source(path=str(a), format="auto", weight=2.0, max_records=None, name="a", split=None),
            Source(path=str(a), format="auto", weight=1.0, max_records=1, name="a1", split=None),
            Source(path=str(a), format="auto", weight=1.0, max_records=None, name="z", split=None)]
    assert parse_sources(from_config({"sources": entries}).prepare.sources) == want
    assert parse_sources(entries) == want
    assert parse_sources([a]) == [Source(path=str(a), format="auto", weight=1.0, max_records=None, name="a",
                                         split=None)]
    assert [o.spec for o in open_sources(want)] == want


def test_bad_source_config():
    with pytest.raises(ConfigError, match=r"config key `sources\[0\].path`: /nope.jsonl does not exist"):
        count_records([{"path": "/nope.jsonl"}])
    with pytest.raises(ConfigError, match=r"`sources\[0\].format` is 'csv'"):
        count_records([{"path": __file__, "format": "csv"}])


# ---- hf_disk: datasets.load_from_disk where installed, the pyarrow reader otherwise ----------------------------


def _hf_disk_rows() -> list[dict]:
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(5)]
    rows[3] = {"messages": [{"role": "robot", "content": "beep"}]}  # malformed: its location is reported
    return rows


def _read_sources(cfg) -> list[tuple[str, list, list]]:
    """(reader class, [(location, raw row)], [(location, messages or malformed reason)]) of every source."""
    out = []
    for src in open_sources(cfg):
        raws = [src.reader.raw(i) for i in range(len(src))]
        read = []
        for i in range(len(src)):
            try:
                where, conv = src.read(i)
                read.append((where, conv.messages))
            except MalformedRecordError as e:
                read.append((e.location, e.reason))
        out.append((type(src.reader).__name__, raws, read))
    return out


@pytest.fixture()
def hf_dirs(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _hf_disk_rows()
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"), num_shards=2)  # two Arrow files
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(tmp_path / "dd"))
    return tmp_path


def test_hf_disk_same_records_with_datasets_and_with_the_pyarrow_fallback(hf_dirs, monkeypatch):
    cfg = [{"path": hf_dirs / "ds", "format": "hf_disk"}, {"path": hf_dirs / "dd", "split": "train"},
           {"path": hf_dirs / "dd", "split": "test"}]
    with_datasets = _read_sources(cfg)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if datasets were not installed
    fallback = _read_sources(cfg)
    assert [r[0] for r in with_datasets] == ["_DatasetReader"] * 3
    assert [r[0] for r in fallback] == ["_TableReader"] * 3
    assert [r[1:] for r in with_datasets] == [r[1:] for r in fallback]
    rows = _hf_disk_rows()
    ds, train, test = with_datasets
    assert [raw for _, raw in ds[1]] == rows and [raw for _, raw in train[1]] == rows
    assert [raw for _, raw in test[1]] == rows[:2]
    # locations count over the whole dataset (both Arrow files), in the split's directory of a DatasetDict
    assert [where for where, _ in ds[2]] == [f"{hf_dirs / 'ds'}:record {i}" for i in range(1, 6)]
    assert ds[2][3] == (f"{hf_dirs / 'ds'}:record 4", "unknown_role")
    assert ds[2][4] == (f"{hf_dirs / 'ds'}:record 5", [{"role": "user", "content": "q4"},
                                                        {"role": "assistant", "content": "a4"}])
    assert train[2][0][0] == f"{hf_dirs / 'dd' / 'train'}:record 1"
    assert count_records(cfg) == 5 + 5 + 2


@pytest.mark.parametrize("installed", [True, False])
def test_hf_disk_errors_are_the_same_with_and_without_datasets(hf_dirs, monkeypatch, installed):
    if not installed:
        monkeypatch.setitem(sys.modules, "datasets", None)
    dd, ds = hf_dirs / "dd", hf_dirs / "ds"
    (hf_dirs / "plain").mkdir()
    (ds / "data-00001-of-00002.arrow").unlink()
    cases = [
        ({"path": dd}, f"{dd} is a DatasetDict with splits ['train', 'test']: set `split:` on this source"),
        ({"path": dd, "split": "dev"}, f"{dd}: split 'dev' not in ['train', 'test']"),
        ({"path": hf_dirs / "plain"},
         f"{hf_dirs / 'plain'}: not a `datasets.save_to_disk` directory (no state.json or dataset_dict.json)"),
        ({"path": ds}, f"{ds}: state.json lists Arrow files that are missing: ['{ds / 'data-00001-of-00002.arrow'}']"),
    ]
    for source, message in cases:  # named by its key, as the workflow's parse counts the records
        for read in (count_records, open_sources):
            with pytest.raises(ConfigError) as e:
                read([source])
            key = "split" if "split" in message else "path"
            assert str(e.value) == f"sources[0].{key}: {message}"


def test_message_weight_zero_marks_an_assistant_turn_untrained():
    """OpenAI's fine-tuning format: `weight` 0 or 1 per message; an assistant message of weight 0 is context
    (Conversation.untrained, by message index after a `system` inserted in front); other roles are never trained."""
    msgs = [{"role": "user", "content": "q", "weight": 0}, {"role": "assistant", "content": "bad", "weight": 0},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "good", "weight": 1.0},
            {"role": "assistant", "content": "more", "weight": 0.0}]
    conv = normalize_record({"messages": msgs})
    assert conv.untrained == frozenset({1, 4}) and all("weight" not in m for m in conv.messages)
    assert normalize_record({"messages": msgs, "system": "be brief"}).untrained == frozenset({2, 5})
    assert normalize_record({"messages": msgs[2:4]}).untrained == frozenset()
    # the same messages without weights are another record for dedup; records without weights hash as before
    assert conversation_hash(conv) != conversation_hash(normalize_record({"messages": [
        {k: v for k, v in m.items() if k != "weight"} for m in msgs]}))
    for bad in (0.5, "0", 2, [0], False, True):  # a bool is no number here, as in the config's schema
        with pytest.raises(Exception) as e:
            normalize_record({"messages": [msgs[0], {**msgs[1], "weight": bad}]})
        assert (e.value.reason, e.value.detail) == (
            "wrong_type", f"messages[1].weight must be 0 or 1 (whether the message is trained, as in OpenAI's "
                          f"fine-tuning format), got {bad!r}")


def test_a_json_list_under_a_jsonl_name_is_refused_saying_to_rename_it(tmp_path):
    """Read as lines, a pretty-printed list would be one malformed record a line; a one-line list one record."""
    for name, text in (("pretty.jsonl", json.dumps([OPENAI, OPENAI], indent=1)), ("one.jsonl", json.dumps([OPENAI])),
                       ("bom.txt", "\ufeff  " + json.dumps([OPENAI]))):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as e:
            _read_all([{"path": tmp_path / name}])
        suffix = name[name.index("."):]
        assert str(e.value) == (
            f"sources[0].path: {tmp_path / name}: this file holds a JSON list (it opens with `[`), which is read as "
            f"JSON lines by its name ({suffix}): name it `.json` to read it as a list of records, or write one record "
            "a line")
    (tmp_path / "pretty.json").write_text(json.dumps([OPENAI, OPENAI], indent=1))
    assert len(_read_all([{"path": tmp_path / "pretty.json"}])) == 2
    # JSON lines whose first record is a list: that record malformed, the others read
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n" + json.dumps([OPENAI]) + "\n" + json.dumps(OPENAI) + "\n")  # a blank line first too
    counts = {}
    assert len([c for c in _read_all([{"path": mixed}], strict=False, counts=counts) if c is not None]) == 1
    assert counts == {"wrong_type": 1}


def test_an_empty_mixture_names_each_source_and_what_it_gave(tmp_path):
    from hsextract.config.checks import count_records
    from hsextract.config.settings import from_config
    from hsextract.prepare.conversations import no_records

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    full = _jsonl(tmp_path / "full.jsonl", [OPENAI, OPENAI, OPENAI])
    sources = [{"path": str(empty)}, {"path": str(full), "weight": 0}, {"path": str(full), "max_records": 0}]
    assert no_records(sources) == (
        f"sources[0].path {empty}: 0 records; sources[1].path {full}: 3 records, 0 taken (weight, max_records); "
        f"sources[2].path {full}: 3 records, 0 taken (weight, max_records)")
    with pytest.raises(ConfigError) as e:
        count_records(from_config({"sources": sources}))
    assert str(e.value) == f"sources: the sources hold no records; nothing to extract ({no_records(sources)})"


def test_a_call_id_given_as_a_number_is_its_text_and_other_types_are_refused():
    """`"id": 5` answered by `"tool_call_id": "5"`: the same call (it was dropped, and the result named no call)."""
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [{**call, "id": 5}]},
            {"role": "tool", "content": "r", "tool_call_id": "5"}, {"role": "assistant", "content": "ok"}]
    assert normalize_record({"messages": msgs}).messages[1]["tool_calls"][0]["id"] == "5"
    for bad in ({"x": 1}, [5], True):
        with pytest.raises(Exception) as e:
            normalize_record({"messages": [msgs[0], {**msgs[1], "tool_calls": [{**call, "id": bad}]}, *msgs[2:]]})
        assert e.value.reason == "wrong_type" and e.value.detail == (
            f"messages[1].tool_calls[0].id must be a string, got {type(bad).__name__}")
