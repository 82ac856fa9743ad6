"""`hsextract inspect`: what a shard holds and how well it compressed, from its header and index alone."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from hsextract import layers
from hsextract.prepare.prefix_share import codec_ratio
from hsextract.shard import ShardReader


def shard_info(path: str | os.PathLike[str], samples: bool = False) -> dict[str, Any]:
    """Metadata, counts and sizes of one shard. Checks the whole structure (header, metadata, index, footer,
    every record header and frame table) and raises CorruptShardError where it is damaged; reads no payload."""
    r = ShardReader(path)
    r.check_records()
    raw = r.raw_bytes
    stored = Path(path).stat().st_size
    tokens = r.num_tokens
    row_bytes = (raw - 16 * tokens) // tokens if tokens else 0  # one token's hidden states, as the writer counts
    raw_of_stored = 16 * tokens + row_bytes * r.stored_tokens
    info: dict[str, Any] = {
        "shard": str(path),
        "metadata": r.metadata,
        "num_samples": len(r),
        "format_version": r.metadata["format_version"],
        "num_tokens": tokens,  # materialized: each sample whole
        # shared prefixes (version 2): samples that take their first rows from an earlier one, and the rows stored
        "shared_samples": r.shared_samples,
        "distinct_tokens": r.stored_tokens,
        "num_trained": r.num_trained,
        "raw_bytes": raw,
        "stored_bytes": stored,
        "stored_over_raw": round(stored / raw, 4) if raw else None,
        # the codec alone: over the raw bytes of what is stored (ids and mask of every token, the distinct rows)
        "codec_ratio": codec_ratio(stored, raw_of_stored),
        "layers": layer_info(r.metadata),
    }
    if samples:
        info["samples"] = [
            {"index": i, "sample_id": sid, "seq_len": n, "num_trained": t, "parent": p, "prefix_len": k}
            for i, (sid, n, t, p, k) in enumerate(zip(r.sample_ids, r.seq_lens, r.column("num_trained"), r.parents,
                                                      r.prefix_lens, strict=True))
        ]
    r.close()
    return info


def layer_info(meta: dict[str, Any]) -> dict[str, Any]:
    """The shard's aux layers with their recorded meaning, as hidden_states ids, and each consumer's ids."""
    hs = layers.shard_hidden_states(meta)
    recorded = "layer_convention" in meta
    return {
        "recorded": {"aux_layers": list(meta["aux_layers"]), "convention": layers.shard_convention(meta),
                     "convention_recorded": recorded},
        **({} if recorded else {"note": "written before hsextract recorded a layer convention: its ids are "
                                        "layer outputs (id i = the output of decoder layer i)"}),
        **layers.drafter_config(hs, meta.get("num_hidden_layers"), meta.get("architecture")),
    }


def _layers_text(li: dict[str, Any]) -> list[str]:
    rec, stored = li["recorded"], li["stored"]
    head = f"aux_layers     {rec['aux_layers']} ({rec['convention']} ids"
    head += ")" if rec["convention_recorded"] else ", not recorded: written before hsextract recorded it)"
    lines = [head, f"               = {stored['meaning']}"]
    sgl = li["sglang_0.5.16"]
    arch = sgl["target_architecture"]
    sgl_text = (f"{arch} {sgl['eagle_aux_hidden_state_layer_ids']}" if sgl["eagle_aux_hidden_state_layer_ids"]
                is not None else sgl["note"])
    lines.append(f"drafter config eagle_aux_hidden_state_layer_ids: vLLM "
                 f"{li['vllm']['eagle_aux_hidden_state_layer_ids']}; SGLang 0.5.16 {sgl_text}")
    sf = li["specforge"]
    hf, sgl_backend = (sf[k]["aux_hidden_states_layers"] for k in ("hf_backend", "sglang_backend"))
    now = sf.get("0.2.0", {}).get("aux_hidden_state_layer_ids", sgl_backend)  # layers recorded before it said so
    lines.append(f"               SpecForge 0.2.0 aux_hidden_state_layer_ids {now}; earlier SpecForge "
                 f"aux_hidden_states_layers: HF backend {hf}, SGLang backend {sgl_backend}")
    return lines


def metadata_shown(key: str, entry: Any) -> Any:
    """A metadata entry for people to read (this command, the dataset's errors): the final norm's weight,
    hidden_size values of base64 (19 KB for Kimi-K2.5), as its size and sha256; --json keeps it whole."""
    if key != "final_norm" or not isinstance(entry, dict) or not isinstance(entry.get("weight"), str):
        return entry
    try:
        raw = base64.b64decode(entry["weight"], validate=True)
    except ValueError:
        return {**entry, "weight": "<not base64: damaged>"}
    return {**entry, "weight": f"<{len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()[:16]}>"}


def _mb(n: int) -> str:
    return f"{n / 1e6:.3f} MB"


def format_info(info: dict[str, Any]) -> str:
    """Human-readable text of shard_info()."""
    m = info["metadata"]
    lines = [f"shard          {info['shard']}"]
    for key in ("format_version", "model", "engine", "engine_version", "final_state", "hidden_size",
                "dtype", "precision", "codec", "config_hash", "tokenizer_hash", "chat_template_hash"):
        if key in m:
            value = m[key]
            if key == "precision" and value == "bf16":  # the writer's name for "not fp8": stored as captured
                value = f"full (stored as {m['dtype']})"
            lines.append(f"{key:<14} {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    shown = {line.split()[0] for line in lines[1:]} | {"aux_layers", "layer_convention"}
    lines += _layers_text(info["layers"] if "layers" in info else layer_info(m))
    extra = sorted(set(m) - shown - {"stored_dtype", "num_hidden_tensors", "writer", "zstd_version"})
    for key in extra:
        value = metadata_shown(key, m[key])
        lines.append(f"{key:<14} {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    ratio = "n/a" if info["stored_over_raw"] is None else f"{info['stored_over_raw']:.4f}"
    lines += [
        f"samples        {info['num_samples']} ({info['shared_samples']} take a prefix from an earlier one"
        + ("; that their ids equal it over the prefix is checked by `hsextract validate`, not here)"
           if info["shared_samples"] else ")"),
        f"tokens         {info['num_tokens']} materialized, {info['distinct_tokens']} distinct (stored)",
        f"trained tokens {info['num_trained']}",
        f"raw bytes      {info['raw_bytes']} ({_mb(info['raw_bytes'])})",
        f"stored bytes   {info['stored_bytes']} ({_mb(info['stored_bytes'])})",
        f"stored/raw     {ratio}",
        f"codec ratio    {'n/a' if info['codec_ratio'] is None else format(info['codec_ratio'], '.4f')} (stored "
        "over the raw bytes of what is stored: each shared prefix once)",
    ]
    if "samples" in info:
        lines.append(f"{'index':>6}  {'seq_len':>7}  {'trained':>7}  {'parent':>6}  {'prefix':>7}  sample_id")
        lines += [f"{s['index']:>6}  {s['seq_len']:>7}  {s['num_trained']:>7}  {s['parent']:>6}  {s['prefix_len']:>7}  "
                  f"{s['sample_id']}" for s in info["samples"]]
    return "\n".join(lines)
