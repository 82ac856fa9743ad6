import re

from snakemake.exceptions import WorkflowError

from hsextract.config import chunks, file_params, reruns
from hsextract.config.checks import check_tiny_model_unshared, tiny_model_corpus
from hsextract.config.settings import path_spelling
from hsextract.extract.gpu_pool import changes_outputs
from hsextract.shard import SHARD_SUFFIX
from hsextract.prepare.tokenizer_loading import chat_template_file
from hsextract.tinymodel.build import TINY_CONFIG, WEIGHTS_RECIPE

# Every value the rule files read, computed once here from the checked settings (the Snakefile's
# PLAN); rule files only read them, so the order of the includes does not matter.
SETTINGS = PLAN.settings
RUN = SETTINGS.extract.run_name
N_CHUNKS = PLAN.n_chunks
CHUNKS = chunks.labels(N_CHUNKS)
if workflow.is_main_process and (
    _lost := chunks.incomplete_prepare(f"results/{RUN}", N_CHUNKS, SHARD_SUFFIX)
):
    print(_lost, file=sys.stderr)
# Another run's tiny model is not rebuilt (touched, deleted) under it, by a command that runs or plans jobs or
# marks outputs (not --unlock, --lint, --report): refused here, before the DAG. Raised from make_tiny_model's
# input function, the error was taken by Snakemake as "no job makes the model", and the run went on without the
# extract jobs that read it.
_DELETES = any(a.partition("=")[0] == "--delete-all-output" for a in sys.argv)
if workflow.is_main_process and changes_outputs(sys.argv):
    check_tiny_model_unshared(SETTINGS, deletes=_DELETES)
    # a damaged prompts file is newer than its shard: refused here, before Snakemake deletes the good shard to rerun
    if not _DELETES and (
        _damaged := chunks.damaged_prompts(f"results/{RUN}", N_CHUNKS, SHARD_SUFFIX)
    ):
        raise WorkflowError(_damaged)
MODEL = SETTINGS.extract.model
# prepare's param: one spelling (`models/t/` is `models/t`), as its settings params
TOKENIZER = path_spelling(SETTINGS.extract.tokenizer_dir)
# `params: settings=RERUN[name]` of the rules that config keys decide, the effective values of those keys
# (hsextract.config.reruns.KEYS classifies every key); a changed value reruns the rules it decides (the params
# trigger); operational keys (threads, memory, devices, token budget, servers) are in none and rerun nothing.
RERUN = {name: reruns.params(SETTINGS, name) for name in reruns.RULES}
# `params: files=FILES[name]` of the rules that read files the config names (hsextract.config.file_params): the
# tokenizer's and chat template's content, the sources' and the real model's files by name, size and mtime, so that
# one changed in place under the same path (which no input's mtime trigger sees) reruns them. What the workflow
# writes (the run's results, the tiny model it builds) is left out: its rules rerun what follows it.
PRODUCED = [f"results/{RUN}", *([MODEL] if SETTINGS.make_tiny_model else [])]
FILES = {
    name: file_params.params(SETTINGS, name, PRODUCED) for name in file_params.RULES
}
# the tiny model's architecture and how its weights are drawn, make_tiny_model's param: a release that changes
# either rebuilds the model
TINY_ARCHITECTURE = reruns.plain({**TINY_CONFIG, "weights_recipe": WEIGHTS_RECIPE})

# regenerate.enabled (workflow/rules/regenerate.smk): the assistant turns are rewritten into
# REGEN_DIR, and prepare reads the regenerated conversations instead of the configured sources.
REGEN_DIR = f"results/{RUN}/regenerated"
if SETTINGS.regenerate.enabled:
    PREPARE_SOURCES = [
        {
            "path": f"{REGEN_DIR}/conversations.jsonl",
            "name": "regenerated",
            "format": "messages",
        }
    ]
else:
    PREPARE_SOURCES = SETTINGS.prepare.source_dicts()

# engine: sglang (workflow/rules/server.smk). External servers (sglang.server_url/servers) need
# nothing built or started; local ones are started by the extraction jobs, which take the build
# marker of rule build_patched_server as an ancient() input (a rebuilt marker does not redo
# finished chunks); onstart kills a server left by a crashed run, onsuccess/onerror stop ours.
SGLANG = SETTINGS.extract.engine == "sglang"
if SGLANG:
    from hsextract.sglang import config as sglang_config

    SGLANG_URLS = sglang_config.external_urls(SETTINGS.extract)
else:
    SGLANG_URLS = []
SGLANG_LOCAL = SGLANG and not SGLANG_URLS
SERVER_DIR = f"results/{RUN}/server"
# named inputs of every extract job
ENGINE_INPUTS = (
    {"patched": ancient(f"{SERVER_DIR}/patched.json")} if SGLANG_LOCAL else {}
)
# callables run by onstart, and by onsuccess/onerror
ON_START = (
    [lambda: sglang_config.stop_local_servers(SETTINGS.extract)] if SGLANG_LOCAL else []
)
ON_FINISH = list(ON_START)
# GPUs of an extract job: one with local sglang servers drives one replica (hsextract.sglang.server.
# claim_replica), tp GPUs, so a pool of tp x replicas runs one job per replica at once; with external
# servers it is a client and needs none; the transformers engine takes one unless it runs on the CPU.
if SGLANG:
    EXTRACT_GPUS = 0 if SGLANG_URLS else SETTINGS.extract.sglang.tp
else:
    EXTRACT_GPUS = 0 if SETTINGS.extract.transformers.device == "cpu" else 1
# GPUs of a regenerate job: the transformers engine loads the model on regenerate.device (one GPU unless the
# CPU); sglang generates through regenerate.server_url, a server of its own, and needs none.
REGENERATE_GPUS = (
    0
    if (SETTINGS.regenerate.engine or SETTINGS.extract.engine) == "sglang"
    or SETTINGS.regenerate.device == "cpu"
    else 1
)


# Worker processes of prepare: the cores the run was given (--cores), at most 32. A cluster run gives none
# (workflow.cores raises): 8, and a profile's `set-threads: {prepare: N}` gives its prepare job N (docs/CLUSTER.md).
def run_cores():
    try:
        return workflow.cores
    except WorkflowError:
        return None


_CORES = run_cores()
PREPARE_THREADS = min(32, _CORES) if isinstance(_CORES, int) else 8


wildcard_constraints:
    run=re.escape(RUN),
    chunk=chunks.WILDCARD,
    format=r"[a-z0-9-]+",


def run_hooks(hooks):
    for hook in hooks:
        hook()


def get_model_input(wildcards):
    """The tiny model directory when the workflow builds it; a real model is not a DAG input (FILES: its files)."""
    return {"model": MODEL} if SETTINGS.make_tiny_model else {}


def get_template_input(wildcards):
    """A chat template given as a file: editing it reruns what renders with it (mtime trigger)."""
    path = chat_template_file(SETTINGS.prepare.chat_template)
    return {"chat_template": str(path)} if path else {}


def get_prepare_inputs(wildcards):
    inputs = get_model_input(wildcards)
    inputs.update(get_template_input(wildcards))
    inputs["sources"] = [src["path"] for src in PREPARE_SOURCES]
    return inputs


def get_extract_inputs(wildcards):
    inputs = get_model_input(wildcards)
    inputs.update(ENGINE_INPUTS)
    return inputs


def get_extract_mem_mb(wildcards, attempt):
    return SETTINGS.extract.mem_mb * attempt


def get_tiny_model_corpus(wildcards):
    """Text the tiny model's tokenizer is trained on (config.check made sure there is one)."""
    return tiny_model_corpus(SETTINGS)


def get_prompts(wildcards):
    return f"results/{wildcards.run}/prompts/chunk-{wildcards.chunk}.parquet"


# Shards as inputs: read start to end (validate, stats, manifest, export), so flagged sequential. Without a shared
# filesystem (profiles/kubernetes) a storage plugin may then serve them in place: the fs plugin links each one from
# the claim into the pod instead of copying a whole shard (or, for the manifest and the export, every shard).
def get_shard(wildcards):
    return access.sequential(
        f"results/{wildcards.run}/shards/chunk-{wildcards.chunk}{SHARD_SUFFIX}"
    )


def get_all_prompts(wildcards):
    return expand("results/{run}/prompts/chunk-{chunk}.parquet", run=RUN, chunk=CHUNKS)


def get_all_shards(wildcards):
    return access.sequential(
        expand(
            "results/{run}/shards/chunk-{chunk}{suffix}",
            run=RUN,
            chunk=CHUNKS,
            suffix=SHARD_SUFFIX,
        )
    )


def get_all_validation(wildcards):
    return expand("results/{run}/validation/chunk-{chunk}.json", run=RUN, chunk=CHUNKS)


def get_all_chunk_stats(wildcards):
    return expand("results/{run}/stats/chunk-{chunk}.json", run=RUN, chunk=CHUNKS)


def get_final_outputs():
    # every shard is a target: a deleted shard reruns its chunk (a missing intermediate file alone
    # does not make Snakemake redo the jobs after it)
    return [
        *get_all_shards(None),
        f"results/{RUN}/dataset.json",
        f"results/{RUN}/stats/summary.tsv",
        f"results/{RUN}/stats/seq_length_hist.png",
        *get_all_validation(None),
        *expand(
            "results/{run}/export/{format}", run=RUN, format=SETTINGS.export_formats
        ),
    ]


# regenerate.enabled (workflow/rules/regenerate.smk)
def get_regenerate_inputs(wildcards):
    inputs = get_model_input(wildcards)
    inputs.update(get_template_input(wildcards))
    inputs["sources"] = [src.path for src in SETTINGS.prepare.sources]
    return inputs
