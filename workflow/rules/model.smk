if config["make_tiny_model"]:

    rule make_tiny_model:
        input:
            conversations=get_tiny_model_corpus,
        output:
            model=directory(MODEL),
        params:
            seed=config["seed"],
        log:
            f"logs/{RUN}/make_tiny_model/make_tiny_model.log",
        benchmark:
            f"benchmarks/{RUN}/make_tiny_model.tsv"
        conda:
            "../../envs/model.yaml"
        script:
            "../scripts/make_tiny_model.py"
