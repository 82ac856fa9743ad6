rule validate:
    input:
        shard=get_shard,
        prompts=get_prompts,
        reference=config["reference_sample"],
    output:
        report="results/{run}/validation/chunk-{chunk}.json",
    log:
        "logs/{run}/validate/chunk-{chunk}.log",
    conda:
        "../../envs/validate.yaml"
    script:
        "../scripts/validate.py"
