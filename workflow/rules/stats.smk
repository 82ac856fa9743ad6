rule stats:
    input:
        shard=get_shard,
    output:
        stats="results/{run}/stats/chunk-{chunk}.json",
    log:
        "logs/{run}/stats/chunk-{chunk}.log",
    benchmark:
        "benchmarks/{run}/stats/chunk-{chunk}.tsv"
    conda:
        "../../envs/data.yaml"
    params:
        settings=RERUN["stats"],
    script:
        "../scripts/stats.py"


rule aggregate_stats:
    input:
        chunks=get_all_chunk_stats,
        prepare="results/{run}/prompts/summary.json",
        validation=get_all_validation,
    output:
        # the TSVs for scripts; the report shows the same tables as HTML pages (shown inline)
        summary="results/{run}/stats/summary.tsv",
        chunks="results/{run}/stats/chunks.tsv",
        layers="results/{run}/stats/layers.tsv",
        rms_by_position="results/{run}/stats/rms_by_position.tsv",
        seq_lengths="results/{run}/stats/seq_lengths.tsv",
        dropped="results/{run}/stats/dropped.tsv",
        summary_html=report(
            "results/{run}/stats/html/totals.html",
            category="Dataset statistics",
            subcategory="Totals",
            caption="../report/summary.rst",
            labels={"table": "totals"},
        ),
        chunks_html=report(
            "results/{run}/stats/html/chunks.html",
            category="Dataset statistics",
            subcategory="Chunks",
            caption="../report/chunks.rst",
            labels={"table": "per chunk"},
        ),
        layers_html=report(
            "results/{run}/stats/html/layers.html",
            category="Hidden states",
            subcategory="Per layer",
            caption="../report/layers.rst",
            labels={"table": "per layer"},
        ),
        seq_lengths_html=report(
            "results/{run}/stats/html/seq_lengths.html",
            category="Dataset statistics",
            subcategory="Sequence lengths",
            caption="../report/seq_lengths.rst",
            labels={"table": "sequence-length quantiles"},
        ),
        dropped_html=report(
            "results/{run}/stats/html/dropped.html",
            category="Dataset statistics",
            subcategory="Dropped samples",
            caption="../report/dropped.rst",
            labels={"table": "dropped by reason"},
        ),
        validation_html=report(
            "results/{run}/stats/html/validation.html",
            category="Validation",
            caption="../report/validation.rst",
            labels={"table": "validation summary"},
        ),
        rms_plot=report(
            "results/{run}/stats/layer_rms_by_position.png",
            category="Hidden states",
            subcategory="RMS by position",
            caption="../report/layer_rms_by_position.rst",
            labels={"figure": "per-layer RMS by position"},
        ),
        token_freq="results/{run}/token_freq.pt",
    log:
        "logs/{run}/aggregate_stats/aggregate_stats.log",
    conda:
        "../../envs/data.yaml"
    script:
        "../scripts/aggregate_stats.py"


# its own rule: the report lists a rule's params next to each of its figures, and seq_len_bins is
# this figure's alone
rule seq_length_hist:
    input:
        chunks=get_all_chunk_stats,
    output:
        plot=report(
            "results/{run}/stats/seq_length_hist.png",
            category="Dataset statistics",
            subcategory="Sequence lengths",
            caption="../report/seq_length_hist.rst",
            labels={"figure": "sequence-length histogram"},
        ),
    log:
        "logs/{run}/seq_length_hist/seq_length_hist.log",
    conda:
        "../../envs/data.yaml"
    params:
        settings=RERUN["seq_length_hist"],
    script:
        "../scripts/seq_length_hist.py"
