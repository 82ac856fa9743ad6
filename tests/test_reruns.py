"""hsextract.config.reruns: every config key is classified, once, as deciding rules' outputs or as operational; the
rules' `params: settings=` are built from it. What Snakemake then reruns, key by key, is checked on a finished
run by tests/test_workflow.py::test_every_config_key_reruns_exactly_the_rules_it_decides."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path
from typing import Any

from hsextract.config import reruns
from hsextract.config.settings import from_config, schema

ROOT = Path(__file__).resolve().parents[1]
# explicit layers: the settings build without reading a model
CONFIG: dict[str, Any] = {"capture": "custom", "aux_layers": [1, 2, 3], "aux_layers_convention": "hidden_states",
                          "chat_template_kwargs": {"thinking": False}}


def schema_keys(props: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted keys of the schema, down to objects with fixed properties (as settings.SCHEMA_TO_TREE)."""
    out: set[str] = set()
    for key, sub in props.items():
        if sub.get("type") == "object" and "properties" in sub:
            out |= schema_keys(sub["properties"], f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


def settings_of(config: dict[str, Any] = CONFIG):
    keys = schema_keys(schema()["properties"])
    return from_config({k: v for k, v in config.items() if k in keys})


def test_every_schema_key_is_classified() -> None:
    keys = schema_keys(schema()["properties"])
    missing = sorted(keys - set(reruns.KEYS))
    assert not missing, (f"config keys hsextract.config.reruns.KEYS does not classify: {missing}; say which "
                         "rules' outputs each decides, or OPERATIONAL (threads, memory, devices, servers, secrets)")
    assert not sorted(set(reruns.KEYS) - keys), "KEYS classifies keys the schema does not have"
    assert set(reruns.PATHS) <= set(reruns.KEYS)


def test_rules_are_the_workflows() -> None:
    text = "\n".join(p.read_text() for p in sorted((ROOT / "workflow/rules").glob("*.smk")))
    defined = set(re.findall(r"^\s*rule (\w+):", text, re.M))
    assert set(reruns.RULES) <= defined, set(reruns.RULES) - defined
    for key, rules in reruns.KEYS.items():
        assert set(rules) <= set(reruns.RULES), (key, rules)
    # every rule that keys decide takes them as its params, from the one table
    for rule in reruns.RULES:
        takes = f'settings=RERUN["{rule}"]' in text
        assert takes == bool(reruns.params(settings_of(), rule)), rule
    assert "_KEYS" not in (ROOT / "workflow/rules/common.smk").read_text()  # no hand-kept key list beside it


def test_params_are_the_effective_values_of_the_keys_that_decide_the_rule() -> None:
    s = settings_of({**CONFIG, "sources": [{"path": "a.jsonl"}]})
    for rule in reruns.RULES:
        params = reruns.params(s, rule)
        # Snakemake compares params by repr and leaves out values of other types without a word
        assert ast.literal_eval(repr(params)) == params, rule
        assert list(params) == sorted(params)
        for key, value in params.items():
            assert rule in reruns.KEYS[key] and key not in reruns.PATHS
            assert value == reruns.effective(s, key)
            assert value == reruns.value(s, key) or key in reruns.EFFECTIVE
    prepare = reruns.params(s, "prepare")
    assert prepare["chat_template_kwargs"] == {"thinking": False}  # issue 35: it was none of prepare's params
    assert {"chat_template", "trust_remote_code", "model", "tokenizer"} <= set(prepare)
    # effective: defaults filled
    assert prepare["sources"] == [{"format": "auto", "max_records": None, "name": None, "path": "a.jsonl",
                                   "split": None, "weight": 1.0}]
    assert reruns.params(s, "extract")["aux_layers"] == [1, 2, 3]
    for key, rules in reruns.KEYS.items():
        if rules and key not in reruns.PATHS:
            assert all(key in reruns.params(s, rule) for rule in rules), key


def test_operational_keys_are_no_params() -> None:
    s = settings_of()
    taken = {key for rule in reruns.RULES for key in reruns.params(s, rule)}
    operational = {key for key, rules in reruns.KEYS.items() if rules == reruns.OPERATIONAL}
    assert not operational & taken
    assert {"transformers.token_budget", "transformers.device", "extract.threads", "extract.mem_mb",
            "shard.threads", "sglang.concurrency", "sglang.timeout_s"} <= operational


def test_no_secret_is_a_key_and_its_file_is_operational() -> None:
    """A config holds no secret (hsextract.config.redaction: config files go into snakemake --report), so no
    param (stored in .snakemake/metadata) can be one; the key naming its file decides no output."""
    from hsextract.config.redaction import SECRET_KEYS

    assert SECRET_KEYS and not set(SECRET_KEYS) & set(reruns.KEYS)
    assert all(reruns.KEYS[file_key] == reruns.OPERATIONAL for file_key in SECRET_KEYS.values())


def test_a_key_that_counts_for_nothing_in_a_run_is_no_param_there() -> None:
    """transformers.dtype decides the shards only on the transformers engine (SGLang serves bfloat16), regenerate.dtype
    regenerate's text only on its transformers engine, regenerate.send_seed only on its sglang engine: elsewhere the
    params hold what the rule sees, which a new value of the key leaves alone (tests/test_workflow.py plans it on a
    finished run)."""
    for engine, dtype in (("transformers", "float16"), ("sglang", "bfloat16")):
        s = from_config({**CONFIG, "engine": engine, "transformers": {"dtype": "float16"}})
        assert reruns.params(s, "extract")["transformers.dtype"] == dtype == s.extract.activation_dtype
    regen = {"enabled": True, "dtype": "float16", "server_url": "http://127.0.0.1:30998"}
    for engine, regen_engine, dtype in (("transformers", None, "float16"), ("sglang", None, None),
                                        ("sglang", "transformers", "float16"), ("transformers", "sglang", None)):
        s = from_config({**CONFIG, "engine": engine, "regenerate": {**regen, "engine": regen_engine}})
        params = reruns.params(s, "regenerate_chunk")
        assert params["regenerate.dtype"] == dtype, (engine, regen_engine)
        # the seed in each request to the SGLang server: none on transformers
        assert params["regenerate.send_seed"] == (None if dtype else True), (engine, regen_engine)
    # regenerate.engine null is the run's engine; greedy decoding draws nothing, whatever its seed and cut-offs
    sampling = {"seed": 7, "top_p": 0.5, "top_k": 3}
    for temperature, engine, drawn in ((0.0, None, None), (0.0, "transformers", None), (0.7, None, sampling)):
        s = from_config({**CONFIG, "regenerate": {"enabled": True, "temperature": temperature, "engine": engine,
                                                  **sampling}})
        params = reruns.params(s, "regenerate_chunk")
        assert params["regenerate.engine"] == "transformers"
        assert {k: params[f"regenerate.{k}"] for k in sampling} == (drawn or dict.fromkeys(sampling))
    # the recorded config keeps the key's own value
    s = from_config({**CONFIG, "engine": "sglang", "transformers": {"dtype": "float16"}})
    assert reruns.value(s, "transformers.dtype") == "float16"


def real_model(root: Path) -> Path:
    """A model directory as a checkpoint ships it (what file_params reads: names, sizes, mtimes, tokenizer files)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model-00001-of-00002.safetensors").write_bytes(b"w" * 64)
    (root / "model-00002-of-00002.safetensors").write_bytes(b"v" * 64)
    (root / "tokenizer.json").write_text('{"model": {}}')
    (root / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    (root / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (root / ".cache/huggingface").mkdir(parents=True)  # hf download --local-dir's bookkeeping
    (root / ".cache/huggingface/x.metadata").write_text("1")
    return root


def moved(path: Path, seconds: int) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


def test_file_params_follow_the_files_a_config_names(tmp_path: Path) -> None:
    """A real model, its tokenizer, its template and a source changed in place under the same path change the params
    of the rules that read them (hsextract.config.file_params), and only theirs; nothing changed, nothing differs."""
    from hsextract.config import file_params

    model = real_model(tmp_path / "model")
    source = tmp_path / "data/conv.jsonl"
    source.parent.mkdir()
    source.write_text('{"messages": []}\n')
    config = {**CONFIG, "make_tiny_model": False, "model": str(model), "sources": [{"path": str(source)}]}
    produced = [str(tmp_path / "results/run")]

    def files(rule: str, **over: Any) -> dict[str, Any]:
        return file_params.params(from_config({**config, **over}), rule, produced)

    before = {rule: files(rule) for rule in file_params.RULES}
    assert before == {rule: files(rule) for rule in file_params.RULES}  # stable
    for value in before.values():
        assert ast.literal_eval(repr(value)) == value and list(value) == sorted(value)
    assert set(before["prepare"]) == {"chat_template", "sources", "tokenizer"} and set(before["extract"]) == {"model"}
    assert before["make_tiny_model"] == {"corpus": before["prepare"]["sources"][0]}
    assert all(before["prepare"].values()) and before["extract"]["model"]
    # regenerate loads the model, and reads its generation_config.json (none here) on either engine
    assert before["regenerate_chunk"] == {**before["prepare"], **before["extract"], "generation_config": None}
    on_sglang = files("regenerate_chunk", engine="sglang", regenerate={"server_url": "http://127.0.0.1:1"})
    assert "model" not in on_sglang and on_sglang["generation_config"] is None

    def changed() -> set[str]:
        return {rule for rule in file_params.RULES if files(rule) != before[rule]}

    # a weight rewritten in place, same size: by mtime; the hub's bookkeeping and __pycache__ are no part of it
    moved(model / "model-00002-of-00002.safetensors", -5)
    (model / ".cache/huggingface/x.metadata").write_text("2")
    (model / "__pycache__").mkdir()
    (model / "__pycache__/m.pyc").write_bytes(b"0")
    assert changed() == {"extract", "regenerate_chunk"}
    before = {rule: files(rule) for rule in file_params.RULES}
    # what the checkpoint ships for people (a fresh `hf download` rewrites it): nothing; its generation defaults:
    # regenerate's alone
    for name in ("README.md", "LICENSE", "docs/deploy_guidance.md", "figures/kimi-logo.PNG"):
        (model / name).parent.mkdir(exist_ok=True)
        (model / name).write_text("new")
    assert changed() == set()
    (model / "generation_config.json").write_text('{"eos_token_id": 7}')
    assert changed() == {"regenerate_chunk"}
    assert files("regenerate_chunk", engine="sglang", regenerate={"server_url": "http://127.0.0.1:1"}) != on_sglang
    (model / "modeling_kimi.py").write_text("")  # the model's own code: a forward's
    assert changed() == {"extract", "regenerate_chunk"}
    before = {rule: files(rule) for rule in file_params.RULES}
    # a tokenizer file or the template rewritten: by content (prepare's); touched alone, nothing
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        moved(model / name, 7)
        assert changed() == set(), name
        (model / name).write_text((model / name).read_text() + " ")
        assert changed() == {"prepare", "regenerate_chunk"}, name
        before = {rule: files(rule) for rule in file_params.RULES}
    # a source replaced by other content of an older date (cp -p, rsync -a)
    other = tmp_path / "other.jsonl"
    other.write_text('{"messages": [1]}\n')
    os.utime(other, ns=(0, source.stat().st_mtime_ns - 10**10))
    other.replace(source)
    assert changed() == {"prepare", "regenerate_chunk", "make_tiny_model"}  # the tiny model's tokenizer corpus, too
    # a chat_template given as a file, replaced by an older one: by content
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    before = {rule: files(rule, chat_template=str(template)) for rule in ("prepare", "regenerate_chunk")}
    st = template.stat()
    template.write_text("{{ messages[0] }}")
    os.utime(template, ns=(st.st_atime_ns, st.st_mtime_ns - 10**10))
    assert {r: files(r, chat_template=str(template)) != before[r] for r in before} == {"prepare": True,
                                                                                         "regenerate_chunk": True}
    # a separate tokenizer directory: its files, and the model's tokenizer files then count for extract
    tok = real_model(tmp_path / "tok")
    got = files("prepare", tokenizer=str(tok))
    (tok / "tokenizer.json").write_text('{"model": {"x": 1}}')
    assert files("prepare", tokenizer=str(tok)) != got
    got = files("extract", tokenizer=str(tok))
    moved(model / "tokenizer.json", 3)
    assert files("extract", tokenizer=str(tok)) != got


def test_the_modules_custom_tokenizer_code_imports_are_the_tokenizers(tmp_path: Path) -> None:
    """Kimi-K2.5's tokenization_kimi.py renders tool declarations with `from .tool_declaration_ts import ...`: the
    modules the tokenizer's code (tokenization_*.py, auto_map's) imports relatively, as far as those go, decide the
    ids as it does, so a change reruns prepare; the model's own code stays extract's."""
    from hsextract.config import file_params
    from hsextract.provenance import tokenizer_code

    model = real_model(tmp_path / "model")
    (model / "tokenizer_config.json").write_text(json.dumps({"auto_map": {
        "AutoTokenizer": ["custom_tok.T", None], "AutoProcessor": "org/repo--remote_proc.P",  # another repo's code
        "AutoConfig": "../../outside.C"}}))  # no module name: nothing outside the folder is read
    code = {"tokenization_kimi.py": "from .tool_declaration_ts import encode\nfrom . import helpers, absent\n",
            "tool_declaration_ts.py": "import json\nfrom .util.deep import x\n", "helpers.py": "",
            "util/__init__.py": "", "util/deep.py": "", "custom_tok.py": "def f():\n    from .later import y\n",
            "later.py": "from tokenization_kimi import z\n", "modeling_m.py": "from .helpers import h\n",
            "broken.py": "from .x import (", "tokenization_bad.py": "def (:\n",
            "tokenization_deep.py": "x = " + "1+" * 200_000 + "1\n",  # ast's recursion limit: skipped, not raised
            "remote_proc.py": ""}
    for name, text in code.items():
        (model / name).parent.mkdir(exist_ok=True)
        (model / name).write_text(text)
    assert tokenizer_code(model) == ["custom_tok.py", "helpers.py", "later.py", "tokenization_bad.py",
                                     "tokenization_deep.py", "tokenization_kimi.py", "tool_declaration_ts.py",
                                     "util/__init__.py", "util/deep.py"]
    config = {**CONFIG, "make_tiny_model": False, "model": str(model), "sources": [{"path": str(model / "x.py")}]}

    def files() -> dict[str, Any]:
        return {rule: file_params.params(from_config(config), rule, []) for rule in ("prepare", "extract")}

    before = files()
    for name, rules in (("tool_declaration_ts.py", {"prepare"}), ("util/deep.py", {"prepare"}),
                        ("modeling_m.py", {"extract"})):
        (model / name).write_text((model / name).read_text() + "# changed, a longer file\n")
        now = files()
        assert {rule for rule in now if now[rule] != before[rule]} == rules, name
        before = now


def test_file_params_leave_out_what_the_workflow_writes_and_hub_ids(tmp_path: Path) -> None:
    """The tiny model make_tiny_model builds, the regenerated conversations prepare reads, a hub id, a path not there
    yet: no signature (None), so that a first run's outputs appearing between two invocations rerun nothing."""
    from hsextract.config import file_params

    model = real_model(tmp_path / "resources/tiny-model")
    produced = [str(tmp_path / "results/run"), str(model)]
    regenerated = tmp_path / "results/run/regenerated/conversations.jsonl"
    regenerated.parent.mkdir(parents=True)
    regenerated.write_text("{}\n")
    s = from_config({**CONFIG, "make_tiny_model": True, "model": str(model), "sources": [{"path": str(regenerated)}]})
    assert file_params.params(s, "prepare", produced) == {"chat_template": None, "sources": [None], "tokenizer": None}
    assert file_params.params(s, "extract", produced) == {"model": None}
    assert file_params.params(s, "validate", produced) == {}
    s = from_config({**CONFIG, "make_tiny_model": False, "model": "moonshotai/Kimi-K2.5",
                     "sources": [{"path": str(tmp_path / "missing.jsonl")}]})
    assert file_params.params(s, "prepare", produced) == {"chat_template": None, "sources": [None], "tokenizer": None}
    assert file_params.params(s, "extract", produced) == {"model": None}
    s = from_config({**CONFIG, "regenerate": {"enabled": True}, "sources": [{"path": str(regenerated.parent)}]})
    assert file_params.params(s, "prepare", produced)["sources"] == []  # it reads the regenerated file


def test_rules_take_their_file_params() -> None:
    from hsextract.config import file_params

    text = "\n".join(p.read_text() for p in sorted((ROOT / "workflow/rules").glob("*.smk")))
    for rule in reruns.RULES:
        assert (f'files=FILES["{rule}"]' in text) == (rule in file_params.RULES), rule


def test_a_preset_and_its_own_list_written_out_are_the_same_params() -> None:
    """capture: eagle3, and capture: custom with the layers it resolves to in either convention, store the same
    layers: extract's params are equal, so a config rewritten that way reruns no extract (on Kimi, GPU-hours); a
    list that differs by one layer is another param."""
    tiny = {"model": "resources/no-such-model", "make_tiny_model": True}  # the tiny model's 10 layers, unbuilt
    written = [{"capture": "eagle3"},
               {"capture": "custom", "aux_layers": [2, 5, 7], "aux_layers_convention": "hidden_states"},
               {"capture": "custom", "aux_layers": [1, 4, 6], "aux_layers_convention": "layer_output"}]
    params = [reruns.params(settings_of({**tiny, **w}), "extract") for w in written]
    assert params[0]["aux_layers"] == [2, 5, 7] and params[1] == params[0] and params[2] == params[0]
    shifted = {"capture": "custom", "aux_layers": [2, 5, 7], "aux_layers_convention": "layer_output"}
    assert reruns.params(settings_of({**tiny, **shifted}), "extract")["aux_layers"] == [3, 6, 8]


def test_a_source_path_spelled_another_way_is_the_same_param() -> None:
    """`./data/x.jsonl` and `data//x.jsonl` name `data/x.jsonl`: prepare's params (and the tiny model's corpus) are
    the same, so rewriting the path reruns nothing; another file is another param."""
    def prepare(path: str) -> dict[str, Any]:
        return reruns.params(settings_of({**CONFIG, "sources": [{"path": path}]}), "prepare")

    assert prepare("./data/x.jsonl") == prepare("data//x.jsonl") == prepare("data/x.jsonl")
    assert prepare("data/x.jsonl")["sources"][0]["path"] == "data/x.jsonl"
    assert prepare("data/y.jsonl") != prepare("data/x.jsonl")


def test_a_value_written_another_way_is_the_same_param() -> None:
    """A source's weight `1` (`1.0`), its name written out as the one it gets anyway (its file's stem), a tokenizer
    naming the model's own directory (null), a model directory with a trailing slash: the same params, so the
    rewritten config reruns no prepare and no extract; another value is another param."""
    def params(**over: Any) -> dict[str, dict[str, Any]]:
        config = {**CONFIG, "model": "models/m", "make_tiny_model": False,
                  "sources": [{"path": "data/x.jsonl"}, {"path": "data/y.jsonl", "weight": 0.5}], **over}
        return {rule: reruns.params(settings_of(config), rule) for rule in ("prepare", "extract")}

    first = params()
    assert first["prepare"]["sources"][0] == {"path": "data/x.jsonl", "format": "auto", "weight": 1.0,
                                              "max_records": None, "name": None, "split": None}
    for same in ({"sources": [{"path": "data/x.jsonl", "weight": 1, "name": "x"}, {"path": "data/y.jsonl",
                                                                                   "weight": 0.5, "name": "y"}]},
                 {"tokenizer": "models/m"}, {"tokenizer": "./models/m/"}, {"model": "models/m/"},
                 {"model": "./models//m", "tokenizer": "models/m"}):
        assert params(**same) == first, same
    for other in ({"sources": [{"path": "data/x.jsonl", "weight": 2}, {"path": "data/y.jsonl", "weight": 0.5}]},
                  {"sources": [{"path": "data/x.jsonl", "name": "z"}, {"path": "data/y.jsonl", "weight": 0.5}]},
                  {"tokenizer": "models/t"}, {"model": "models/n"}):
        assert params(**other)["prepare"] != first["prepare"], other
    assert params(tokenizer="models/t/")["prepare"]["tokenizer"] == "models/t"
    # `..` after a symbolic link is not the folder before it: another spelling of another path, kept
    assert params(model="models/link/../m")["extract"]["model"] == "models/link/../m"
    # prepare's `tokenizer=` param (common.smk: path_spelling(tokenizer_dir)) alike too
    from hsextract.config.settings import path_spelling

    assert {path_spelling(settings_of({**CONFIG, "model": m, "tokenizer": t}).extract.tokenizer_dir)
            for m, t in (("models/m", None), ("./models/m/", None), ("models/m", "models/m/"))} == {"models/m"}
    # the jobs load the model as written: only the params take the one spelling
    assert settings_of({**CONFIG, "model": "./models/m/", "tokenizer": "models/m"}).extract.tokenizer_dir == "models/m"
    assert settings_of({**CONFIG, "model": "./models/m/"}).extract.model == "./models/m/"
