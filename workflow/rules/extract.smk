rule extract:
    input:
        unpack(get_extract_inputs),
        prompts=get_prompts,
        prepare_summary="results/{run}/prompts/summary.json",
    output:
        shard=f"results/{{run}}/shards/chunk-{{chunk}}{SHARD_SUFFIX}",
    log:
        "logs/{run}/extract/chunk-{chunk}.log",
    benchmark:
        "benchmarks/{run}/extract/chunk-{chunk}.tsv"
    retries: SETTINGS.extract.retries
    conda:
        "../../envs/model.yaml"
    threads: SETTINGS.extract.threads
    resources:
        mem_mb=get_extract_mem_mb,
        gpu=EXTRACT_GPUS,
    params:
        chunk=lambda wildcards: int(wildcards.chunk),
        # the config values that decide a shard: a change reruns the chunk (params trigger)
        settings=RERUN["extract"],
        files=FILES["extract"],
    script:
        "../scripts/extract.py"
