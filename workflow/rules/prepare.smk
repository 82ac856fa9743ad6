rule prepare:
    input:
        unpack(get_prepare_inputs),
    output:
        prompts=expand("results/{{run}}/prompts/chunk-{chunk}.parquet", chunk=CHUNKS),
        summary="results/{run}/prompts/summary.json",
    log:
        "logs/{run}/prepare/prepare.log",
    benchmark:
        "benchmarks/{run}/prepare.tsv"
    conda:
        "../../envs/model.yaml"
    # processes that render and mask conversations (the job's cost; the output is the same for any count): every
    # core it is given, as it runs before any other job
    threads: PREPARE_THREADS
    params:
        tokenizer=TOKENIZER,
        num_chunks=N_CHUNKS,
        sources=PREPARE_SOURCES,
        settings=RERUN["prepare"],
        files=FILES["prepare"],
    script:
        "../scripts/prepare.py"
