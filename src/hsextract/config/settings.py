"""The run's settings: a frozen, typed tree built once from a workflow config.
One module, over 400 lines: a dataclass per schema section, which the tests hold against the schema as a whole.

Defaults live in one place, the JSON Schema (workflow/schemas/config.schema.yaml): `from_config`
validates a config against it, fills every missing key with the schema's default (as Snakemake's
`validate` does) and builds the tree. The dataclasses below have no defaults of their own;
tests/test_settings.py checks that every schema key has its field here and the other way round.

The tree is grouped by stage, so each stage function takes its own section:

    settings.prepare     sources, mixture and filter keys (top-level keys of the config)
    settings.extract     the `extract:` job keys, the engines' sections (`transformers:`, `sglang:`),
                         `shard:`, and the run-wide keys a shard records (model, layers, ...)
    settings.validate    the reference sample, and whether its hidden size counts
    settings.stats       `stats:`
    settings.regenerate  `regenerate:`

Each key has one place (SCHEMA_TO_TREE): the top level holds only the keys of no section (make_tiny_model,
tiny_model_tokenizer, capture, export_formats); prepare's copy of `trust_remote_code` (it loads the
tokenizer too) is the one exception. `Settings.config` keeps the filled config itself (read-only), which
dataset.json records and `config_hash` hashes.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any

from hsextract.capture import check_count, explicit_layers, resolve_aux_layers
from hsextract.config.guard import check_bounded
from hsextract.config.model_info import model_shape
from hsextract.config.redaction import UNQUOTED_KEYS, refuse_secret_keys
from hsextract.errors import ConfigError
from hsextract.provenance import config_hash, sha256_file

# package data: in a checkout a symlink to workflow/schemas/config.schema.yaml (the one file; Snakemake validates
# against it), in a built wheel a copy of it, so an installed hsextract builds Settings without the checkout
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "resources" / "config.schema.yaml"


@dataclass(frozen=True)
class Source:
    """One entry of `sources`, and the one type of a source: hsextract.prepare.conversations reads these (its
    parse_sources checks the path and fills `name`)."""

    path: str
    format: str
    weight: float
    max_records: int | None
    name: str | None
    split: str | None

    def as_dict(self) -> dict[str, Any]:
        """The entry as a config mapping (the workflow's params, a config built from them)."""
        return {"path": self.path, "format": self.format, "weight": self.weight,
                "max_records": self.max_records, "name": self.name, "split": self.split}


@dataclass(frozen=True)
class PrepareSettings:
    sources: tuple[Source, ...]
    seed: int
    prompts_per_chunk: int
    max_seq_len: int | None
    truncate: bool
    min_trained_tokens: int
    train_on_eot: bool
    train_on_reasoning: bool
    split_turns: str
    share_prefixes: bool
    dedup: bool
    strict: bool
    chat_template: str | None
    chat_template_kwargs: Mapping[str, Any]
    trust_remote_code: bool

    def source_dicts(self) -> list[dict[str, Any]]:
        return [s.as_dict() for s in self.sources]


@dataclass(frozen=True)
class TransformersSettings:
    device: str
    dtype: str
    token_budget: int


@dataclass(frozen=True)
class ShardSettings:
    compression_level: int
    threads: int
    precision: str
    check_free_space: bool


@dataclass(frozen=True)
class SGLangSettings:
    python: str | None
    launch_args: tuple[str, ...]
    host: str
    api_key_file: str | None  # the key's file: a config holds no secret (hsextract.config.redaction)
    allow_remote: bool
    port: int
    tp: int
    replicas: int
    gpus: tuple[int, ...] | None
    chunked_prefill_size: int | None
    capture: str
    concurrency: int
    timeout_s: float
    retries: int
    backoff_s: float
    staging_mb: int
    writer_threads: int
    prefill_cuda_graph: bool
    startup_timeout_s: float
    server_url: str | None
    servers: tuple[str, ...]
    dump_dir: str | None


@dataclass(frozen=True)
class ExtractSettings:
    # run-wide keys a shard records
    run_name: str
    model: str
    tokenizer: str | None
    # the tokenizer's and the sglang server's (--trust-remote-code): the checkpoint's own code may run
    trust_remote_code: bool
    engine: str
    # resolved hidden_states ids: a preset's layers for this model, or the explicit list; None: a preset that
    # cannot resolve (no readable model, too few layers: config.check refuses such a config)
    aux_layers: tuple[int, ...] | None
    final_state: str
    share_prefixes: bool  # prepare's: the sglang server keeps its radix cache on, the client sends parents first
    config_hash: str
    # the `extract:` job keys
    threads: int
    mem_mb: int
    retries: int
    transformers: TransformersSettings
    sglang: SGLangSettings
    shard: ShardSettings

    @property
    def activation_dtype(self) -> str:
        """dtype of the captured hidden states (the shard's precision setting may store them as fp8): the
        transformers engine's model dtype; SGLang serves in bfloat16."""
        return self.transformers.dtype if self.engine == "transformers" else "bfloat16"

    @property
    def tokenizer_dir(self) -> str:
        """The tokenizer's directory or hub id: `tokenizer`, else the model's."""
        return self.tokenizer or self.model

    @property
    def own_tokenizer(self) -> bool:
        """Whether `tokenizer` names one other than the model's (a path spelled another way names the model's)."""
        return self.tokenizer is not None and path_spelling(self.tokenizer) != path_spelling(self.model)


# sha256 of the reference sample this project ships (resources/reference/speculators-v1-data_0.pt): synthetic and
# Kimi-shaped (hidden 7168), so it gives the layout alone, whatever the model; any other file is the user's own.
SHIPPED_REFERENCE_SHA256 = "56b89ffea98869c824d0827db6f4a1c09a7ae8a5e9d88979f5dfdb54802a43f7"


def is_shipped_reference(path: str) -> bool:
    """Whether `path` holds the shipped reference sample (by content: a copy anywhere counts). Hashed once per
    file version: every Settings built (each parse, each job) asks."""
    try:
        st = os.stat(path)
    except OSError:  # missing or unreadable: the parse-time check says so
        return False
    return _hashes_as_shipped(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@cache
def _hashes_as_shipped(path: str, size: int, mtime_ns: int) -> bool:
    try:
        return sha256_file(path) == SHIPPED_REFERENCE_SHA256
    except OSError:
        return False


@dataclass(frozen=True)
class ValidateSettings:
    reference_sample: str
    # the reference's hidden size counts only for a real model and a reference of the user's own (the shipped
    # sample is Kimi-shaped: a Llama's 4096 or the tiny model's 256 are no error)
    same_model: bool


@dataclass(frozen=True)
class StatsSettings:
    position_bins: int
    seq_len_bins: int


@dataclass(frozen=True)
class RegenerateSettings:
    enabled: bool
    engine: str | None
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int
    batch_size: int
    tool_turns: str
    complete_last_turn: bool
    drop_truncated: bool
    stop_token_ids: tuple[int, ...] | None
    think_start: str
    think_end: str
    device: str
    dtype: str
    server_url: str | None
    api_key_file: str | None  # the regeneration server's key (hsextract.sglang.keyfile.read_key_file)
    request_timeout_s: float
    retries: int
    send_seed: bool


@dataclass(frozen=True)
class Settings:
    """The sections, and the few keys that belong to none of them. A run-wide key lives in the section of
    the stage that records it (run_name, model, tokenizer, engine, aux_layers, final_state: extract;
    reference_sample: validate), never twice; SCHEMA_TO_TREE says where each key is."""

    make_tiny_model: bool
    tiny_model_tokenizer: str
    capture: str
    aux_layers_convention: str  # of the resolved ids (extract.aux_layers): always hidden_states (hsextract.layers)
    export_formats: tuple[str, ...]
    prepare: PrepareSettings
    extract: ExtractSettings
    validate: ValidateSettings
    stats: StatsSettings
    regenerate: RegenerateSettings
    config: Mapping[str, Any]  # the filled config (read-only view)

    @property
    def config_hash(self) -> str:
        """The hash every shard and dataset.json record (of the filled config, which holds no secret)."""
        return self.extract.config_hash


# Where each schema key lives in the tree (dotted schema key -> dotted attribute path); every
# leaf key of the schema is listed, and tests/test_settings.py checks both directions.
SCHEMA_TO_TREE: dict[str, str] = {
    **{key: f"extract.{key}" for key in (
        "run_name", "model", "tokenizer", "trust_remote_code", "engine", "aux_layers", "final_state")},
    **{key: key for key in ("make_tiny_model", "tiny_model_tokenizer", "capture", "aux_layers_convention",
                            "export_formats")},
    "reference_sample": "validate.reference_sample",
    **{key: f"prepare.{key}" for key in (
        "sources", "seed", "prompts_per_chunk", "max_seq_len", "truncate", "min_trained_tokens", "train_on_eot",
        "train_on_reasoning", "split_turns", "share_prefixes", "dedup", "strict", "chat_template",
        "chat_template_kwargs")},
    **{f"extract.{key}": f"extract.{key}" for key in ("threads", "mem_mb", "retries")},
    **{f"transformers.{f}": f"extract.transformers.{f}" for f in TransformersSettings.__dataclass_fields__},
    **{f"shard.{f}": f"extract.shard.{f}" for f in ShardSettings.__dataclass_fields__},
    **{f"sglang.{f}": f"extract.sglang.{f}" for f in SGLangSettings.__dataclass_fields__},
    **{f"stats.{f}": f"stats.{f}" for f in StatsSettings.__dataclass_fields__},
    **{f"regenerate.{f}": f"regenerate.{f}" for f in RegenerateSettings.__dataclass_fields__},
}


@cache
def schema() -> dict[str, Any]:
    """The workflow's config schema (read once)."""
    import yaml

    try:
        return yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(
            f"cannot read the config schema {SCHEMA_PATH} ({e}), hsextract's package data (in a checkout a "
            f"symlink to workflow/schemas/config.schema.yaml): reinstall hsextract, or restore that file"
        ) from None


@cache
def _validator() -> Any:
    import jsonschema

    base = jsonschema.Draft202012Validator
    check_properties = base.VALIDATORS["properties"]

    def fill_defaults(validator: Any, properties: Mapping[str, Any], instance: Any, sub: Mapping[str, Any]) -> Any:
        # as Snakemake's validate(set_default=True): missing keys get the schema's default, then are checked
        if validator.is_type(instance, "object"):
            for key, prop in properties.items():
                if "default" in prop:
                    instance.setdefault(key, copy.deepcopy(prop["default"]))
        yield from check_properties(validator, properties, instance, sub)

    # an integer is an int: JSON Schema's also takes 0.0, which the jobs then fail on (`seed: 0.0` in numpy's
    # SeedSequence, `prompts_per_chunk: 10.0` in range()); bool is no int here either, as in jsonschema
    strict = base.TYPE_CHECKER.redefine("integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool))
    return jsonschema.validators.extend(base, {"properties": fill_defaults}, type_checker=strict)(schema())


def fill_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `config` checked against the schema, every missing key set to its default.

    A violation is a ConfigError naming the key (dotted, with list indices) and what the schema allows.
    """
    check_bounded(config)  # before jsonschema walks (and its messages print) an alias-expanded tree
    refuse_secret_keys(config)  # before a schema message could quote a secret
    filled = copy.deepcopy(dict(config))
    errors = sorted(_validator().iter_errors(filled), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        e = errors[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path).lstrip(".")
        raise ConfigError(f"{_message(where, e)} (workflow/schemas/config.schema.yaml)")
    return filled


# keys a release removed, with what replaced them (a config that still sets one is told why it went)
RETIRED_KEYS: dict[str, str] = {
    "sglang.share_prefixes_untested_on_gpu": "share_prefixes alone decides, with either engine: the SGLang path "
    "ran on a GPU (bench/README.md, SGLang shared prefixes); remove the key",
}


def _numeric_or_literal(text: str) -> bool:
    """Whether a string reads as a YAML number, boolean or null: what --config leaves a nested value as."""
    t = text.strip()
    if t.lower() in ("true", "false", "null"):
        return True
    try:
        float(t)
    except ValueError:
        return False
    return True


def _message(where: str, error: Any) -> str:
    """One line per violation; an unknown key names the allowed key it most likely misspells."""
    if error.validator != "additionalProperties" or not isinstance(error.instance, Mapping):
        message, quoted = error.message, repr(error.instance)
        if any(where == k or where.startswith((f"{k}.", f"{k}[")) for k in UNQUOTED_KEYS):
            message = message.replace(quoted, "the value (not shown: it could hold a key)")
        elif isinstance(error.instance, str) and len(quoted) > 80:  # a 5,000-character run_name: its length
            message = message.replace(quoted, f"{quoted[:40]}... ({len(error.instance)} characters)")
        if error.validator == "type" and ("." in where or where.endswith("]")) and isinstance(error.instance, str) \
                and _numeric_or_literal(error.instance):
            what = "list" if where.endswith("]") else "mapping"
            message += (f"; if given with --config: a {what} there reaches the workflow as text (Snakemake reads its "
                        f"items as strings): put the {what} in a --configfile")
        return f"{where or 'config'}: {message}"
    allowed = list(error.schema.get("properties", {}))
    unknown = [str(k) for k in error.instance if k not in allowed]
    parts = []
    for key in unknown:
        dotted = f"{where + '.' if where else ''}{key}"
        if dotted in RETIRED_KEYS:
            parts.append(f"{dotted}: removed; {RETIRED_KEYS[dotted]}")
            continue
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        hint = f"did you mean `{close[0]}`?" if close else "config/README.md lists every key"
        parts.append(f"{dotted}: unknown key; {hint}")
    return "; ".join(parts)


def path_spelling(path: str) -> str:
    """`path` in one spelling, naming what it names: `./data/x.jsonl`, `data//x.jsonl/` are `data/x.jsonl` (`..` is
    kept: after a symbolic link it is not the folder before it)."""
    return str(PurePosixPath(path))


def source_stem(path: str | os.PathLike[str]) -> str:
    """The name a source gets where it has none: its file name up to the first dot."""
    return Path(path).name.split(".")[0]


def canonical_source(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A `sources` entry in one spelling, so that rewriting it another way reruns nothing: its path_spelling, its
    weight a float (`1` is `1.0`), a name that is the one it would get anyway (source_stem) none."""
    path, weight = path_spelling(entry["path"]), entry["weight"]
    return {**entry, "path": path,
            "weight": float(weight) if isinstance(weight, int) and not isinstance(weight, bool) else weight,
            "name": None if entry["name"] == source_stem(path) else entry["name"]}


def _tuple(value: Any) -> tuple[Any, ...] | None:
    return None if value is None else tuple(value)


def _section(cls: type, values: Mapping[str, Any], **override: Any) -> Any:
    return cls(**{name: override[name] if name in override else values[name] for name in cls.__dataclass_fields__})


def from_config(config: Mapping[str, Any]) -> Settings:
    """The settings tree of a workflow config (missing keys take the schema's defaults)."""
    c = fill_defaults(config)
    digest = config_hash(c)  # no secret in it (fill_defaults refuses one)
    given = explicit_layers(c)  # hidden_states ids; a list must say its convention
    aux: tuple[int, ...] | None = None
    if given is None and c.get("capture") == "mtp":  # the final state alone: no depth needed
        aux = ()
    elif given is None:  # a preset (the Snakefile resolves it at parse time; a bare config here)
        try:
            aux = tuple(resolve_aux_layers(c, model_shape(c).num_layers))
        except ConfigError:  # no model to read the depth from, or too shallow: unresolved (config.check says why)
            aux = None
    else:
        check_count(c.get("capture") or "custom", given)
        aux = tuple(given)
    prepare = _section(
        PrepareSettings, c,
        sources=tuple(_section(Source, canonical_source(s)) for s in c["sources"]),
        chat_template_kwargs=MappingProxyType(dict(c["chat_template_kwargs"])),
    )
    sg = c["sglang"]
    extract = _section(
        ExtractSettings, {**c, **c["extract"]},
        aux_layers=aux,
        config_hash=digest,
        transformers=_section(TransformersSettings, c["transformers"]),
        shard=_section(ShardSettings, c["shard"]),
        sglang=_section(SGLangSettings, sg, launch_args=tuple(sg["launch_args"]), gpus=_tuple(sg["gpus"]),
                        servers=tuple(sg["servers"])),
    )
    rg = c["regenerate"]
    return _section(
        Settings, c,
        aux_layers_convention="hidden_states",
        export_formats=tuple(c["export_formats"]),
        prepare=prepare,
        extract=extract,
        validate=ValidateSettings(reference_sample=c["reference_sample"],
                                  same_model=not c["make_tiny_model"]
                                  and not is_shipped_reference(c["reference_sample"])),
        stats=_section(StatsSettings, c["stats"]),
        regenerate=_section(RegenerateSettings, rg, stop_token_ids=_tuple(rg["stop_token_ids"])),
        config=MappingProxyType(c),
    )


__all__ = [
    "ExtractSettings", "PrepareSettings", "RegenerateSettings", "SCHEMA_TO_TREE", "SGLangSettings",
    "SHIPPED_REFERENCE_SHA256", "Settings",
    "ShardSettings", "Source", "StatsSettings", "TransformersSettings", "ValidateSettings", "canonical_source",
    "fill_defaults", "from_config", "is_shipped_reference", "path_spelling", "schema", "source_stem",
]
