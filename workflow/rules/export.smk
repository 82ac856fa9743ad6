from pathlib import Path

from hsextract.provenance import sha256_file

# The lock file of the CPU install (Makefile): its hash goes into dataset.json's provenance, and a
# changed lock rewrites dataset.json (params trigger). Hashed here, in the checkout: a cluster job's
# working directory need not hold it.
LOCK_FILE = "requirements/cpu.lock"
LOCK = {
    "path": LOCK_FILE,
    "sha256": sha256_file(Path(workflow.basedir) / LOCK_FILE),
}


rule manifest:
    input:
        shards=get_all_shards,
        validation=get_all_validation,
        chunk_stats=get_all_chunk_stats,
        # each compared with the sha256 its shard recorded (hsextract.report.manifest.check_prompts)
        prompts=get_all_prompts,
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
    # the model env: the settings tree needs the config schema, the provenance the model and tokenizer hashes
    conda:
        "../../envs/model.yaml"
    params:
        lock=LOCK,
    script:
        "../scripts/manifest.py"


rule export:
    input:
        manifest="results/{run}/dataset.json",
        # read through the manifest's paths; declared so that a job without a shared filesystem (a pod) has them
        shards=get_all_shards,
    output:
        data=directory("results/{run}/export/{format}"),
    log:
        "logs/{run}/export/{format}.log",
    benchmark:
        "benchmarks/{run}/export/{format}.tsv"
    # the model env: a pre-norm run exported post-norm reads the final norm recorded from the checkpoint
    conda:
        "../../envs/model.yaml"
    script:
        "../scripts/export.py"
