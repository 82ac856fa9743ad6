"""The hsextract command: inspect values, export and error exits (validate lines are in test_validate.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_sample, shard_metadata

from hsextract.cli import SUBCOMMANDS, build_parser, main
from hsextract.shard import ShardWriter


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "shards" / "chunk-00000.hss"
    path.parent.mkdir()
    samples = [make_sample(3, seed=0), make_sample(5, seed=1, trained=False), make_sample(8, seed=2)]
    with ShardWriter(path, shard_metadata(run_name="t", vocab_size=1000)) as w:
        for k, s in enumerate(samples):
            w.add(*s, sample_id=f"conv-{k}")
    return path, samples


def test_inspect_json_values(shard, capsys):
    path, samples = shard
    assert main(["inspect", "--json", "--samples", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    trained = [int(s[2].sum()) for s in samples]
    assert trained[1] == 0
    raw = sum(16 * n + 4 * n * 16 * 2 for n in (3, 5, 8))
    assert info["num_samples"] == 3 and info["num_tokens"] == 16 and info["num_trained"] == sum(trained)
    assert (info["format_version"], info["shared_samples"], info["distinct_tokens"]) == (1, 0, 16)  # flat: all stored
    assert info["raw_bytes"] == raw and info["stored_bytes"] == path.stat().st_size
    assert info["stored_over_raw"] == round(path.stat().st_size / raw, 4)
    assert info["metadata"]["model"] == "test-model" and info["metadata"]["run_name"] == "t"
    assert info["samples"] == [{"index": k, "sample_id": f"conv-{k}", "seq_len": n, "num_trained": t, "parent": -1,
                                "prefix_len": 0} for k, (n, t) in enumerate(zip((3, 5, 8), trained, strict=True))]


def test_inspect_text(shard, capsys):
    path, samples = shard
    assert main(["inspect", "--samples", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"shard          {path}" in out
    assert "final_state    post_norm" in out and "run_name       t" in out
    assert "aux_layers     [1, 2, 3] (hidden_states ids)" in out
    assert "               = hidden_states[1, 2, 3] = outputs of decoder layers 0, 1, 2" in out
    assert "samples        3 (0 take a prefix from an earlier one)" in out
    assert "tokens         16 materialized, 16 distinct (stored)" in out
    assert f"trained tokens {sum(int(s[2].sum()) for s in samples)}" in out
    assert out[-3].split() == ["0", "3", str(int(samples[0][2].sum())), "-1", "0", "conv-0"]
    assert out[-2].split() == ["1", "5", "0", "-1", "0", "conv-1"]


def test_export_command(shard, tmp_path, capsys):
    path, samples = shard
    out = tmp_path / "out"
    assert main(["export", "--format", "specforge", str(path.parent), str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == (
        f"exported 3 samples (16 tokens) as specforge to {out}\n"
        "layers: hidden_states[1, 2, 3] = outputs of decoder layers 0, 1, 2; specforge: {'0.2.0': "
        "{'aux_hidden_state_layer_ids': None, 'note': \"the target's architecture is not recorded: its class decides "
        "SGLang's rule\"}, 'hf_backend': {'aux_hidden_states_layers': [0, 1, 2]}, 'sglang_backend': "
        "{'aux_hidden_states_layers': None, 'note': \"the target's architecture is not recorded: its class decides "
        "SGLang's rule\"}}\n"
        "drafter config eagle_aux_hidden_state_layer_ids: vLLM [1, 2, 3], SGLang 0.5.16 (the target's architecture is "
        f"not recorded: its class decides SGLang's rule) (all in {out}/layers.json)\n")
    assert captured.err == ""  # post_norm data to SpecForge: nothing to warn about
    d = torch.load(out / "rows_0-2000" / "data_2.ckpt", weights_only=True)
    assert torch.equal(d["input_ids"], samples[2][0])
    assert main(["export", "--format", "speculators-v1", str(path.parent), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hsextract export: error: ") and "pass --force" in err


def test_export_warning_printed_once(shard, tmp_path, capsys):
    path, _ = shard
    assert main(["export", "--format", "speculators-v1", str(path.parent), str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("WARNING: export format speculators-v1 expects final_state=pre_norm")


def test_errors_exit_2_with_a_message(shard, tmp_path, capsys):
    path, _ = shard
    assert main(["validate", "--reference", str(tmp_path / "nope.pt"), str(path)]) == 2
    assert f"hsextract validate: error: --reference: {tmp_path / 'nope.pt'}: no such file" in capsys.readouterr().err
    folder = tmp_path / "speculators"  # a dataset's folder instead of one of its samples: the message names one
    folder.mkdir()
    assert main(["validate", "--reference", str(folder), str(path)]) == 2
    assert capsys.readouterr().err == (f"hsextract validate: error: --reference: {folder} is a directory; point it at "
                                       "one sample file (.pt, data_N.pt) of a speculators v1 dataset\n")
    (folder / "data_7.pt").write_bytes(b"")
    assert main(["validate", "--reference", str(folder), str(path)]) == 2
    assert capsys.readouterr().err == (f"hsextract validate: error: --reference: {folder} is a directory; point it at "
                                       f"one sample file in it (for example {folder / 'data_7.pt'})\n")
    assert main(["inspect", str(tmp_path / "missing.hss")]) == 2
    assert "no such shard file" in capsys.readouterr().err
    ref = tmp_path / "ref.pt"
    ids, hs, mask = make_sample(4)
    torch.save({"input_ids": ids, "hidden_states": hs, "loss_mask": mask}, ref)
    assert main(["validate", "--reference", str(ref), "--report", str(tmp_path / "r.json"), str(path), str(path)]) == 2
    assert "--report names one file but 2 shards were given" in capsys.readouterr().err


def test_a_file_system_refusal_is_one_line_and_leaves_nothing(shard, tmp_path, capsys):
    path, _ = shard
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["export", "--format", "specforge", str(path), str(afile / "out")]) == 2
    assert capsys.readouterr().err == (
        f"hsextract export: error: {afile}: not a folder, so the export {afile / 'out'} cannot be made beside it; "
        "choose another OUT_DIR\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "shards"] and afile.read_text() == ""
    if Path("/proc/self").is_dir():  # a folder no one can create in: the kernel's refusal, in one line
        assert main(["export", "--format", "specforge", str(path), "/proc/hsx-out"]) == 2
        assert capsys.readouterr().err == (  # the first file it makes there: the lock beside the export
            "hsextract export: error: /proc/.hsx-out.lock: No such file or directory; fix that path's permissions or "
            "free space, or choose another path (outputs are written whole or not at all)\n")


def test_ctrl_c_is_one_line_and_leaves_nothing(shard, tmp_path, capsys, monkeypatch):
    """Ctrl-C in the middle of an export (its first file written): exit 130 as SIGINT, one line, no traceback; no
    export and no temporary folder left beside the input."""
    from hsextract import export

    def interrupted(pds, tmp, *args):
        (tmp / "rows_0-2000").mkdir()
        (tmp / "rows_0-2000" / "data_0.ckpt").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setitem(export.EXPORTERS, "specforge", interrupted)
    path, _ = shard
    assert main(["export", "--format", "specforge", str(path.parent), str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == ("\nhsextract export: interrupted; nothing partial was left (outputs are "
                                       "written whole or not at all)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]


def test_validate_given_a_folder_names_its_shards(shard, tmp_path, capsys):
    path, _ = shard
    ref = tmp_path / "ref.pt"
    ids, hs, mask = make_sample(4)
    torch.save({"input_ids": ids, "hidden_states": hs, "loss_mask": mask}, ref)
    for given, shards in ((tmp_path, tmp_path / "shards"), (path.parent, path.parent)):
        assert main(["validate", "--reference", str(ref), str(path), str(given)]) == 2
        assert capsys.readouterr().err == (f"hsextract validate: error: {given} is a folder; validate takes shard "
                                           f"files: give {shards / '*.hss'}\n")


def test_parser_is_extensible():
    names = set(build_parser()._subparsers._group_actions[0].choices)
    assert {"validate", "export", "inspect"} <= names and len(SUBCOMMANDS) >= 3
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


def test_console_entry_runs_as_module(shard):
    path, _ = shard
    r = subprocess.run([sys.executable, "-m", "hsextract.cli", "inspect", "--json", str(path)],
                       capture_output=True, text=True,
                       env={"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}, check=False)
    assert r.returncode == 0 and json.loads(r.stdout)["num_samples"] == 3


def test_a_closed_pipe_ends_the_command_quietly(shard):
    """`hsextract inspect --samples ... | head -1`: the reader closed the pipe; no error about permissions or free
    space (an OSError's advice), exit 141 as a process SIGPIPE ended. The pipe's read end is closed before the
    command starts, so its first write fails whatever the timing."""
    import os

    path, _ = shard
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([sys.executable, "-m", "hsextract.cli", "inspect", "--samples", str(path)], stdout=write,
                           stderr=subprocess.PIPE, text=True, check=False,
                           env={"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")})
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (141, "")


def test_masks_explain_marks_trained_spans(tmp_path, capsys):
    from chatfix import make_slow_tokenizer, make_tokenizer

    from hsextract.masks.explain import explain
    from hsextract.masks.masker import ChatMasker

    make_tokenizer("qwen3").save_pretrained(tmp_path / "model")
    conv = tmp_path / "conv.jsonl"
    msgs = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "How are you today?"}]
    conv.write_text(json.dumps({"messages": msgs}) + "\n")
    assert main(["masks", "--explain", str(conv), "--model", str(tmp_path / "model"), "--no-train-on-eot"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "== the chat template reads `enable_thinking` besides the variables every rendering passes; "
        "chat_template_kwargs: {}",
        f"== {conv}:1: 27 tokens, 6 trained",
        "<|im_start|>user", "Hello there!<|im_end|>", "<|im_start|>assistant", "<think>", "", "</think>", "",
        "⟦How are you today?⟧<|im_end|>", "",
        "== conversations 1, samples 1, turns 1"]
    assert main(["masks", "--explain", str(conv), "--model", str(tmp_path / "model"),
                 "--chat-template-kwargs", "[1]"]) == 2
    assert "--chat-template-kwargs must be a JSON object" in capsys.readouterr().err
    # A slow tokenizer (no offset mappings) explains the same way.
    assert explain(conv, ChatMasker(make_slow_tokenizer("kimi_k25"))).splitlines() == [
        "== the chat template reads `thinking` besides the variables every rendering passes; chat_template_kwargs: {}",
        f"== {conv}:1: 60 tokens, 8 trained",
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hello there!<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
        "⟦</think>How are you today?<|im_end|>⟧",
        "== conversations 1, samples 1, turns 1"]


def test_masks_explain_escapes_what_a_terminal_would_act_on_and_never_fails_on_the_locale(tmp_path, capsys):
    """Data's NUL, ESC (a colour sequence), bidi override and carriage return shown as escapes, in the trained
    span and out of it, so that the view is the text as the tokens hold it; a stdout that cannot write ⟦ (an
    ASCII or Latin-1 locale) gets the escape instead of a UnicodeEncodeError."""
    from chatfix import make_tokenizer

    make_tokenizer("qwen3").save_pretrained(tmp_path / "model")
    conv = tmp_path / "conv.jsonl"
    msgs = [{"role": "user", "content": "a\x00b\x1b[31mred\u202etxt\u3000\u00a0"},
            {"role": "assistant", "content": "ok\r\nthen\x1b[0m\tdone"}]
    conv.write_text(json.dumps({"messages": msgs}) + "\n")
    assert main(["masks", "--explain", str(conv), "--model", str(tmp_path / "model")]) == 0
    out = capsys.readouterr().out
    assert "a\\x00b\\x1b[31mred\\u202etxt\u3000\u00a0<|im_end|>" in out  # spaces print as they are
    assert "⟦ok\\r\nthen\\x1b[0m\tdone<|im_end|>⟧" in out
    assert not any(c in out for c in "\x00\x1b\u202e\r")
    env = {**__import__("os").environ, "PYTHONIOENCODING": "ascii", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "hsextract.cli", "masks", "--explain", str(conv), "--model",
                          str(tmp_path / "model")], capture_output=True, env=env)
    assert run.returncode == 0, run.stderr.decode()
    assert b"\\u27e6ok\\r\nthen" in run.stdout and run.stdout.isascii()
    # the data's own ⟦ and ⟧ escaped: the marks are explain's alone
    conv.write_text(json.dumps({"messages": [msgs[0], {"role": "assistant", "content": "a⟧ b ⟦c\ue000"}]}) + "\n")
    assert main(["masks", "--explain", str(conv), "--model", str(tmp_path / "model")]) == 0
    assert "⟦a\\u27e7 b \\u27e6c\\ue000<|im_end|>⟧" in capsys.readouterr().out


def test_files_are_read_as_utf8_whatever_the_locale(tmp_path):
    """A chat template, a conversation and the tokenizer's files with non-ASCII text, read in an ASCII locale
    without Python's UTF-8 mode (as a Latin-1 one would): the same tokens as in a UTF-8 locale (a template read in
    the locale's encoding changed the ids silently, and the run went on)."""
    import os

    from chatfix import make_tokenizer

    make_tokenizer("qwen3").save_pretrained(tmp_path / "model")
    template = tmp_path / "tpl é.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\nCafé 你好: {{ m.content }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
                        encoding="utf-8")
    conv = tmp_path / "conv.jsonl"
    msgs = [{"role": "user", "content": "naïve"}, {"role": "assistant", "content": "Ça va 😀"}]
    conv.write_text(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n", encoding="utf-8")
    outs = []
    for env in ({"LC_ALL": "C.UTF-8"}, {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}):
        run = subprocess.run([sys.executable, "-m", "hsextract.cli", "masks", "--explain", str(conv), "--model",
                              str(tmp_path / "model"), "--chat-template", str(template)], capture_output=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8", **env})
        assert run.returncode == 0, run.stderr.decode()
        outs.append(run.stdout.decode())
    assert outs[0] == outs[1]
    assert "<|im_start|>user\nCafé 你好: naïve<|im_end|>\n<|im_start|>assistant\n⟦Café 你好: Ça va 😀<|im_end|>" \
        in outs[0], outs[0]


def test_masks_explain_shows_refused_conversations_and_goes_on(tmp_path, capsys):
    """A conversation prepare would drop (a template's own refusal, a malformed record, a turn whose prompt opens
    reasoning it lacks) is shown with its reason and counted; the others are explained."""
    from chatfix import make_tokenizer

    make_tokenizer("gemma3").save_pretrained(tmp_path / "gemma")
    make_tokenizer("deepseek_r1").save_pretrained(tmp_path / "r1")
    conv = tmp_path / "conv.jsonl"
    hello = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "How are you today?"}]
    tool = [*hello, {"role": "tool", "content": "21"}]
    conv.write_text("\n".join([json.dumps({"messages": tool}), "{not json", json.dumps({"messages": hello})]) + "\n")
    assert main(["masks", "--explain", str(conv), "--model", str(tmp_path / "gemma")]) == 0
    out = capsys.readouterr().out.splitlines()[1:]
    assert out[0] == (f"== {conv}:1: refused (template_error): the chat template refused it: Conversation roles "
                      "must alternate user/assistant/user/assistant/...")
    assert out[1].startswith(f"== refused: {conv}:2: malformed record (bad_json): ")
    assert out[2:7] == [f"== {conv}:3: 25 tokens, 7 trained", "<bos><start_of_turn>user", "Hello there!<end_of_turn>",
                       "<start_of_turn>model", "⟦How are you today?<end_of_turn>⟧"]
    assert out[-1].endswith(", refused template_error 1") and out[-1].count("refused") == 2
    assert main(["masks", "--explain", str(conv), "--model", str(tmp_path / "r1")]) == 2  # every one refused
    out = capsys.readouterr().out.splitlines()[1:]
    assert out[2] == (f"== {conv}:3: refused (not_prefix_stable): assistant turn 1: the generation prompt opens a "
                      "reasoning block ('<think>') that the template never renders for an assistant turn, and this "
                      "turn has no reasoning to fill it: give it `reasoning_content`, or its raw text with "
                      "'</think>' in `content` (or regenerate the responses with this model)")
    # nothing explainable: the refusals shown, and an error (it exited 0)
    conv.write_text("\n".join([json.dumps({"messages": tool}), "{not json"]) + "\n")
    assert main(["masks", "--explain", str(conv), "--model", str(tmp_path / "gemma")]) == 2
    out, err = capsys.readouterr()
    # (without the config's advice, `strict: false`: no option of this command)
    assert out.splitlines()[2].startswith(f"== refused: {conv}:2: malformed record (bad_json): invalid JSON: ")
    assert "strict" not in out
    assert err == (f"hsextract masks: error: {conv}: no conversation of it could be explained (each refusal is shown "
                   "above, with its reason)\n")


def test_masks_explain_takes_a_split_and_speaks_of_its_options(tmp_path, capsys):
    """A DatasetDict of two splits is explained split by split (--split); errors about the file name the CLI's
    options, not config keys; a file whose every record is refused ends with its counts, and exits 2."""
    import datasets
    from chatfix import make_tokenizer

    make_tokenizer("gemma3").save_pretrained(tmp_path / "gemma")
    hello = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "How are you today?"}]
    twice = [{"role": "user", "content": "Hello"}, {"role": "user", "content": "there"}]
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"messages": hello}]),
                          "test": datasets.Dataset.from_list([{"messages": twice}])}).save_to_disk(str(dd))
    capsys.readouterr()  # save_to_disk's progress bars
    args = ["masks", "--model", str(tmp_path / "gemma"), "--explain"]
    assert main([*args, str(dd)]) == 2
    assert capsys.readouterr().err == (f"hsextract masks: error: {dd} is a DatasetDict with splits ['train', 'test']: "
                                       "pass --split NAME\n")
    assert main([*args, str(dd), "--split", "train"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"== {dd / 'train'}:record 1: 25 tokens, 7 trained"
    assert main([*args, str(dd), "--split", "test"]) == 2  # nothing explained: an error after the counts
    assert capsys.readouterr().out.splitlines()[-1] == "== refused template_error 1"
    assert main([*args, str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hsextract masks: error: --explain: {tmp_path / 'none.jsonl'} ") and "sources" not in err


def test_masks_explain_names_the_variables_the_template_reads_and_refuses_a_key_it_never_reads(tmp_path, capsys):
    """Kimi-K2.5's template reads `thinking`: `masks --explain` says so first; `enable_thinking` (Qwen's name)
    would change nothing, silently, and is refused naming the key and what the template reads."""
    from chatfix import make_tokenizer

    make_tokenizer("kimi_k25").save_pretrained(tmp_path / "model")
    conv = tmp_path / "conv.jsonl"
    msgs = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "How are you today?"}]
    conv.write_text(json.dumps({"messages": msgs}) + "\n")
    args = ["masks", "--explain", str(conv), "--model", str(tmp_path / "model"), "--chat-template-kwargs"]
    assert main([*args, '{"thinking": false}']) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        '== the chat template reads `thinking` besides the variables every rendering passes; chat_template_kwargs: '
        '{"thinking": false}')
    assert main([*args, '{"enable_thinking": false}']) == 2
    assert capsys.readouterr().err == (
        "hsextract masks: error: chat_template_kwargs: the chat template never reads `enable_thinking`, so it changes "
        "nothing (the data would be rendered as without it); the template reads `thinking` besides the variables "
        "every rendering passes. Use that name, or remove the key\n")


def test_masks_explain_color_marks_reasoning_blue(tmp_path, capsys):
    from chatfix import make_tokenizer

    make_tokenizer("qwen3").save_pretrained(tmp_path / "model")
    conv = tmp_path / "conv.jsonl"
    msgs = [{"role": "user", "content": "Hello there!"},
            {"role": "assistant", "content": "How are you today?", "reasoning_content": "The user greets."}]
    conv.write_text(json.dumps({"messages": msgs}) + "\n")
    assert main(["masks", "--explain", str(conv), "--model", str(tmp_path / "model"), "--color"]) == 0
    out = capsys.readouterr().out
    assert ("\x1b[34m<think>\nThe user greets.\n</think>\n\n\x1b[0m\x1b[32mHow are you today?\x1b[0m"
            "\x1b[33m<|im_end|>\x1b[0m\n") in out


@pytest.mark.parametrize("dtype,precision,shown", [
    ("float16", "bf16", "full (stored as float16)"), ("float32", "bf16", "full (stored as float32)"),
    ("bfloat16", "bf16", "full (stored as bfloat16)"), ("bfloat16", "fp8_e4m3", "fp8_e4m3")])
def test_inspect_text_precision_agrees_with_the_dtype(tmp_path, capsys, dtype, precision, shown):
    path = tmp_path / "chunk-00000.hss"
    with ShardWriter(path, shard_metadata(dtype=dtype), precision=precision) as w:
        w.add(*make_sample(3, dtype=getattr(torch, dtype)), sample_id="s0")
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.split()[0] in ("dtype", "precision")] == [
        f"dtype          {dtype}", f"precision      {shown}"]


def test_inspect_text_shows_the_final_norm_weight_as_its_size_and_hash(tmp_path, capsys):
    """The weight is hidden_size values of base64 (19 KB for Kimi-K2.5): the text gives its bytes and sha256,
    --json the whole entry."""
    import hashlib

    from hsextract.extract.final_norm import FinalNorm

    w = torch.linspace(0.5, 2.0, 16).to(torch.bfloat16)
    entry = FinalNorm("rms_norm", 1e-5, w, "model.safetensors:model.norm.weight").to_metadata()
    path = tmp_path / "chunk-00000.hss"
    with ShardWriter(path, shard_metadata(final_state="pre_norm", final_norm=entry)) as wr:
        wr.add(*make_sample(3, seed=0), sample_id="s0")
    assert main(["inspect", str(path)]) == 0
    digest = hashlib.sha256(w.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    assert ('final_norm     {"dtype": "bfloat16", "eps": 1e-05, "hidden_size": 16, "kind": "rms_norm", "source": '
            f'"model.safetensors:model.norm.weight", "weight": "<32 bytes, sha256 {digest}>"}}'
            in capsys.readouterr().out.splitlines())
    assert main(["inspect", "--json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["metadata"]["final_norm"] == entry


def test_a_file_that_is_no_shard_is_not_called_a_damaged_one(tmp_path, capsys):
    """README.md given to inspect: not "the shard is damaged: delete it" (advice for a shard alone)."""
    other = tmp_path / "README.md"
    other.write_text("# notes\n" * 20)
    assert main(["inspect", str(other)]) == 2
    assert capsys.readouterr().err == (
        f"hsextract inspect: error: {other}: not an hsextract shard (bad magic at byte 0); a shard damaged at its "
        "start reads so too: if this is one of a run's shards, delete it and rerun its chunk\n")
