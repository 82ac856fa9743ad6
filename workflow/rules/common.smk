import re

from hsextract.shard import SHARD_SUFFIX

RUN = config["run_name"]
N_CHUNKS = PLAN.n_chunks
CHUNKS = [f"{i:05d}" for i in range(N_CHUNKS)]
MODEL = str(config["model"])
TOKENIZER = str(config["tokenizer"] or config["model"])

# Hooks for engines that need more than the model (engine: sglang, workflow/rules/server.smk):
# ENGINE_INPUTS adds named inputs to every extract job (give a server build marker as
# ancient(...) so a rebuilt marker does not redo finished chunks), EXTRACT_GPUS overrides
# the gpu resource of an extract job, ON_START/ON_FINISH take callables run by
# onstart and by onsuccess/onerror (start or stop a shared server).
ENGINE_INPUTS = {}
EXTRACT_GPUS = None
ON_START = []
ON_FINISH = []
# What prepare reads: the configured sources, or the regenerated conversations
# (workflow/rules/regenerate.smk replaces this when regenerate.enabled is true).
PREPARE_SOURCES = list(config["sources"])

if config["engine"] == "sglang":

    include: "server.smk"


wildcard_constraints:
    run=re.escape(RUN),
    chunk=r"\d{5}",
    format=r"[a-z0-9-]+",


def run_hooks(hooks):
    for hook in hooks:
        hook()


def get_model_input(wildcards):
    """The tiny model directory when the workflow builds it; a real model is not a DAG input."""
    return {"model": MODEL} if config["make_tiny_model"] else {}


def get_prepare_inputs(wildcards):
    inputs = get_model_input(wildcards)
    inputs["sources"] = [src["path"] for src in PREPARE_SOURCES]
    return inputs


def get_extract_inputs(wildcards):
    inputs = get_model_input(wildcards)
    inputs.update(ENGINE_INPUTS)
    return inputs


# Config keys whose values decide the content of prepare's and extract's outputs.
PREPARE_KEYS = (
    "sources",
    "seed",
    "prompts_per_chunk",
    "max_seq_len",
    "truncate",
    "min_trained_tokens",
    "train_on_eot",
    "train_on_reasoning",
    "dedup",
    "strict",
    "tokenizer",
    "model",
)
EXTRACT_KEYS = ("model", "engine", "aux_layers", "final_state")


def get_prepare_settings(wildcards):
    settings = {key: config.get(key) for key in PREPARE_KEYS}
    if config["regenerate"]["enabled"]:
        settings["regenerate"] = config["regenerate"]
    return settings


def get_extract_settings(wildcards):
    # Not token_budget, threads or device: changing them after an out-of-memory must not
    # redo finished chunks.
    settings = {key: config.get(key) for key in EXTRACT_KEYS}
    settings["dtype"] = config["transformers"]["dtype"]
    settings["precision"] = config["shard"]["precision"]
    settings["compression_level"] = config["shard"]["compression_level"]
    return settings


def get_extract_gpus(wildcards):
    if EXTRACT_GPUS is not None:
        return EXTRACT_GPUS
    device = config["transformers"]["device"]
    return 1 if config["engine"] == "transformers" and device != "cpu" else 0


def get_extract_mem_mb(wildcards, attempt):
    return config["extract"]["mem_mb"] * attempt


def get_tiny_model_corpus(wildcards):
    """Text the tiny model's tokenizer is trained on: the first JSONL source."""
    for src in config["sources"]:
        if src["path"].endswith(".jsonl"):
            return src["path"]
    raise ValueError("make_tiny_model needs a jsonl source to train its tokenizer on")


def get_prompts(wildcards):
    return f"results/{wildcards.run}/prompts/chunk-{wildcards.chunk}.parquet"


def get_shard(wildcards):
    return f"results/{wildcards.run}/shards/chunk-{wildcards.chunk}{SHARD_SUFFIX}"


def get_all_prompts(wildcards):
    return expand("results/{run}/prompts/chunk-{chunk}.parquet", run=RUN, chunk=CHUNKS)


def get_all_shards(wildcards):
    return expand(
        "results/{run}/shards/chunk-{chunk}{suffix}",
        run=RUN,
        chunk=CHUNKS,
        suffix=SHARD_SUFFIX,
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
        *get_all_validation(None),
        *expand(
            "results/{run}/export/{format}", run=RUN, format=config["export_formats"]
        ),
    ]


# regenerate.enabled (workflow/rules/regenerate.smk)
def get_regenerate_inputs(wildcards):
    inputs = get_model_input(wildcards)
    inputs["sources"] = [src["path"] for src in config["sources"]]
    return inputs


def get_regenerate_settings(wildcards):
    # what decides a chunk's text: a change reruns the chunks (params trigger)
    keys = ("sources", "seed", "prompts_per_chunk", "strict", "model", "tokenizer")
    keys += ("chat_template", "chat_template_kwargs", "engine")
    settings = {key: config.get(key) for key in keys}
    settings["regenerate"] = config["regenerate"]
    return settings
