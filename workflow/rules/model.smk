if SETTINGS.make_tiny_model:

    rule make_tiny_model:
        input:
            conversations=get_tiny_model_corpus,
        output:
            model=directory(MODEL),
        log:
            f"logs/{RUN}/make_tiny_model/make_tiny_model.log",
        benchmark:
            f"benchmarks/{RUN}/make_tiny_model.tsv"
        conda:
            "../../envs/model.yaml"
        params:
            settings=RERUN["make_tiny_model"],
            files=FILES["make_tiny_model"],
            architecture=TINY_ARCHITECTURE,
        script:
            "../scripts/make_tiny_model.py"
