rule manifest:
    input:
        shards=get_all_shards,
        validation=get_all_validation,
        chunk_stats=get_all_chunk_stats,
        prepare="results/{run}/prompts/summary.json",
        token_freq="results/{run}/token_freq.pt",
    output:
        manifest=report(
            "results/{run}/dataset.json",
            category="Dataset",
            caption="../report/manifest.rst",
            labels={"file": "dataset.json"},
        ),
    log:
        "logs/{run}/manifest/manifest.log",
    conda:
        "../../envs/stats.yaml"
    script:
        "../scripts/manifest.py"


rule export:
    input:
        manifest="results/{run}/dataset.json",
    output:
        data=directory("results/{run}/export/{format}"),
    log:
        "logs/{run}/export/{format}.log",
    benchmark:
        "benchmarks/{run}/export/{format}.tsv"
    conda:
        "../../envs/validate.yaml"
    script:
        "../scripts/export.py"
