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
        "../../envs/stats.yaml"
    params:
        position_bins=SETTINGS.stats.position_bins,
    script:
        "../scripts/stats.py"


rule aggregate_stats:
    input:
        chunks=get_all_chunk_stats,
        prepare="results/{run}/prompts/summary.json",
    output:
        summary=report(
            "results/{run}/stats/summary.tsv",
            category="Dataset statistics",
            subcategory="Totals",
            caption="../report/summary.rst",
            labels={"table": "totals"},
        ),
        chunks=report(
            "results/{run}/stats/chunks.tsv",
            category="Dataset statistics",
            subcategory="Chunks",
            caption="../report/chunks.rst",
            labels={"table": "per chunk"},
        ),
        layers=report(
            "results/{run}/stats/layers.tsv",
            category="Hidden states",
            subcategory="Per layer",
            caption="../report/layers.rst",
            labels={"table": "per layer"},
        ),
        rms_by_position="results/{run}/stats/rms_by_position.tsv",
        seq_lengths=report(
            "results/{run}/stats/seq_lengths.tsv",
            category="Dataset statistics",
            subcategory="Sequence lengths",
            caption="../report/seq_lengths.rst",
            labels={"table": "sequence-length quantiles"},
        ),
        dropped=report(
            "results/{run}/stats/dropped.tsv",
            category="Dataset statistics",
            subcategory="Dropped samples",
            caption="../report/dropped.rst",
            labels={"table": "dropped by reason"},
        ),
        seq_len_plot=report(
            "results/{run}/stats/seq_length_hist.png",
            category="Dataset statistics",
            subcategory="Sequence lengths",
            caption="../report/seq_length_hist.rst",
            labels={"figure": "sequence-length histogram"},
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
        "../../envs/stats.yaml"
    params:
        seq_len_bins=SETTINGS.stats.seq_len_bins,
    script:
        "../scripts/aggregate_stats.py"
