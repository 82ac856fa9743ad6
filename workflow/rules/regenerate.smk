# regenerate.enabled: the assistant turns rewritten by the target model, one job per chunk of
# input records (the same chunks as prepare's, so a failed chunk reruns alone), joined into the
# conversation file that prepare then reads instead of the configured sources (REGEN_DIR and
# PREPARE_SOURCES: common.smk).


rule regenerate_chunk:
    input:
        unpack(get_regenerate_inputs),
    output:
        conversations=f"{REGEN_DIR}/chunks/chunk-{{chunk}}.jsonl",
        stats=f"{REGEN_DIR}/chunks/chunk-{{chunk}}.stats.json",
    log:
        f"logs/{RUN}/regenerate/chunk-{{chunk}}.log",
    benchmark:
        f"benchmarks/{RUN}/regenerate/chunk-{{chunk}}.tsv"
    conda:
        "../../envs/model.yaml"
    threads: SETTINGS.extract.threads
    resources:
        mem_mb=get_extract_mem_mb,
        gpu=REGENERATE_GPUS,
    params:
        chunk=lambda wildcards: int(wildcards.chunk),
        settings=RERUN["regenerate_chunk"],
        files=FILES["regenerate_chunk"],
    script:
        "../scripts/regenerate_chunk.py"


rule regenerate_concat:
    input:
        chunks=expand(f"{REGEN_DIR}/chunks/chunk-{{chunk}}.jsonl", chunk=CHUNKS),
    output:
        conversations=f"{REGEN_DIR}/conversations.jsonl",
        stats=f"{REGEN_DIR}/conversations.stats.json",
    log:
        f"logs/{RUN}/regenerate/concat.log",
    conda:
        "../../envs/model.yaml"
    script:
        "../scripts/regenerate_concat.py"
