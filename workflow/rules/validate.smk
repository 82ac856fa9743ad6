rule validate:
    input:
        shard=get_shard,
        reference=SETTINGS.validate.reference_sample,
    output:
        report="results/{run}/validation/chunk-{chunk}.json",
    log:
        "logs/{run}/validate/chunk-{chunk}.log",
    conda:
        "../../envs/data.yaml"
    params:
        # the reference's hidden size counts only for a real model (see config/README.md)
        same_model=SETTINGS.validate.same_model,
        settings=RERUN["validate"],
    script:
        "../scripts/validate.py"
