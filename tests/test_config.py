"""Semantic config checks (hsextract.config.checks): each failure names the key and what is allowed."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import pytest
import torch
import yaml

from hsextract.config.checks import check
from hsextract.config.reference import ReferenceSampleError, read_layout
from hsextract.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "resources/reference/speculators-v1-data_0.pt"


def write_model(d: Path, layers: int = 6, hidden: int = 64) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(
        json.dumps({"model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden}))
    # what the parse reads of a tokenizer: that its files are there, and its chat template
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return d


def write_reference(path: Path, n_tensors: int = 4, hidden: int = 64, seq: int = 5) -> Path:
    torch.save(
        {
            "input_ids": torch.arange(seq, dtype=torch.int64),
            "hidden_states": [torch.zeros(seq, hidden, dtype=torch.bfloat16) for _ in range(n_tensors)],
            "loss_mask": torch.ones(seq, dtype=torch.int64),
        },
        path,
    )
    return path


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.chdir(tmp_path)
    write_model(tmp_path / "m")
    write_reference(tmp_path / "ref.pt")
    data = tmp_path / "conv.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(10)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    c.update(model="m", make_tiny_model=False, reference_sample="ref.pt", capture="custom", aux_layers=[1, 2, 3],
             aux_layers_convention="hidden_states", prompts_per_chunk=4)
    c["sources"] = [{"path": "conv.jsonl", "format": "messages", "weight": 1.0, "max_records": None}]
    return c


def test_valid_config_plans_chunks(cfg: dict) -> None:
    plan = check(cfg)
    assert (plan.n_records, plan.n_chunks) == (10, 3)
    assert (plan.model.num_layers, plan.model.hidden_size) == (6, 64)
    assert (plan.reference.num_tensors, plan.reference.hidden_size, plan.reference.seq_len) == (4, 64, 5)


def test_a_reference_of_another_dtype_than_the_shards(cfg: dict) -> None:
    """Validation compares each shard's layout, dtype included, with the reference sample's: a float32 run against
    a bf16 reference would fail every shard after the whole extraction; refused before it."""
    cfg["transformers"]["dtype"] = "float32"
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert str(e.value) == (
        "reference_sample: ref.pt holds bfloat16 hidden states, but this run's shards will hold float32 (engine "
        "transformers, transformers.dtype), and validation would fail every one: use a reference sample of float32, "
        "or transformers.dtype: bfloat16")
    ref = torch.load("ref.pt", weights_only=True)
    torch.save({**ref, "hidden_states": [t.float() for t in ref["hidden_states"]]}, "ref32.pt")
    cfg["reference_sample"] = "ref32.pt"
    check(cfg)


def test_a_chat_template_that_is_neither_file_nor_template(cfg: dict) -> None:
    """A mistyped path would otherwise be rendered as the template's text (every sample without a trained token)."""
    cfg["chat_template"] = "templates/qwen3.jinja"
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert str(e.value) == (f"chat_template: 'templates/qwen3.jinja' is no file (from {Path.cwd()}) and no Jinja "
                            "template (it has no {{ or {%): give the template file's path, or the template's text")
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    check(cfg)


def test_aux_layer_beyond_depth(cfg: dict) -> None:
    cfg["aux_layers"] = [1, 2, 6]
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert str(e.value) == (
        "aux_layers[2]: hidden_states[6] is beyond the aux layers of m/config.json: it has 6 decoder layers, so "
        "hidden_states ids 0..5 are allowed (hidden_states[L] is the last layer's output: the final state, "
        "final_state: pre_norm)"
    )
    cfg["aux_layers"] = [1, 2, 5]  # the last layer's input is a legal id
    assert check(cfg).n_chunks == 3


def test_an_export_of_final_states_only_is_refused_before_any_job(cfg: dict, tmp_path: Path) -> None:
    write_reference(tmp_path / "ref1.pt", n_tensors=1)
    cfg.update(capture="mtp", aux_layers=None, reference_sample="ref1.pt",
               export_formats=["speculators-v1", "specforge"])
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert str(e.value) == (
        "export_formats ['speculators-v1', 'specforge']: each stores EAGLE-3 training data (aux layers beside the "
        "final state), but capture: mtp stores the final state only; set export_formats: [] (read MTP data with "
        "hsextract.open_dataset), or capture: eagle3 (or dflash) for these consumers")
    cfg["export_formats"] = []
    assert check(cfg).aux_layers == []


@pytest.mark.parametrize("key", ["prompts_per_chunk", "max_seq_len", "transformers.token_budget", "extract.threads",
                                 "shard.threads"])
@pytest.mark.parametrize("value", [0, -3])
def test_sizes_must_be_positive(cfg: dict, key: str, value: int) -> None:
    c = copy.deepcopy(cfg)
    node = c
    *parents, last = key.split(".")
    for p in parents:
        node = node[p]
    node[last] = value
    with pytest.raises(ConfigError) as e:
        check(c)
    assert str(e.value) == f"{key}: {value} is less than the minimum of 1 (workflow/schemas/config.schema.yaml)"


def test_a_seed_torch_cannot_take_is_refused_at_parse_time(cfg: dict) -> None:
    """Audit: `seed: 1e23` passed, the make_tiny_model job deleted the built model and died in torch.manual_seed."""
    with pytest.raises(ConfigError) as e:
        check({**cfg, "seed": 2**63})
    assert str(e.value) == ("seed: 9223372036854775808 is greater than the maximum of 9223372036854775807 "
                            "(workflow/schemas/config.schema.yaml)")


@pytest.mark.parametrize("tokenizer, said", [
    ("/nope/tok", "tokenizer: '/nope/tok': no such directory; set `tokenizer` to a local tokenizer folder, a hub id, "
                  "or null (the model's)"),
    ("conv.jsonl", "tokenizer: 'conv.jsonl' is a file, not a tokenizer directory; set `tokenizer` to the folder that "
                   "holds tokenizer_config.json (or null: the model's)"),
    ("empty", "tokenizer: 'empty' holds no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model, "
              "tiktoken.model, vocab.json, vocab.txt, spiece.model); set `tokenizer` to the folder that holds them, "
              "or null (the model's)"),
])
def test_a_tokenizer_path_that_holds_none_is_refused_at_parse_time(cfg: dict, tokenizer: str, said: str) -> None:
    """Audit: each passed the dry run, and prepare's job failed (after the tiny model was built) without naming
    the key. A hub id is left to the load."""
    Path("empty").mkdir()
    with pytest.raises(ConfigError) as e:
        check({**cfg, "tokenizer": tokenizer})
    assert str(e.value) == said
    check({**cfg, "tokenizer": "m"})  # the model's folder, named: its tokenizer files


def test_a_chat_template_that_does_not_parse_is_refused_at_parse_time(cfg: dict) -> None:
    """Audit: `chat_template: "{% if %}"` passed the dry run; prepare then blamed the first record."""
    with pytest.raises(ConfigError) as e:
        check({**cfg, "chat_template": "{% if %}"})
    assert str(e.value) == ("chat_template: the template text, line 1: not a Jinja template that parses (Expected an "
                            "expression, got 'end of statement block'); fix the template, or set chat_template: null "
                            "for the tokenizer's own")
    Path("t.jinja").write_text("{{ bos_token }}\n{% for m in messages %}{{ m.content }\n{% endfor %}")
    with pytest.raises(ConfigError, match=r"^chat_template: t.jinja, line 2: not a Jinja template that parses"):
        check({**cfg, "chat_template": "t.jinja"})
    Path("t.jinja").write_text("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    check({**cfg, "chat_template": "t.jinja"})  # transformers' own tag: parses


@pytest.mark.parametrize("key, value", [("regenerate.temperature", float("nan")), ("sglang.timeout_s", float("inf"))])
def test_a_number_that_is_not_finite_is_refused_naming_its_key(cfg: dict, key: str, value: float) -> None:
    """Audit: `temperature: .nan` reached the settings (NaN passes every bound), `.inf` a timeout."""
    section, name = key.split(".")
    with pytest.raises(ConfigError) as e:
        check({**cfg, section: {name: value}})
    assert str(e.value) == f"{key}: {value} is not a finite number (YAML reads .nan and .inf as numbers); give a number"


def test_reference_not_v1(cfg: dict, tmp_path: Path) -> None:
    torch.save({"input_ids": torch.arange(3), "hidden_state": []}, tmp_path / "bad.pt")
    cfg["reference_sample"] = "bad.pt"
    with pytest.raises(ConfigError, match=r"^reference_sample: bad.pt is not a speculators v1 sample: "
                                          r"it holds \['hidden_state', 'input_ids'\]"):
        check(cfg)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    cfg["reference_sample"] = "junk.pt"
    with pytest.raises(ReferenceSampleError,
                       match=r"^reference_sample: junk.pt cannot be loaded with weights_only=True"):
        check(cfg)
    cfg["reference_sample"] = "missing.pt"
    with pytest.raises(ReferenceSampleError, match=r"^reference_sample: missing.pt: no such file"):
        check(cfg)


def test_reference_tensor_count_and_hidden_size(cfg: dict, tmp_path: Path) -> None:
    """The reference gives each tensor's layout; the count is the run's (aux_layers [1, 2, 3] + final = 4), so a
    reference of 3 or 6 tensors is taken (validation compares the count with the shard's aux layers)."""
    for n in (3, 6, 1):
        write_reference(tmp_path / f"ref{n}.pt", n_tensors=n)
        cfg["reference_sample"] = f"ref{n}.pt"
        plan = check(cfg)
        assert plan.reference.num_tensors == n and plan.aux_layers == [1, 2, 3]
    write_reference(tmp_path / "ref128.pt", hidden=128)
    cfg["reference_sample"] = "ref128.pt"
    with pytest.raises(ConfigError,
                       match=r"^reference_sample: ref128.pt has hidden size 128, but model m has hidden size 64"):
        check(cfg)


def test_shipped_reference_gives_the_layout_alone_for_any_model(cfg: dict, tmp_path: Path) -> None:
    """README: a real model's config may keep the shipped (Kimi-shaped, hidden 7168) reference. Its hidden size is
    no error for a model of 64 (it was: a ConfigError before any job, for every model but Kimi's width), wherever
    the file lies; validation then compares the layout alone. A reference of the user's own still must match."""
    import shutil

    from hsextract.config.settings import SHIPPED_REFERENCE_SHA256, from_config, is_shipped_reference
    from hsextract.provenance import sha256_file

    assert sha256_file(REFERENCE) == SHIPPED_REFERENCE_SHA256  # the constant follows the file
    shutil.copy(REFERENCE, tmp_path / "copy.pt")
    for ref in (str(REFERENCE), "copy.pt"):
        cfg["reference_sample"] = ref
        assert check(cfg).reference.hidden_size == 7168
        assert is_shipped_reference(ref) and from_config(cfg).validate.same_model is False
    cfg["reference_sample"] = "ref.pt"  # the user's own, of this model
    assert from_config(cfg).validate.same_model is True
    assert not is_shipped_reference("missing.pt")


def test_shipped_reference_is_v1() -> None:
    ref = read_layout(REFERENCE)
    assert (ref.num_tensors, ref.hidden_size, ref.seq_len) == (4, 7168, 24)


def test_unreadable_model(cfg: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "empty").mkdir()
    cfg["model"] = "empty"
    with pytest.raises(ConfigError, match=r"^model: cannot read empty/config.json"):
        check(cfg)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg["model"] = "no/such-model-dir"
    with pytest.raises(ConfigError, match=r"^model: 'no/such-model-dir' is not a readable model directory "
                       rf"\(relative to the working directory {re.escape(os.getcwd())}\) and"):
        check(cfg)
    # a path is no hub id: said at once (a file named there went through the hub's retries first)
    (tmp_path / "conversations.jsonl").write_text("{}\n")
    for model, message in (("conversations.jsonl", "model: 'conversations.jsonl' is a file, not a model directory; "
                                                   "set `model` to the directory that holds the checkpoint's "
                                                   "config.json"),
                           ("./no-such-dir", "model: './no-such-dir': no such directory; set `model` to a local "
                                             "Hugging Face model directory (config.json, weights, tokenizer) or a "
                                             "hub id")):
        monkeypatch.delenv("HF_HUB_OFFLINE")
        with pytest.raises(ConfigError) as e:
            check({**cfg, "model": model})
        assert str(e.value) == message
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_tiny_model_must_live_under_resources(cfg: dict) -> None:
    cfg.update(make_tiny_model=True, model="/models/kimi")
    with pytest.raises(ConfigError, match=r"^make_tiny_model: true builds a random-weight model at `model`, "
                                          r"so model must be a relative path under resources/"):
        check(cfg)


def test_tiny_model_never_replaces_a_model_of_the_users(cfg: dict, tmp_path: Path) -> None:
    """make_tiny_model is true in config/config.yaml: a user config that forgets to turn it off, its model under
    resources/, was replaced by the tiny model (a rule's output) once its corpus was newer. Refused at the parse."""
    mine = tmp_path / "resources/my-llama"
    write_model(mine)
    cfg.update(make_tiny_model=True, model="resources/my-llama")
    with pytest.raises(ConfigError, match=r"^make_tiny_model: true builds a random-weight model at resources/my-llama "
                                          r"and replaces what is there, but that folder holds files and no "
                                          r"hsextract_tiny.json, so it is not a tiny model hsextract built .*nothing "
                                          r"was changed. For a model of your own set make_tiny_model: false"):
        check(cfg)
    assert (mine / "config.json").is_file()
    (mine / "hsextract_tiny.json").write_text("{}")  # one the workflow built: rebuilt as before
    check(cfg)


def test_tiny_model_depth_known_before_it_exists(cfg: dict) -> None:
    from hsextract.tinymodel.build import TINY_CONFIG

    n = TINY_CONFIG["num_hidden_layers"]
    cfg.update(make_tiny_model=True, model="resources/tiny-model", aux_layers=[1, 2, n])
    with pytest.raises(ConfigError, match=rf"^aux_layers\[2\]: hidden_states\[{n}\] is beyond the aux layers of "
                                          r"the tiny"):
        check(cfg)
    # hidden size is not compared against the Kimi-shaped shipped reference for the tiny model
    cfg.update(aux_layers=[1, 2, n - 1], reference_sample=str(REFERENCE))
    assert check(cfg).model.hidden_size == TINY_CONFIG["hidden_size"]


def test_missing_source(cfg: dict) -> None:
    """A relative path is said with the folder it was looked for in (`snakemake -d DIR` resolves it there)."""
    cfg["sources"] = [{"path": "nope.jsonl", "format": "messages"}]
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert str(e.value) == (f"sources[0].path: nope.jsonl does not exist (relative to the working directory "
                            f"{os.getcwd()})")


def test_a_layer_output_id_beyond_depth_is_named_as_written(cfg: dict) -> None:
    """The error named only the hidden_states id it converts to (7 for a written 6), not the number in the file."""
    cfg.update(aux_layers=[1, 2, 6], aux_layers_convention="layer_output")
    with pytest.raises(ConfigError, match=r"^aux_layers\[2\]: layer_output 6, i.e. hidden_states\[7\] is beyond the "
                                          r"aux layers of m/config.json: it has 6 decoder layers"):
        check(cfg)
    cfg.update(aux_layers=[1, 2, 6], aux_layers_convention="hidden_states")
    with pytest.raises(ConfigError, match=r"^aux_layers\[2\]: hidden_states\[6\] is beyond the aux layers of m/"):
        check(cfg)


def test_a_tiny_model_another_run_names_is_not_rebuilt_under_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An outside audit: a second run (another run_name) with another seed rebuilt resources/tiny-model, and the first
    run, whose dataset.json names it, reran whole at its next command. Refused (as the Snakefile is read:
    workflow/rules/common.smk), naming that run; the same settings, or no other run, or the run's own results,
    pass."""
    from hsextract.config.checks import check_tiny_model_unshared
    from hsextract.config.settings import from_config
    from hsextract.tinymodel.marker import MARKER

    monkeypatch.chdir(tmp_path)
    model = tmp_path / "resources/tiny-model"
    model.mkdir(parents=True)
    (model / MARKER).write_text(json.dumps({"seed": 0, "tokenizer": "kimi", "conversations": "data/c.jsonl"}))
    base = {"make_tiny_model": True, "model": "resources/tiny-model", "tiny_model_tokenizer": "kimi",
            "sources": [{"path": "data/c.jsonl"}]}
    check_tiny_model_unshared(from_config({**base, "run_name": "b", "seed": 1}))  # no other run yet
    (tmp_path / "results/a").mkdir(parents=True)
    (tmp_path / "results/a/dataset.json").write_text(json.dumps({"model": "resources/tiny-model"}))
    check_tiny_model_unshared(from_config({**base, "run_name": "b", "seed": 0}))  # built as this run would build it
    check_tiny_model_unshared(from_config({**base, "run_name": "a", "seed": 1}))  # run a's own rebuild
    check_tiny_model_unshared(from_config({**base, "run_name": "b", "seed": 1, "make_tiny_model": False}))
    with pytest.raises(ConfigError) as e:
        check_tiny_model_unshared(from_config({**base, "run_name": "b", "seed": 1}))
    assert str(e.value) == (
        "make_tiny_model: resources/tiny-model holds a model built with seed 0, which run(s) a name "
        "(results/<run>/dataset.json), and run 'b' would rebuild it with seed 1: those runs would then rerun whole at "
        "their next command. Give this run a model folder of its own (`model: resources/tiny-model-b`), or delete the "
        "other runs' results first")


def test_a_stop_token_id_past_the_models_vocabulary_is_refused_at_parse_time(cfg: dict, tmp_path: Path) -> None:
    """An outside audit: `regenerate.stop_token_ids: [999999]` passed `snakemake -n` and failed in every job."""
    config = json.loads((tmp_path / "m/config.json").read_text())
    (tmp_path / "m/config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    check({**cfg, "regenerate": {"enabled": True, "stop_token_ids": [2, 999]}})
    check({**cfg, "regenerate": {"enabled": False, "stop_token_ids": [999999]}})  # not regenerating: not read
    with pytest.raises(ConfigError) as e:
        check({**cfg, "regenerate": {"enabled": True, "stop_token_ids": [2, 1000, 999999]}})
    assert str(e.value) == (
        "regenerate.stop_token_ids: [1000, 999999] are past the vocabulary of m/config.json "
        "(vocab_size 1000), so no generation would stop there; give the ids of the tokens that end a turn (or leave "
        "the key out: the template's are found)")
