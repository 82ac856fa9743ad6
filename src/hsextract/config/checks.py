"""Semantic checks of a workflow config, run at parse time before any job starts.
One module, over 400 lines: every cross-key check in one place, in the order they run.

`hsextract.config.settings` checks the config against the JSON Schema (types, ranges, unknown keys) and
fills its defaults; this module checks what a schema cannot: layer ids against the model's depth,
that the model and the reference sample can be read, and that the reference sample's layout is
comparable with what the run will write. Every failure is a ConfigError that names the key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsextract.capture import resolve_aux_layers
from hsextract.config import chunks
from hsextract.config.guard import check_bounded, check_remote, check_source_path
from hsextract.config.model_info import ModelShape, model_shape
from hsextract.config.reference import ReferenceLayout, read_layout
from hsextract.config.reruns import regenerate_engine
from hsextract.config.settings import Settings, from_config
from hsextract.errors import ConfigError
from hsextract.layers import HIDDEN_STATES, LAYER_OUTPUT
from hsextract.tinymodel import marker as tinymodel_marker


@dataclass(frozen=True)
class Plan:
    """The checked settings tree, and what the checks learned that the workflow lays its jobs out by."""

    settings: Settings
    n_records: int
    n_chunks: int
    model: ModelShape
    reference: ReferenceLayout
    aux_layers: list[int]  # resolved from `capture` and `aux_layers` (hsextract.capture); also in settings


# Snakemake refuses a wildcard value that ends in one piece repeated 20 times or more (PeriodicWildcardError, its
# guard against endless recursion; snakemake.io.PeriodicityDetector): run_name is the {run} wildcard of every rule
_PERIODIC_END = re.compile(r"((?P<piece>.+?)(?P=piece){19,99})$")


def check_run_name(s: Settings) -> None:
    name = s.extract.run_name
    if m := _PERIODIC_END.search(name):
        piece, times = m.group("piece"), len(m.group(1)) // len(m.group("piece"))
        raise ConfigError(f"run_name: {name[:40]}{'...' if len(name) > 40 else ''} ends in {piece!r} repeated "
                          f"{times} times, which Snakemake refuses in a path's wildcard (20 or more); choose another "
                          f"name")


def check_tiny_model_path(s: Settings) -> None:
    if not s.make_tiny_model:
        return
    model = Path(s.extract.model)
    if model.is_absolute() or not model.parts or model.parts[0] != "resources" or ".." in model.parts:
        raise ConfigError(
            f"make_tiny_model: true builds a random-weight model at `model`, so model must be a "
            f"relative path under resources/ (got {s.extract.model!r}); for a real model set "
            f"make_tiny_model: false"
        )
    foreign = tinymodel_marker.foreign_contents(model)
    if foreign:
        raise ConfigError(
            f"make_tiny_model: true builds a random-weight model at {s.extract.model} and replaces what is there, "
            f"but that {foreign}: nothing was changed. For a model of your own set make_tiny_model: false; for the "
            f"tiny model, point `model` at another folder under resources/ (or delete this one)")
    if tiny_model_corpus(s) is None:
        raise ConfigError(
            "make_tiny_model: true trains the tiny model's tokenizer on the first .jsonl source, "
            "but `sources` has none; add one or set make_tiny_model: false"
        )


def check_stop_ids(s: Settings, shape: ModelShape) -> None:
    """regenerate.stop_token_ids within the model's vocabulary (config.json's vocab_size): an id past it is never
    generated, and every turn would run to max_new_tokens (the job checks the tokenizer's length again)."""
    ids = s.regenerate.stop_token_ids if s.regenerate.enabled else None
    beyond = [t for t in ids or () if shape.vocab_size is not None and t >= shape.vocab_size]
    if beyond:
        raise ConfigError(f"regenerate.stop_token_ids: {beyond} {'is' if len(beyond) == 1 else 'are'} past the "
                          f"vocabulary of {shape.source} (vocab_size {shape.vocab_size}), so no generation would stop "
                          "there; give the ids of the tokens that end a turn (or leave the key out: the template's are "
                          "found)")


def check_tiny_model_unshared(s: Settings, results: str | Path = "results", *, deletes: bool = False) -> None:
    """ConfigError where this run would rebuild the tiny model at `model` with other settings (seed, tokenizer,
    corpus), or delete it (`deletes`: `snakemake --delete-all-output`), while another run's dataset.json names that
    folder: that run would rerun whole at its next command, and its dataset.json would name a model that made none
    of its shards. Run as the Snakefile is read, by a command that runs or plans jobs or marks or deletes outputs
    (workflow/rules/common.smk; in the job it is too late: Snakemake removes the folder first)."""
    if not s.make_tiny_model:
        return
    model = Path(s.extract.model)
    try:
        built = json.loads((model / tinymodel_marker.MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # nothing built there yet (a damaged marker: the build replaces it)
    wanted = {"seed": s.prepare.seed, "tokenizer": s.tiny_model_tokenizer, "conversations": tiny_model_corpus(s)}

    def same(k: str, b: Any, v: Any) -> bool:
        return b == v or (k == "conversations" and isinstance(b, str) and isinstance(v, str) and
                          Path(b).resolve() == Path(v).resolve())

    differ = {k: (built.get(k), v) for k, v in wanted.items() if not same(k, built.get(k), v)}
    if not differ and not deletes:
        return
    others = []
    for manifest in sorted(Path(results).glob("*/dataset.json")):
        try:
            named = json.loads(manifest.read_text(encoding="utf-8")).get("model")
        except (OSError, ValueError, AttributeError):
            continue
        if manifest.parent.name != s.extract.run_name and isinstance(named, str) and \
                Path(named).resolve() == model.resolve():
            others.append(manifest.parent.name)
    if others and deletes:
        raise ConfigError(
            f"snakemake --delete-all-output: would delete {s.extract.model}, which run(s) {', '.join(others)} also "
            f"name (results/<run>/dataset.json): those runs would then rerun whole at their next command. Delete "
            f"this run's outputs alone (`rm -r results/{s.extract.run_name}`), or the other runs' results first")
    if others and differ:
        was = ", ".join(f"{k} {b!r}" for k, (b, _) in differ.items())
        now = ", ".join(f"{k} {v!r}" for k, (_, v) in differ.items())
        raise ConfigError(
            f"make_tiny_model: {s.extract.model} holds a model built with {was}, which run(s) {', '.join(others)} "
            f"name (results/<run>/dataset.json), and run {s.extract.run_name!r} would rebuild it with {now}: those "
            f"runs would then rerun whole at their next command. Give this run a model folder of its own (`model: "
            f"resources/tiny-model-{s.extract.run_name}`), or delete the other runs' results first")


def tiny_model_corpus(s: Settings) -> str | None:
    """The text the tiny model's tokenizer is trained on: the first JSONL source."""
    return next((src.path for src in s.prepare.sources if src.path.endswith(".jsonl")), None)


def check_server(s: Settings) -> None:
    """The server's arguments, GPUs and ports (the launcher checks them again when it starts one)."""
    from hsextract.sglang.server import check_gpus, check_launch_args, check_ports, check_prefill_graph

    # with any engine: a key given there would otherwise stay in the config that dataset.json records
    check_launch_args(s.extract.sglang.launch_args)
    if s.extract.engine == "sglang":
        check_gpus(s.extract.sglang.tp, s.extract.sglang.replicas, s.extract.sglang.gpus)
        check_ports(s.extract.sglang.port, s.extract.sglang.replicas)
        from hsextract.sglang.config import external_urls

        if not external_urls(s.extract):  # the key starts no external server (config/README.md says what to pass)
            check_prefill_graph(s.extract.sglang.prefill_cuda_graph, s.extract.final_state)


def check_engine(s: Settings) -> None:
    check_server(s)
    if s.extract.engine == "sglang":
        try:
            import hsextract.sglang.client  # noqa: F401 - importable is what is checked
        except ImportError as e:
            raise ConfigError(
                f"engine: sglang is not usable in this installation ({e}): reinstall hsextract "
                f"(`pip install -e .`), or use engine: transformers"
            ) from None
        from hsextract.sglang.config import configured_key

        configured_key(s.extract)  # the key file: there, ours, 0600, one key (the jobs read it again)
    regen = s.regenerate
    regen_engine = regenerate_engine(s) if regen.enabled else None
    loads = "engine" if s.extract.engine == "transformers" else \
        "regenerate.engine" if regen_engine == "transformers" else None
    if loads and not s.make_tiny_model:
        # the transformers engine loads the model in the extract (or regenerate) jobs: a checkpoint it cannot load is
        # refused now, not after prepare
        from hsextract.extract.text_model import find_wrapped_text_model, quantized_refusal

        wrapped = find_wrapped_text_model(s.extract.model)
        if wrapped is not None and (refusal := quantized_refusal(s.extract.model, wrapped)):
            raise ConfigError(f"{loads}: transformers: {refusal}")
    if regen_engine:
        check_regenerate_server(regen_engine, regen.server_url)
    if regen_engine == "sglang" and regen.api_key_file is not None:
        from hsextract.sglang.keyfile import read_key_file

        read_key_file(regen.api_key_file, "regenerate.api_key_file")


def check_regenerate_server(engine: str, server_url: str | None) -> None:
    """Regeneration on sglang talks to a server of its own (none is started for it): its url must be given."""
    if engine == "sglang" and not server_url:
        raise ConfigError("config key `regenerate.server_url` must be set (http://host:port of the SGLang "
                          "server) when regeneration runs on the sglang engine")


def check_layers(s: Settings, shape: ModelShape) -> list[int]:
    """The run's aux layers as hidden_states ids (preset or explicit list), each checked against the model's depth."""
    # ids >= 0 and unique in an explicit list: the schema's
    layers = resolve_aux_layers(s.config, shape.num_layers)
    for i, layer in enumerate(layers):
        if layer >= shape.num_layers:
            last = (" (hidden_states[L] is the last layer's output: the final state, final_state: pre_norm)"
                    if layer == shape.num_layers else "")
            given = (f"layer_output {s.config['aux_layers'][i]}, i.e. "
                     if s.config.get("aux_layers_convention") == LAYER_OUTPUT and s.config.get("aux_layers") else "")
            theirs = f" (layer_output ids 0..{shape.num_layers - 2})" if given else ""
            raise ConfigError(
                f"aux_layers[{i}]: {given}hidden_states[{layer}] is beyond the aux layers of {shape.source}: it has "
                f"{shape.num_layers} decoder layers, so hidden_states ids 0..{shape.num_layers - 1} are allowed"
                f"{theirs}{last}")
    return layers


def check_exports(s: Settings, aux_layers: Sequence[int]) -> None:
    """Every export format stores EAGLE-3 training data, whose drafter reads aux layers: refused here, before the
    GPU hours, rather than by the export job at the end."""
    if s.export_formats and not aux_layers:
        raise ConfigError(
            f"export_formats {list(s.export_formats)}: each stores EAGLE-3 training data (aux layers beside the final "
            f"state), but capture: {s.config.get('capture')} stores the final state only; set export_formats: [] "
            f"(read MTP data with hsextract.open_dataset), or capture: eagle3 (or dflash) for these consumers")


def check_reference(s: Settings, shape: ModelShape, ref: ReferenceLayout) -> None:
    """The reference sample gives the layout of each hidden-state tensor (v1 keys, rank 2: config.reference),
    its dtype and, for the same model, its hidden size; the number of tensors is the run's own (its aux layers
    + the final state: a `capture` preset's count, recorded in every shard), so a reference of another count
    is taken, and validation compares the count with the shard's aux layers (report.validate)."""
    dtype = s.extract.activation_dtype
    if ref.dtype != dtype:  # validation compares the shards' layout with the reference's, dtype included
        raise ConfigError(
            f"reference_sample: {s.validate.reference_sample} holds {ref.dtype} hidden states, but this run's "
            f"shards will hold {dtype} (engine {s.extract.engine}"
            f"{', transformers.dtype' if s.extract.engine == 'transformers' else ''}), and validation would fail "
            f"every one: use a reference sample of {dtype}"
            f"{f', or transformers.dtype: {ref.dtype}' if s.extract.engine == 'transformers' else ''}")
    # The shipped reference is Kimi-shaped and checks layout only; the workflow's own tiny model
    # is therefore not comparable by hidden size. A real model is: its reference should come
    # from a dataset of the same model.
    if s.validate.same_model and ref.hidden_size != shape.hidden_size:
        raise ConfigError(
            f"reference_sample: {s.validate.reference_sample} has hidden size {ref.hidden_size}, but "
            f"model {s.extract.model} has hidden size {shape.hidden_size}; point reference_sample at "
            f"a sample of a dataset of this model"
        )


def check_tokenizer(s: Settings) -> None:
    """Custom tokenizer code (tokenizer_config.json auto_map) only with trust_remote_code: true; a chat_template
    that is a file or a template; a checkpoint folder holds tokenizer files, and a whole tokenizer a template."""
    from hsextract.masks.kwargs import stored_template
    from hsextract.prepare.tokenizer_loading import (
        KEY,
        VOCABULARY_FILES,
        chat_template_file,
        check_tokenizer_files,
        check_tokenizer_source,
    )

    chat_template_file(s.prepare.chat_template)
    if s.prepare.chat_template:
        _check_template_parses(s.prepare.chat_template)

    source = s.extract.tokenizer_dir
    built_here = s.make_tiny_model and not s.extract.own_tokenizer
    if built_here and s.tiny_model_tokenizer == "kimi" and not s.extract.trust_remote_code:
        raise ConfigError(
            f"{KEY}: make_tiny_model builds {source} with tiny_model_tokenizer: kimi, a tokenizer that is custom "
            f"code (tokenization_kimi.py behind a tokenizer_config.json auto_map, packaged as Kimi-K2.5's is), "
            f"which transformers runs only with {KEY}: true. Set `{KEY}: true` in the config, or "
            f"tiny_model_tokenizer: fast")
    if s.extract.own_tokenizer:  # as `model` is checked: said now, not by prepare's job after the model is built
        _check_tokenizer_folder(source)
    if not built_here:  # a tiny model on disk may be stale: the rule rebuilds it as configured
        root = Path(source)
        # a checkpoint with its weights but no tokenizer (prepare's load says the same); a copy of config.json
        # alone, or with tokenizer_config.json, is the README's dry run without the weights: not judged here
        if any(next(root.glob(pattern), None) for pattern in ("*.safetensors", "*.bin")):
            check_tokenizer_files(source)
        check_tokenizer_source(source, s.extract.trust_remote_code)
        # the whole tokenizer only: a dry run may read a copy of config.json and tokenizer_config.json (README)
        whole = any((root / n).is_file() for n in VOCABULARY_FILES if n != "tokenizer_config.json")
        if whole and not s.prepare.chat_template and not stored_template(source) \
                and not (root / "chat_template.json").is_file():
            raise ConfigError(
                f"the tokenizer at {source} has no chat template (no chat_template.jinja, no chat_template in "
                f"tokenizer_config.json): set `chat_template` to this model's template (a file, or its text)")


def _check_template_parses(chat_template: str) -> None:
    """ConfigError where `chat_template` is no Jinja that parses: said now, naming the key, not by prepare's job
    as a failure on the first record (whose advice, strict: false, would drop every record)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from hsextract.masks.kwargs import stored_template
    from hsextract.prepare.tokenizer_loading import chat_template_file

    path = chat_template_file(chat_template)
    try:
        text = stored_template("", chat_template)  # read as prepare reads it
        _compile_jinja_template(text)  # the environment apply_chat_template renders with (`{% generation %}`)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"chat_template: cannot read {path} ({type(e).__name__}: {e})") from None
    except jinja2.TemplateSyntaxError as e:
        where = f"{path}, line {e.lineno}" if path is not None else f"the template text, line {e.lineno}"
        raise ConfigError(f"chat_template: {where}: not a Jinja template that parses ({e.message}); fix the "
                          "template, or set chat_template: null for the tokenizer's own") from None


def _check_tokenizer_folder(source: str) -> None:
    """ConfigError where `tokenizer` is a path but no folder of tokenizer files (a hub id is left to the load)."""
    from hsextract.config.model_info import hub_id
    from hsextract.prepare.tokenizer_loading import VOCABULARY_FILES

    root = Path(source).expanduser()
    if hub_id(source) is not None:
        return
    if root.exists() and not root.is_dir():
        raise ConfigError(f"tokenizer: {source!r} is a file, not a tokenizer directory; set `tokenizer` to the folder "
                          "that holds tokenizer_config.json (or null: the model's)")
    if not root.is_dir():
        raise ConfigError(f"tokenizer: {source!r}: no such directory; set `tokenizer` to a local tokenizer folder, a "
                          "hub id, or null (the model's)")
    if not any((root / n).is_file() for n in VOCABULARY_FILES):
        raise ConfigError(f"tokenizer: {source!r} holds no tokenizer files ({', '.join(VOCABULARY_FILES)}); set "
                          "`tokenizer` to the folder that holds them, or null (the model's)")


def check_template_kwargs(s: Settings) -> None:
    """A `chat_template_kwargs` key the chat template never reads, refused before any job runs, where the
    template can be read without loading the tokenizer: `chat_template`, the tiny model's (as the workflow
    builds it), or the tokenizer directory's files. prepare checks again with the template it renders with."""
    from hsextract.masks.kwargs import check_kwargs, stored_template

    kwargs = s.prepare.chat_template_kwargs
    if not kwargs:
        return
    if not s.prepare.chat_template and s.make_tiny_model and not s.extract.own_tokenizer:
        from hsextract.tinymodel.chat_template import KIMI_STYLE_TEMPLATE
        from hsextract.tinymodel.kimi_tokenizer import chat_template

        template: str | dict[str, str] | None = (chat_template() if s.tiny_model_tokenizer == "kimi"
                                                 else KIMI_STYLE_TEMPLATE)
    else:
        template = stored_template(s.extract.tokenizer_dir, s.prepare.chat_template)
    if template:
        check_kwargs(template, kwargs)


def check_sources(s: Settings) -> None:
    """Each source a file or a dataset folder, said before the checks that read them (the tiny model's corpus)."""
    for i, src in enumerate(s.prepare.sources):
        check_source_path(f"sources[{i}].path", src.path)


def count_records(s: Settings) -> int:
    from hsextract.prepare.conversations import count_records as count
    from hsextract.prepare.conversations import no_records

    try:
        n_records = int(count(s.prepare.sources))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a reader error means the source is unusable
        raise ConfigError(f"sources: cannot count records ({type(e).__name__}: {e})") from None
    if n_records == 0:
        raise ConfigError(f"sources: the sources hold no records; nothing to extract ({no_records(s.prepare.sources)})")
    return n_records


def check_schema(config: Mapping[str, Any]) -> Settings:
    """The config read safely, the schema (and no secret in the config: hsextract.config.redaction), remote
    storage and the run name: the first checks of the workflow's and of the plan's."""
    check_bounded(config)
    s = from_config(config)
    check_remote(s.config)
    check_run_name(s)
    return s


def check_plan(config: Mapping[str, Any]) -> Settings:
    """The checks `hsextract plan` runs: those that read no source, tokenizer, reference sample or key file (a run
    may be planned away from them): the schema, the run name, the server's GPUs, ports and arguments, and the
    layers against the model's depth where its config.json is local. `snakemake -n` runs them all (check)."""
    from hsextract.config.model_info import ModelInfoError

    s = check_schema(config)
    check_server(s)
    if not s.make_tiny_model and not (Path(s.extract.model) / "config.json").is_file():
        return s  # a hub id is not asked (offline: 5 retries, 25 s); the tiny model's shape is known unbuilt
    try:
        shape = model_shape(s.config)
    except ModelInfoError:  # not here: plan asks for --hidden-size, and the layers are checked where it is
        return s
    check_exports(s, check_layers(s, shape))
    return s


def check(config: Mapping[str, Any]) -> Plan:
    """Schema and semantic checks, in the order a user would fix them; the settings tree and the run's plan.

    The tree's aux_layers are the resolved ids (a `capture` preset's, or the explicit list), as are those
    of the config the workflow hands its jobs (the Snakefile sets them), so both hash alike.
    """
    s = check_schema(config)
    check_sources(s)
    check_tiny_model_path(s)
    check_engine(s)
    shape = model_shape(s.config)
    aux_layers = check_layers(s, shape)
    check_exports(s, aux_layers)
    check_stop_ids(s, shape)
    s = from_config({**s.config, "aux_layers": aux_layers, "aux_layers_convention": HIDDEN_STATES})
    check_tokenizer(s)
    check_template_kwargs(s)
    ref = read_layout(s.validate.reference_sample)
    check_reference(s, shape, ref)
    n_records = count_records(s)
    return Plan(settings=s, n_records=n_records, n_chunks=chunks.count(n_records, s.prepare.prompts_per_chunk),
                model=shape, reference=ref, aux_layers=aux_layers)
