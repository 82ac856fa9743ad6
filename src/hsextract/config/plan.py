"""Capacity planner: tokens, bytes, GPU-hours and jobs of a run before it starts (`hsextract plan`).

Pure arithmetic over the workflow config and a few numbers the user gives (input records, tokens per
sample, throughput): nothing is loaded but the model's config.json, so it runs on a laptop.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple

from hsextract.config.chunks import count as count_chunks
from hsextract.config.model_info import ModelInfoError, local_hidden_size
from hsextract.config.settings import Settings
from hsextract.errors import ConfigError
from hsextract.layers import describe
from hsextract.prepare.prefix_share import share_saving

# Bytes per token besides the hidden states: input_ids and loss_mask, int64 each (speculators v1).
IDS_MASK_BYTES = 16
VALUE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}  # a hidden value, by the activations' dtype
# Stored / raw of the shard codec on LLM-like bf16 activations at H = 7168, level 3, every byte of
# the file counted (bench/README.md, codec table, "(synth)", row "ours, threads=1"). The real
# forward at H = 1024 gave 0.6670: the synthetic figure is the larger, so the plan errs on the safe side.
CODEC_RATIO_BF16 = 0.6965
CODEC_RATIO_SOURCE = "bench/README.md codec table: synthetic H=7168 activations, ours threads=1 (real H=1024: 0.6670)"
# fp8_e4m3 (one float32 scale per token and tensor), then the same codec: stored bytes over the raw bf16
# bytes of the same samples (bench/README.md, codec table, "(synth)", row "ours, fp8_e4m3").
CODEC_RATIO_FP8 = 0.4433
CODEC_RATIO_FP8_SOURCE = "bench/README.md codec table: fp8_e4m3 of synthetic H=7168 activations, of raw bf16 bytes"
# What one extract job's capture path sustains, in raw bytes per second, by the shard writer's encoder threads
# (shard.threads), measured where the GPU's prefill far outran it (bench/README.md, "writer ceiling": H200, hidden
# 7168, 4 tensors, bf16, level 3, fsynced to that host's 1.2 GB/s disk; the plugin and the client alone carry
# more). A node whose GPUs produce more is writer-bound. Fewer threads than the least measured: that
# figure, an upper bound. Not measured for fp8.
WRITER_CEILINGS_RAW_BPS = {8: 1.64e9, 16: 1.98e9}
WRITER_CEILING_SOURCE = "bench/README.md writer ceiling: H200, hidden 7168, {threads} shard threads, a 1.2 GB/s disk"
# What each export format (export_formats; src/hsextract/export/) writes besides the hidden rows, in bytes per token.
# Every format writes each sample whole (materialized: share_prefixes' shared rows repeated in every sample),
# uncompressed, all hidden tensors (aux layers and the final state) in the activations' dtype (fp8 shards decode to
# it), so a token takes this + hidden_tensors x hidden_size x value bytes:
#   speculators-v1           data/data_{i}.pt: input_ids, loss_mask int64                               16
#   specforge                rows_*/data_{i}.ckpt: input_ids, loss_mask int64 (aux concatenated)         16
#   speculators-safetensors  hidden_states/hs_{i}.safetensors: token_ids int64; the Arrow table's
#                            input_ids, loss_mask int64                                                  24
# Left out, 0.3 to 3 kB a sample: the files' headers (torch.save's zip, safetensors' JSON), the Arrow row offsets,
# sample_lengths.json, data_config.json, token_freq.pt, layers.json: tests/test_plan.py checks every format within
# 2% on synthetic shards with shared prefixes; at Kimi-K2.5's width a sample's overhead is under 1e-4 of its rows.
EXPORT_IDS_BYTES = {"speculators-v1": 16, "specforge": 16, "speculators-safetensors": 24}


def writer_ceiling(threads: int) -> tuple[float, str]:
    """The measured ceiling of one extract job with `threads` encoder threads, and where it comes from."""
    measured = [t for t in sorted(WRITER_CEILINGS_RAW_BPS) if t <= threads] or [min(WRITER_CEILINGS_RAW_BPS)]
    t = measured[-1]
    source = WRITER_CEILING_SOURCE.format(threads=t)
    if threads < t:
        source += f"; shard.threads {threads} not measured: an upper bound"
    return WRITER_CEILINGS_RAW_BPS[t], source


class ShardBytes(NamedTuple):
    raw_per_token: int  # of a computed token: its hidden rows, ids and mask
    raw: int
    ratio: float
    ratio_source: str
    stored: int


def shard_bytes(computed: int, materialized: int, n_tensors: int, hidden_size: int, dtype: str,
                precision: str) -> ShardBytes:
    """Raw and stored bytes of shards holding `computed` tokens' hidden rows and `materialized` tokens' ids and
    masks (share_prefixes: each sample whole; else the same count), by the codec's measured ratio."""
    raw_per_token = IDS_MASK_BYTES + n_tensors * hidden_size * VALUE_BYTES[dtype]
    raw = computed * raw_per_token + (materialized - computed) * IDS_MASK_BYTES
    if precision == "fp8_e4m3":
        ratio, source = CODEC_RATIO_FP8, CODEC_RATIO_FP8_SOURCE
    else:
        ratio, source = CODEC_RATIO_BF16, CODEC_RATIO_SOURCE
    # exact: no float rounding up a whole byte
    return ShardBytes(raw_per_token, raw, ratio, source, math.ceil(raw * Fraction(str(ratio))))


def export_bytes(fmt: str, materialized: int, n_tensors: int, hidden_size: int, dtype: str) -> tuple[int, int]:
    """(bytes per token, bytes) of export format `fmt` of `materialized` tokens (every sample whole)."""
    per_token = EXPORT_IDS_BYTES[fmt] + n_tensors * hidden_size * VALUE_BYTES[dtype]
    return per_token, materialized * per_token


def _tokens_per_record(summary_path: str, share_prefixes: bool) -> tuple[float, float | None]:
    """(tokens the engine computes and the shards store, materialized tokens) per record read, from a prepare
    summary. With share_prefixes the first are its `distinct_tokens` (each shared prefix once), the second its
    `tokens` (each sample whole, as a trainer reads it); without, the tokens and None."""
    try:
        summary = json.loads(Path(summary_path).read_text(encoding="utf-8"))
        read, tokens = int(summary["read"]), int(summary["tokens"])
        distinct = int(summary["distinct_tokens"]) if "distinct_tokens" in summary else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"--prepare-summary: {summary_path} is not a prepare summary.json with `read` and `tokens` ({e})"
        ) from None
    if read <= 0:
        raise ConfigError(f"--prepare-summary: {summary_path} read 0 records; prepare a sample of the sources first")
    if not share_prefixes:
        return tokens / read, None
    if distinct is None:
        raise ConfigError(
            f"--prepare-summary: {summary_path} has no `distinct_tokens`: it was prepared with share_prefixes off, "
            "but the config turns it on. Prepare the sample again with share_prefixes: true to plan on the tokens "
            "a sharing run stores and computes")
    return distinct / read, tokens / read


def _default_gpus_per_node(s: Settings) -> int | None:
    if s.extract.engine == "sglang":
        return s.extract.sglang.tp * s.extract.sglang.replicas
    return None if s.extract.transformers.device == "cpu" else 1


def plan(
    settings: Settings,
    records: int,
    *,
    chunks_per_job: int = 1,
    mean_tokens: float | None = None,
    prepare_summary: str | None = None,
    tokens_per_s: float | None = None,
    nodes: int = 1,
    gpus_per_node: int | None = None,
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """The figures of a run of `records` input records (conversations: what prompts_per_chunk counts; with
    split_turns one gives several samples); `tokens_per_s` is one node's throughput in tokens the engine computes.

    `chunks_per_job`: extract jobs a cluster job runs one after the other (Snakemake job groups).
    """
    if records <= 0:
        raise ConfigError(f"--records: {records} is not allowed; give the number of input records (> 0)")
    if nodes <= 0:
        raise ConfigError(f"--nodes: {nodes} is not allowed; it must be >= 1")
    if (mean_tokens is None) == (prepare_summary is None):
        raise ConfigError(
            "give exactly one of --mean-tokens (tokens per input record) or --prepare-summary "
            "(results/<run>/prompts/summary.json of a prepare run on a sample of your sources: measured)"
        )
    if mean_tokens is not None:
        if not 0 < mean_tokens < math.inf:  # NaN fails too
            raise ConfigError(f"--mean-tokens: {mean_tokens} is not allowed; it must be a finite number > 0")
        per_record, token_source = float(mean_tokens), "--mean-tokens"
        materialized_per_record = None
    else:
        per_record, materialized_per_record = _tokens_per_record(str(prepare_summary),
                                                                 settings.prepare.share_prefixes)
        token_source = f"measured: {prepare_summary}"
    if chunks_per_job <= 0:
        raise ConfigError(f"--chunks-per-job: {chunks_per_job} is not allowed; it must be >= 1")
    model = settings.extract.model
    if hidden_size is None:
        try:
            hidden_size = local_hidden_size(model)
        except ModelInfoError as e:
            raise ModelInfoError(f"{e}; give --hidden-size") from None
        if hidden_size is None:
            raise ConfigError(
                f"model: {model!r} is not a local directory with a config.json; give --hidden-size "
                f"(Kimi-K2.5: 7168)"
            )
    if hidden_size <= 0:
        raise ConfigError(f"--hidden-size: {hidden_size} is not allowed; it must be > 0")
    if tokens_per_s is not None and not 0 < tokens_per_s < math.inf:
        raise ConfigError(f"--tokens-per-s: {tokens_per_s} is not allowed; it must be a finite number > 0")
    if gpus_per_node is None:
        gpus_per_node = _default_gpus_per_node(settings)
    if gpus_per_node is not None and gpus_per_node <= 0:
        raise ConfigError(f"--gpus-per-node: {gpus_per_node} is not allowed; it must be >= 1")

    if settings.extract.aux_layers is None:  # a preset, and no config.json to read the model's depth from
        raise ConfigError(f"aux_layers: capture: {settings.config['capture']} takes its layers from the model's depth, "
                          f"which {model!r} does not give here (no local config.json); give aux_layers with its "
                          "aux_layers_convention")
    n_tensors = len(settings.extract.aux_layers) + 1
    precision = settings.extract.shard.precision
    tokens = round(records * per_record)
    materialized = None
    if materialized_per_record is not None:
        # share_prefixes: hidden rows of the distinct tokens; input_ids and loss_mask of every sample whole
        materialized = round(records * materialized_per_record)
    raw_per_token, raw, ratio, ratio_source, stored = shard_bytes(
        tokens, tokens if materialized is None else materialized, n_tensors, hidden_size,
        settings.extract.activation_dtype, precision)

    # exports write every sample whole: the materialized tokens (--mean-tokens counts them so)
    export_tokens = tokens if materialized is None else materialized
    exports = {f: export_bytes(f, export_tokens, n_tensors, hidden_size, settings.extract.activation_dtype)
               for f in settings.export_formats}
    export_total = sum(b for _, b in exports.values())

    ppc = settings.prepare.prompts_per_chunk
    chunks = count_chunks(records, ppc)
    cpj = chunks_per_job
    jobs = math.ceil(chunks / cpj)
    # the chunks of the busiest node: jobs of cpj chunks and one of the rest, dealt largest first, one job per node
    # at a time (10 chunks in jobs of 3 on 2 nodes: 3 + 3 on the first, 3 + 1 on the other); the first node gets
    # jobs 0, nodes, 2 nodes, ..., and the short one, job `full`, where full % nodes == 0
    full, rest = divmod(chunks, cpj)
    busiest = cpj * math.ceil(full / nodes) + (rest if full % nodes == 0 else 0)

    # one job's ceiling, not multiplied by the local replicas' jobs running at once: it was measured against the
    # node's disk (disk-bound at 16 threads), which they share
    per_job, ceiling_source = writer_ceiling(settings.extract.shard.threads)
    ceiling = per_job if precision == "bf16" else None
    bound = effective = disk_bps = None
    node_hours = gpu_hours = wall_hours = None
    if tokens_per_s is not None:
        effective = tokens_per_s
        if ceiling is not None:
            # the transformers engine on a CPU computes there: no GPU bounds it
            on_cpu = settings.extract.engine == "transformers" and settings.extract.transformers.device == "cpu"
            bound = "writer" if tokens_per_s * raw_per_token > ceiling else ("CPU" if on_cpu else "GPU")
            effective = min(tokens_per_s, ceiling / raw_per_token)
        disk_bps = effective * raw_per_token * ratio
        node_hours = tokens / effective / 3600
        wall_hours = node_hours / chunks * busiest  # chunks of equal size
        if gpus_per_node is not None:
            gpu_hours = node_hours * gpus_per_node
    return {
        "model": model,
        "precision": precision,
        "dtype": settings.extract.activation_dtype,
        "records": records,
        "tokens_per_record": per_record,
        "tokens_per_record_source": token_source,
        "tokens": tokens,
        # share_prefixes with a measured prepare summary: `tokens` are the distinct ones (stored and computed),
        # these the materialized ones (each sample whole, what a trainer reads); else None
        "materialized_tokens": materialized,
        "share_prefixes": settings.prepare.share_prefixes,
        # regeneration's cost is not planned: its max_new_tokens when on, else None
        "regenerate_max_new_tokens": settings.regenerate.max_new_tokens if settings.regenerate.enabled else None,
        "share_saving": share_saving(materialized, tokens) if materialized is not None and tokens else None,
        "hidden_size": hidden_size,
        "hidden_tensors": n_tensors,
        # hidden_states ids (hsextract.layers), and the final state stored after them
        "aux_layers": list(settings.extract.aux_layers),
        "final_state": settings.extract.final_state,
        # of one hidden value: the activations' dtype (fp8 precision: its raw bf16)
        "value_bytes": VALUE_BYTES[settings.extract.activation_dtype],
        "raw_bytes_per_token": raw_per_token,
        "raw_bytes": raw,
        "codec_ratio": ratio,
        "codec_ratio_source": ratio_source,
        "stored_bytes": stored,
        # export_formats: each format's folder under results/<run>/export/, uncompressed, every sample whole
        "export_formats": list(settings.export_formats),
        "export_tokens": export_tokens,
        "export_bytes_per_token": {f: per for f, (per, _) in exports.items()},
        "export_bytes": {f: b for f, (_, b) in exports.items()},
        "export_bytes_total": export_total,
        # what results/<run>/ needs on the shared filesystem (or bucket): the shards and the exports (the prompts,
        # statistics and reports besides: small beside these)
        "shared_fs_bytes": stored + export_total,
        "prompts_per_chunk": ppc,
        "shards": chunks,
        "chunks_per_job": cpj,
        "chunk_jobs": jobs,
        "stored_bytes_per_shard": math.ceil(stored / chunks),
        "stored_bytes_per_job": math.ceil(stored / chunks) * min(cpj, chunks),
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "tokens_per_s_per_node": tokens_per_s,
        "writer_ceiling_raw_bytes_per_s_per_node": ceiling,
        "writer_ceiling_source": ceiling_source if ceiling is not None else "not measured for fp8_e4m3",
        "bound": bound,
        "effective_tokens_per_s_per_node": effective,
        "disk_write_bytes_per_s_per_node": disk_bps,
        "node_hours": node_hours,
        "gpu_hours": gpu_hours,
        "wall_hours": wall_hours,
        # shards written by the busiest node (what a node-local staging disk must hold at most)
        "stored_bytes_per_node": min(stored, math.ceil(stored / chunks) * busiest),
    }


def bytes_text(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f} {unit} ({n:,} B)"
    return f"{n} B"


def _hours(h: float | None, why: str) -> str:
    return why if h is None else f"{h:,.2f} h"


def _ceiling(p: Mapping[str, Any]) -> str:
    c = p["writer_ceiling_raw_bytes_per_s_per_node"]
    if c is None:
        return p["writer_ceiling_source"]
    return (f"{c / 1e9:,.2f} GB/s raw per node = {c / p['raw_bytes_per_token']:,.0f} tokens/s "
            f"({p['writer_ceiling_source']})")


def _bound(p: Mapping[str, Any]) -> str:
    if p["bound"] is None:
        return "- (no writer ceiling measured for this precision)"
    if p["bound"] == "GPU":
        return "the GPUs: the capture path keeps up"
    if p["bound"] == "CPU":
        return "the engine's CPU (transformers.device: cpu): the capture path keeps up"
    return (f"the writer: {p['effective_tokens_per_s_per_node']:,.0f} of {p['tokens_per_s_per_node']:,.0f} "
            f"tokens/s per node (hours below at that rate); more shard threads or a faster disk")


BESIDES = "(and the prompts and reports, small beside them)"


def _export_rows(p: Mapping[str, Any]) -> list[tuple[str, str]]:
    formats = p["export_formats"]
    if not formats:
        return [("exports", "none (export_formats: [])"),
                ("shared filesystem", f"{bytes_text(p['shared_fs_bytes'])}: the shards {BESIDES}")]
    rows = []
    for f in formats:
        per = p["export_bytes_per_token"][f]
        rows.append((f"export {f}",
                     f"{bytes_text(p['export_bytes'][f])} = {p['export_tokens']:,} tokens (every sample whole) x "
                     f"{per:,} B ({per - p['hidden_tensors'] * p['hidden_size'] * p['value_bytes']} + "
                     f"{p['hidden_tensors']} x {p['hidden_size']} x {p['value_bytes']}), uncompressed"))
    what = "shards + export" + ("s" if len(formats) > 1 else "")
    rows.append(("shared filesystem", f"{bytes_text(p['shared_fs_bytes'])}: {what} {BESIDES}"))
    return rows


FINAL_STATE_SAID = {"pre_norm": ": before the model's final norm", "post_norm": ": after the model's final norm"}


def format_plan(p: Mapping[str, Any]) -> str:
    """A two-column table of the plan for a terminal (and docs/CLUSTER.md)."""
    no_rate = "- (give --tokens-per-s)"
    no_gpus = no_rate if p["tokens_per_s_per_node"] is None else "- (give --gpus-per-node)"
    rows = [
        ("model", f"{p['model']} (hidden size {p['hidden_size']}, {p['hidden_tensors']} stored tensors, "
                  f"{p['dtype'] if p['precision'] == 'bf16' else p['precision']})"),
        ("layers", (f"{describe(p['aux_layers'])}, then the final state" if p["aux_layers"] else
                    "the final state alone") + f" ({p['final_state']}{FINAL_STATE_SAID.get(p['final_state'], '')})"),
        ("records", f"{p['records']:,} (input records)"),
        ("tokens per record", f"{p['tokens_per_record']:,.1f} ({p['tokens_per_record_source']})"),
        ("tokens", f"{p['tokens']:,}"),
        *([("", f"distinct tokens (share_prefixes: each shared prefix stored and computed once); "
                f"materialized {p['materialized_tokens']:,} ({p['share_saving']}x), as a trainer reads them; a sample "
                "whose parent's keys and values the engine no longer held is computed and stored whole (a WARNING "
                "in its extract log)")]
          if p.get("materialized_tokens") is not None else []),
        # --mean-tokens counts a record's samples whole: with sharing on, what is stored and computed is less
        *([("", "share_prefixes: each record's samples counted whole, an upper bound on the distinct tokens "
                "stored and computed; measure those with --prepare-summary (prepare a sample of the sources)")]
          if p.get("share_prefixes") and p.get("materialized_tokens") is None else []),
        ("raw bytes per token",
         f"{p['raw_bytes_per_token']:,} B (16 + {p['hidden_tensors']} x {p['hidden_size']} x "
         f"{p['value_bytes']})"),
        ("raw bytes (speculators v1)" if p.get("materialized_tokens") is None
         else "raw bytes (distinct rows)", bytes_text(p["raw_bytes"])),
        ("codec ratio", f"{p['codec_ratio']} ({p['codec_ratio_source']})"),
        ("stored bytes", bytes_text(p["stored_bytes"])),
        *_export_rows(p),
        ("shards (chunks)",
         f"{p['shards']:,} of {p['prompts_per_chunk']:,} records, ~{bytes_text(p['stored_bytes_per_shard'])} each"),
        ("chunk jobs",
         f"{p['chunk_jobs']:,} ({p['chunks_per_job']} chunks per job, ~{bytes_text(p['stored_bytes_per_job'])} each)"),
        ("throughput",
         no_rate if p["tokens_per_s_per_node"] is None else f"{p['tokens_per_s_per_node']:,.0f} tokens/s per node"),
        ("writer ceiling", _ceiling(p)),
        ("bound by", no_rate if p["tokens_per_s_per_node"] is None else _bound(p)),
        ("disk write per node", no_rate if p["disk_write_bytes_per_s_per_node"] is None
         else f"{p['disk_write_bytes_per_s_per_node'] / 1e9:,.3f} GB/s of shards"),
        ("node-hours", _hours(p["node_hours"], no_rate)),
        ("GPU-hours", _hours(p["gpu_hours"], no_gpus)
         + (f" ({p['gpus_per_node']} GPUs per node)" if p["gpu_hours"] is not None else "")),
        ("wall time", _hours(p["wall_hours"], no_rate) + f" on {p['nodes']} node(s), one job per node at a time"),
        ("disk per node", f"{bytes_text(p['stored_bytes_per_node'])} of shards on the busiest of {p['nodes']} node(s)"),
        *([("regenerate", f"on, and not in these figures: each assistant turn generated first (up to "
                          f"{p['regenerate_max_new_tokens']:,} new tokens) by the target, before prepare; the "
                          "tokens above are the source's, not the regenerated ones; time it on a sample")]
          if p.get("regenerate_max_new_tokens") is not None else []),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


__all__ = ["CODEC_RATIO_BF16", "CODEC_RATIO_FP8", "CODEC_RATIO_SOURCE", "EXPORT_IDS_BYTES", "WRITER_CEILINGS_RAW_BPS",
           "export_bytes", "format_plan", "plan", "shard_bytes", "writer_ceiling"]
