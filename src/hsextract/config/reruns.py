"""What each config key decides: the output of which rules, or nothing (an operational key).

`KEYS` classifies every key of the config schema (workflow/schemas/config.schema.yaml), dotted as in
`settings.SCHEMA_TO_TREE`, in this one place: the rules whose outputs its value decides, or `OPERATIONAL`
(how a job runs: threads, memory, devices, batch sizes, concurrency, timeouts, servers, secrets). A rule's
`params: settings=` is `params(SETTINGS, rule)`, the effective values (from the settings tree: defaults
filled, presets resolved) of the keys that decide its output, so Snakemake's params trigger (the profiles'
`--rerun-triggers mtime params input software-env`) reruns the rule when one of them changes, and the rules
after it through their inputs; an operational key is no rule's param and reruns nothing.

A key that decides its rules only in some runs (transformers.dtype: the transformers engine's) takes in their params
the value they see there (`EFFECTIVE`), so that a new value that changes nothing reruns nothing. What the files a key
names hold (a tokenizer, a model, a source changed in place) is hsextract.config.file_params's, `params: files=`.

Listed are the first rules a key decides: those after them rerun anyway. A rule that exists only in some
runs (make_tiny_model, regenerate_chunk, build_patched_server, export) decides nothing in the others.
Checked: tests/test_reruns.py (every schema key is here, once), and tests/test_workflow.py (for every key,
a changed value makes `snakemake -n` plan exactly its rules and what depends on them, after a finished run
of the default; an operational key plans nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from hsextract.config.settings import SCHEMA_TO_TREE, Settings, path_spelling

OPERATIONAL: tuple[str, ...] = ()

# rules of the workflow that a key can decide (workflow/rules/*.smk)
RULES = ("make_tiny_model", "regenerate_chunk", "build_patched_server", "prepare", "extract", "validate", "stats",
         "seq_length_hist", "export")
# Keys that decide which files a rule's jobs write or read (paths), not what a finished output holds: a new value
# plans the jobs of new outputs, or reruns those whose set of inputs it changes (Snakemake's input trigger); they
# are no rule's param.
PATHS = ("run_name", "export_formats", "sglang.server_url", "sglang.servers")

# the conversations regenerate reads and the template it renders them with decide its text as prepare's do
_REGENERATE_AND_PREPARE = ("regenerate_chunk", "prepare")
# the rules that load the model or its tokenizer
_MODEL = ("regenerate_chunk", "prepare", "extract")

KEYS: dict[str, tuple[str, ...]] = {
    # the folder of every output but the tiny model's: another name is another run
    "run_name": tuple(rule for rule in RULES if rule != "make_tiny_model"),
    # make_tiny_model builds the model at this path (its output): a new path is a new model
    "model": _MODEL,
    # the model becomes (or stops being) an input of regenerate, prepare and extract; validate: the reference
    # sample's hidden size counts for a real model only
    "make_tiny_model": (*_MODEL, "validate"),
    "tiny_model_tokenizer": ("make_tiny_model",),
    "tokenizer": _MODEL,
    "trust_remote_code": _MODEL,  # custom tokenizer code decides the ids
    # regenerate: through regenerate.engine's effective value (null: this one), so a pinned one reruns nothing
    "engine": ("extract",),
    # capture and the convention decide which ids aux_layers resolves to, and nothing else (EFFECTIVE)
    "capture": ("extract",),
    "aux_layers": ("extract",),  # resolved: the hidden_states ids stored
    "aux_layers_convention": ("extract",),
    "final_state": ("extract",),
    "reference_sample": ("validate",),
    "export_formats": ("export",),  # one export job per format
    # prepare (regenerate.enabled: regenerate reads the sources, by the same chunks, and prepare the result)
    "sources": _REGENERATE_AND_PREPARE,
    "seed": ("make_tiny_model", *_REGENERATE_AND_PREPARE),
    "prompts_per_chunk": _REGENERATE_AND_PREPARE,
    "max_seq_len": _REGENERATE_AND_PREPARE,  # regenerate cuts a conversation before a turn whose context reaches it
    "truncate": ("prepare",),
    "min_trained_tokens": ("prepare",),
    "train_on_eot": ("prepare",),
    "train_on_reasoning": ("prepare",),
    "split_turns": ("prepare",),
    "share_prefixes": ("prepare",),  # the prompts' parent and prefix_len columns; extract follows by its input
    "dedup": ("prepare",),
    "strict": _REGENERATE_AND_PREPARE,  # which malformed records are dropped rather than fatal
    "chat_template": _REGENERATE_AND_PREPARE,
    "chat_template_kwargs": _REGENERATE_AND_PREPARE,
    # extract
    "transformers.device": OPERATIONAL,
    "transformers.dtype": ("extract",),  # under engine: sglang none (EFFECTIVE)
    "transformers.token_budget": OPERATIONAL,  # lowered after an out-of-memory: finished chunks stay
    "extract.threads": OPERATIONAL,
    "extract.mem_mb": OPERATIONAL,
    "extract.retries": OPERATIONAL,
    "shard.compression_level": ("extract",),  # the shard's bytes
    "shard.threads": OPERATIONAL,
    "shard.precision": ("extract",),
    "shard.check_free_space": OPERATIONAL,
    # how the sglang servers run and are reached; the data is the same (an argument in launch_args that
    # changes numerics, such as a quantization, is not seen: `--forcerun extract`)
    "sglang.python": ("build_patched_server",),  # the interpreter the plugin is installed into
    "sglang.launch_args": OPERATIONAL,
    "sglang.host": OPERATIONAL,
    "sglang.api_key_file": OPERATIONAL,  # the key's file (the key is no config key, hsextract.config.redaction)
    "sglang.allow_remote": OPERATIONAL,
    "sglang.port": OPERATIONAL,
    "sglang.tp": OPERATIONAL,
    "sglang.replicas": OPERATIONAL,
    "sglang.gpus": OPERATIONAL,
    "sglang.chunked_prefill_size": OPERATIONAL,
    "sglang.capture": OPERATIONAL,  # the same layers either way
    "sglang.concurrency": OPERATIONAL,
    "sglang.timeout_s": OPERATIONAL,
    "sglang.retries": OPERATIONAL,
    "sglang.backoff_s": OPERATIONAL,
    "sglang.staging_mb": OPERATIONAL,
    "sglang.writer_threads": OPERATIONAL,
    "sglang.prefill_cuda_graph": OPERATIONAL,
    "sglang.startup_timeout_s": OPERATIONAL,
    # servers elsewhere: set or unset, the extract jobs gain or lose the build marker of local servers as an
    # input, which reruns them; from one address to another reruns nothing
    "sglang.server_url": ("extract",),
    "sglang.servers": ("extract",),
    "sglang.dump_dir": OPERATIONAL,
    # statistics
    "stats.position_bins": ("stats",),
    "stats.seq_len_bins": ("seq_length_hist",),
    # regenerate
    "regenerate.enabled": _REGENERATE_AND_PREPARE,  # prepare then reads the regenerated conversations
    "regenerate.engine": ("regenerate_chunk",),
    "regenerate.temperature": ("regenerate_chunk",),
    "regenerate.top_p": ("regenerate_chunk",),
    "regenerate.top_k": ("regenerate_chunk",),
    "regenerate.max_new_tokens": ("regenerate_chunk",),
    "regenerate.seed": ("regenerate_chunk",),
    "regenerate.batch_size": OPERATIONAL,
    "regenerate.tool_turns": ("regenerate_chunk",),
    "regenerate.complete_last_turn": ("regenerate_chunk",),
    "regenerate.drop_truncated": ("regenerate_chunk",),
    "regenerate.stop_token_ids": ("regenerate_chunk",),
    "regenerate.think_start": ("regenerate_chunk",),
    "regenerate.think_end": ("regenerate_chunk",),
    "regenerate.device": OPERATIONAL,
    "regenerate.dtype": ("regenerate_chunk",),  # with its engine sglang none (EFFECTIVE)
    "regenerate.server_url": OPERATIONAL,
    "regenerate.api_key_file": OPERATIONAL,  # the key's file, as sglang.api_key_file
    "regenerate.request_timeout_s": OPERATIONAL,
    "regenerate.retries": OPERATIONAL,
    "regenerate.send_seed": ("regenerate_chunk",),  # a sampled turn depends on its seed (sglang only: EFFECTIVE)
}


def keys_of(rule: str) -> tuple[str, ...]:
    """The keys whose values decide `rule`'s output, in KEYS order."""
    if rule not in RULES:
        raise ValueError(f"{rule}: no rule of hsextract.config.reruns.RULES {RULES}")
    return tuple(key for key, rules in KEYS.items() if rule in rules)


def value(settings: Settings, key: str) -> Any:
    """The effective value of a config key (dotted): the settings tree's, as plain JSON types."""
    path = SCHEMA_TO_TREE.get(key)
    if path is None:  # a key the tree does not hold (yet): the filled config's
        node: Any = settings.config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
    else:
        node = settings
        for part in path.split("."):
            node = getattr(node, part)
    return plain(node)


def regenerate_engine(settings: Settings) -> str:
    """The engine regenerate generates with: `regenerate.engine`, else the run's `engine`."""
    return settings.regenerate.engine or settings.extract.engine


# Keys whose value decides their rules' outputs only in some runs: the value the rule's params take instead of the
# key's (None where the key counts for nothing), so that a change that changes nothing reruns nothing.
EFFECTIVE: dict[str, Callable[[Settings], Any]] = {
    # one spelling (`resources/m/` is `resources/m`), and a tokenizer naming the model's own folder is none (the
    # model's); the jobs load them as written
    "model": lambda s: path_spelling(s.extract.model),
    "tokenizer": lambda s: path_spelling(s.extract.tokenizer) if s.extract.own_tokenizer else None,
    # the shards hold the resolved ids (aux_layers' param) and no preset name nor convention: eagle3 and its own
    # list written out, in either convention, store the same layers, and rerun nothing
    "capture": lambda s: None,
    "aux_layers_convention": lambda s: None,
    # the dtype of the captured hidden states: SGLang serves in bfloat16 whatever transformers.dtype says
    "transformers.dtype": lambda s: s.extract.activation_dtype,
    # the dtype regenerate loads the model in: only its transformers engine loads one (sglang asks a server)
    "regenerate.dtype": lambda s: s.regenerate.dtype if regenerate_engine(s) == "transformers" else None,
    # whether each request to the SGLang server carries its seed: the transformers engine seeds its own sampling
    "regenerate.send_seed": lambda s: s.regenerate.send_seed if regenerate_engine(s) == "sglang" else None,
    # the engine regenerate generates with: null is the run's engine, so naming that one changes nothing
    "regenerate.engine": regenerate_engine,
    # greedy decoding (temperature 0) draws nothing: its seed and sampling cut-offs decide no token
    "regenerate.seed": lambda s: s.regenerate.seed if s.regenerate.temperature > 0 else None,
    "regenerate.top_p": lambda s: s.regenerate.top_p if s.regenerate.temperature > 0 else None,
    "regenerate.top_k": lambda s: s.regenerate.top_k if s.regenerate.temperature > 0 else None,
}


def effective(settings: Settings, key: str) -> Any:
    """The value of `key` that its rules' outputs depend on: EFFECTIVE's, else the key's own (`value`)."""
    return plain(EFFECTIVE[key](settings)) if key in EFFECTIVE else value(settings, key)


# rules that do not lead to dataset.json (the manifest reads none of their outputs)
BESIDE_MANIFEST = ("seq_length_hist", "export")


def beside_manifest() -> tuple[str, ...]:
    """Keys that decide only rules beside the manifest (a histogram's bins, the export formats): a new value
    does not rerun it, so dataset.json leaves them out rather than record a value the run has moved on from."""
    return tuple(k for k, rules in KEYS.items() if rules and set(rules) <= set(BESIDE_MANIFEST))


def params(settings: Settings, rule: str) -> dict[str, Any]:
    """`rule`'s `params: settings=`: {dotted key: effective value} of the keys that decide its output (`effective`:
    defaults filled, presets resolved, and EFFECTIVE's value for a key that counts only in some runs).

    Plain dicts, lists and scalars, keys sorted: Snakemake compares params by their repr, and silently leaves
    out a value of another type (a mapping proxy, a dataclass), which would then never trigger a rerun.
    """
    return {key: effective(settings, key) for key in sorted(keys_of(rule)) if key not in PATHS}


def plain(value: Any) -> Any:
    """`value` as JSON types (dataclasses and mappings as dicts with sorted keys, tuples as lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


__all__ = ["BESIDE_MANIFEST", "EFFECTIVE", "KEYS", "OPERATIONAL", "PATHS", "RULES", "beside_manifest", "effective",
           "keys_of", "params", "plain", "regenerate_engine", "value"]
