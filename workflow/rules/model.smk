if config["make_tiny_model"]:

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
            seed=config["seed"],
            tokenizer=config["tiny_model_tokenizer"],
        script:
            "../scripts/make_tiny_model.py"
