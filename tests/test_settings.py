"""The settings tree (hsextract.config.settings) agrees with the config schema, key for key and default for default."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsextract.config import settings as st
from hsextract.errors import ConfigError
from hsextract.provenance import config_hash

ROOT = Path(__file__).resolve().parents[1]
# tree leaves that are no schema key of their own: derived values, and the copies of a key in a second
# section (prepare loads the tokenizer too; the sglang client and server follow prepare's share_prefixes)
DERIVED = {"config", "extract.config_hash", "validate.same_model", "prepare.trust_remote_code",
           "extract.share_prefixes"}


def schema_leaves(props: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> its schema, for every key that is not an object with fixed properties."""
    out: dict[str, Any] = {}
    for key, sub in props.items():
        if sub.get("type") == "object" and "properties" in sub:
            out.update(schema_leaves(sub["properties"], f"{prefix}{key}."))
        else:
            out[prefix + key] = sub
    return out


def tree_leaves(cls: type, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        sub = st.__dict__.get(str(f.type).split(" ")[0])
        if isinstance(sub, type) and dataclasses.is_dataclass(sub) and sub is not st.Source:
            out |= tree_leaves(sub, f"{prefix}{f.name}.")
        else:
            out.add(prefix + f.name)
    return out


def plain(value: Any) -> Any:
    """Tree values in the config's own shapes (lists, dicts), to compare with schema defaults."""
    if dataclasses.is_dataclass(value):
        return value.as_dict()
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value


def attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_schema_key_has_one_field_and_every_field_a_key() -> None:
    leaves = schema_leaves(st.schema()["properties"])
    assert sorted(st.SCHEMA_TO_TREE) == sorted(leaves)
    assert tree_leaves(st.Settings) == set(st.SCHEMA_TO_TREE.values()) | DERIVED
    source_keys = st.schema()["properties"]["sources"]["items"]["properties"]
    assert [f.name for f in dataclasses.fields(st.Source)] == list(source_keys)


def test_defaults_are_the_schemas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the eagle3 preset (the default) needs the model's depth: the tiny model's, known before it is built;
    # without a readable model it stays unresolved (in a folder where `make run` built none)
    monkeypatch.chdir(tmp_path)
    assert st.from_config({}).extract.aux_layers is None
    s = st.from_config({"make_tiny_model": True})
    leaves = schema_leaves(st.schema()["properties"])
    item = {k: v["default"] for k, v in leaves["sources"]["items"]["properties"].items() if "default" in v}
    resolved = {"make_tiny_model": True, "aux_layers": [2, 5, 7], "aux_layers_convention": "hidden_states"}
    assert {k: leaves[k]["default"] for k in resolved} == {
        "make_tiny_model": False, "aux_layers": None, "aux_layers_convention": None}
    for key, tree_path in st.SCHEMA_TO_TREE.items():
        default = resolved.get(key, leaves[key]["default"])
        if key == "sources":  # the default entries get the item defaults too
            default = [{**item, **entry} for entry in default]
        assert plain(attr(s, tree_path)) == default, key
    # a source gets the item defaults
    assert st.from_config({"sources": [{"path": "x.jsonl"}]}).prepare.sources == (
        st.Source(path="x.jsonl", format="auto", weight=1.0, max_records=None, name=None, split=None),
    )
    assert s.validate == st.ValidateSettings("resources/reference/speculators-v1-data_0.pt", same_model=False)
    assert (s.extract.model, s.extract.aux_layers, s.extract.config_hash) == ("resources/tiny-model", (2, 5, 7),
                                                                            s.config_hash)


@pytest.mark.parametrize("name", ["config.yaml", "kimi.yaml"])
def test_filled_config_equals_snakemakes(name: str) -> None:
    utils = pytest.importorskip("snakemake.utils")
    raw = yaml.safe_load((ROOT / "config" / name).read_text())
    ours = st.fill_defaults(raw)
    theirs = yaml.safe_load((ROOT / "config" / name).read_text())
    utils.validate(theirs, str(ROOT / "workflow/schemas/config.schema.yaml"))
    assert ours == theirs
    s = st.from_config(raw)
    # the hash every shard records is the one of the config Snakemake hands the jobs
    assert s.config_hash == config_hash(theirs) == st.from_config(theirs).config_hash
    assert dict(s.config) == theirs


def test_tree_values_and_frozen() -> None:
    raw = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    s = st.from_config(raw)
    assert s.prepare.prompts_per_chunk == 64 and s.prepare.max_seq_len == 4096
    assert s.prepare.source_dicts() == [{"path": "data/conversations.jsonl", "format": "messages", "weight": 1.0,
                                         "max_records": None, "name": None, "split": None}]
    assert s.extract.transformers == st.TransformersSettings(device="cpu", dtype="bfloat16", token_budget=1024)
    assert s.extract.shard == st.ShardSettings(compression_level=3, threads=1, precision="bf16", check_free_space=True)
    assert (s.extract.threads, s.extract.mem_mb, s.extract.retries) == (2, 4000, 1)
    assert s.extract.tokenizer_dir == "resources/tiny-model"
    assert s.validate.same_model is False and s.stats == st.StatsSettings(64, 40)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.extract.shard.threads = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.config["seed"] = 1  # type: ignore[index]


@pytest.mark.parametrize(("config", "message"), [
    ({"prompts_per_chunk": 0}, "prompts_per_chunk: 0 is less than the minimum of 1"),
    ({"extract": {"threads": -1}}, "extract.threads: -1 is less than the minimum of 1"),
    ({"sources": [{"path": "a", "weight": -1}]}, "sources[0].weight: -1 is less than the minimum of 0"),
    ({"shard": {"level": 3}}, "shard.level: unknown key; config/README.md lists every key"),
])
def test_violation_names_the_key(config: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        st.from_config(config)
    assert str(e.value) == f"{message} (workflow/schemas/config.schema.yaml)"


@pytest.mark.parametrize(("config", "message"), [
    ({"prompts_per_chunck": 4}, "prompts_per_chunck: unknown key; did you mean `prompts_per_chunk`?"),
    ({"sglang": {"tpp": 8}}, "sglang.tpp: unknown key; did you mean `tp`?"),
    ({"shard": {"zzz": 1}}, "shard.zzz: unknown key; config/README.md lists every key"),
    ({"shard": {"precision": "fp4"}}, "shard.precision: 'fp4' is not one of"),
])
def test_schema_errors_are_one_line_naming_the_key(config: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        st.fill_defaults(config)
    assert str(e.value).startswith(message) and str(e.value).endswith("(workflow/schemas/config.schema.yaml)")
    assert "\n" not in str(e.value)
