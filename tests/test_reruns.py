"""hsextract.config.reruns: every config key is classified, once, as deciding rules' outputs or as operational; the
rules' `params: settings=` are built from it. What Snakemake then reruns, key by key, is checked on a finished
run by tests/test_workflow.py::test_every_config_key_reruns_exactly_the_rules_it_decides."""

from __future__ import annotations

import ast
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
    # the recorded config keeps the key's own value
    s = from_config({**CONFIG, "engine": "sglang", "transformers": {"dtype": "float16"}})
    assert reruns.value(s, "transformers.dtype") == "float16"

