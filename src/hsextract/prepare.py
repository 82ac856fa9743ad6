"""The prepare stage: sources -> mixture -> chat template + loss mask -> filters -> prompts parquet chunks.

Outputs in `out_dir`:
  chunk-NNNNN.parquet   one per chunk, always all `num_chunks` of them (some may hold 0 rows).
                        Record k of the mixture (0-based, malformed records included) goes to chunk
                        k // prompts_per_chunk, so the chunk count is known before anything is read:
                        `num_chunks(config)` = ceil(count_records / prompts_per_chunk).
                        Columns: sample_id string, input_ids list<int64>, loss_mask list<int8>,
                        num_tokens int32, num_trained int32, source string.
  token_freq.pt         torch.save({token_id: count}) over trained tokens of kept samples (speculators format).
  summary.json          records read, samples kept (a record split into turns gives several: `split_turns`,
                        sample ids `<id>:t<message index>`), dropped by reason (`not_prefix_stable` among them),
                        truncated, tokens, trained tokens, per source and per chunk; `masks`: the masker's
                        counters (conversations, split_conversations, samples, turns, turns_history_fallback, ...).
Every file is written to a temporary name in `out_dir` and renamed.

Config keys read (defaults in DEFAULTS): sources, seed, prompts_per_chunk, max_seq_len, truncate,
min_trained_tokens, train_on_eot, train_on_reasoning, dedup, strict, chat_template_kwargs, chat_template,
trust_remote_code, split_turns.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hsextract.conversations import (Conversation, MalformedRecordError, count_records, mixture, open_sources)
from hsextract.errors import ConfigError
from hsextract.loss_mask import SPLIT_MODES, ChatMasker, TemplateError
from hsextract.tokenizer_loading import load_tokenizer
from hsextract.vocab import save_token_freq, token_freq

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "max_seq_len": None,  # None: no limit
    "truncate": False,  # over max_seq_len: False drops the sample, True cuts it
    "min_trained_tokens": 1,
    "train_on_eot": True,
    "train_on_reasoning": True,
    "dedup": True,
    "strict": True,
    "chat_template_kwargs": {},
    "chat_template": None,  # path to a .jinja file or template text; None: the tokenizer's own
    "trust_remote_code": False,  # load a tokenizer that is custom code (tokenizer_config.json auto_map)
    "split_turns": "auto",  # auto | never | always: one sample per assistant turn (loss_mask.py)
}

SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("input_ids", pa.list_(pa.int64())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("num_trained", pa.int32()),
    ("source", pa.string()),
])

TOO_LONG = "too_long"
NO_TRAINED_TOKENS = "no_trained_tokens"
DUPLICATE = "duplicate"
TEMPLATE_ERROR = "template_error"


def chunk_name(chunk: int) -> str:
    return f"chunk-{chunk:05d}.parquet"


def _settings(config: Mapping[str, Any]) -> dict[str, Any]:
    cfg = {**DEFAULTS, **{k: v for k, v in config.items() if k in DEFAULTS or k in ("sources", "prompts_per_chunk")}}
    ppc = cfg.get("prompts_per_chunk")
    if isinstance(ppc, bool) or not isinstance(ppc, int) or ppc <= 0:
        raise ConfigError(f"config key `prompts_per_chunk` must be a positive integer, got {ppc!r}")
    msl = cfg["max_seq_len"]
    if msl is not None and (isinstance(msl, bool) or not isinstance(msl, int) or msl <= 0):
        raise ConfigError(f"config key `max_seq_len` must be a positive integer or null, got {msl!r}")
    mtt = cfg["min_trained_tokens"]
    if isinstance(mtt, bool) or not isinstance(mtt, int) or mtt < 0:
        raise ConfigError(f"config key `min_trained_tokens` must be an integer >= 0, got {mtt!r}")
    for key in ("truncate", "train_on_eot", "train_on_reasoning", "dedup", "strict", "trust_remote_code"):
        if not isinstance(cfg[key], bool):
            raise ConfigError(f"config key `{key}` must be true or false, got {cfg[key]!r}")
    if not isinstance(cfg["chat_template_kwargs"] or {}, Mapping):
        raise ConfigError("config key `chat_template_kwargs` must be a mapping")
    if cfg["split_turns"] not in SPLIT_MODES:
        raise ConfigError(f"config key `split_turns` must be one of {list(SPLIT_MODES)}, got {cfg['split_turns']!r}")
    if isinstance(cfg["seed"], bool) or not isinstance(cfg["seed"], int):
        raise ConfigError(f"config key `seed` must be an integer, got {cfg['seed']!r}")
    return cfg


def num_chunks(config: Mapping[str, Any]) -> int:
    """Chunk count from the config alone (cheap: counts records, parses nothing): what Snakemake needs."""
    cfg = _settings(config)
    return math.ceil(count_records(cfg["sources"]) / cfg["prompts_per_chunk"])


def conversation_hash(conv: Conversation) -> str:
    payload = json.dumps({"messages": conv.messages, "tools": conv.tools}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _atomic_write_bytes(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_chunk(out_dir: Path, chunk: int, rows: list[dict[str, Any]]) -> None:
    table = pa.Table.from_pylist(rows, schema=SCHEMA) if rows else SCHEMA.empty_table()
    _atomic_write_bytes(out_dir / chunk_name(chunk), lambda tmp: pq.write_table(table, tmp))


def _new_stats() -> dict[str, Any]:
    return {"read": 0, "kept": 0, "truncated": 0, "dropped": Counter(), "tokens": 0, "trained_tokens": 0}


def run_prepare(config: Mapping[str, Any], tokenizer_path: Any, out_dir: str | os.PathLike[str],
                num_chunks: int) -> dict[str, Any]:
    """Run the stage; returns the summary dict (also written to out_dir/summary.json).

    `num_chunks` is the count the workflow computed at parse time (`num_chunks(config)`); a mismatch means
    the sources changed since, and is an error. `tokenizer_path` may also be a tokenizer object.
    """
    cfg = _settings(config)
    sources = open_sources(cfg["sources"])
    order = mixture(sources, cfg["seed"])
    ppc = cfg["prompts_per_chunk"]
    expected = math.ceil(len(order) / ppc)
    if not order:
        raise ConfigError("config key `sources`: the sources hold no records (after weights and max_records)")
    if num_chunks != expected:
        raise ConfigError(
            f"num_chunks is {num_chunks} but the sources now hold {len(order)} records = {expected} chunks of "
            f"{ppc}; the inputs changed after the workflow was parsed: rerun snakemake")
    tokenizer = load_tokenizer(tokenizer_path, cfg["chat_template"], trust_remote_code=cfg["trust_remote_code"])
    masker = ChatMasker(tokenizer, train_on_eot=cfg["train_on_eot"], train_on_reasoning=cfg["train_on_reasoning"],
                        chat_template_kwargs=dict(cfg["chat_template_kwargs"] or {}), split_turns=cfg["split_turns"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    strict, msl = cfg["strict"], cfg["max_seq_len"]
    total = _new_stats()
    per_source = {s.spec.name: _new_stats() for s in sources}
    per_chunk: list[dict[str, int]] = []
    seen: dict[str, tuple[int, int]] = {}
    freq: Counter[int] = Counter()
    rows: list[dict[str, Any]] = []
    chunk = 0

    def drop(st: dict[str, Any], reason: str) -> None:
        st["dropped"][reason] += 1
        total["dropped"][reason] += 1

    for k, entry in enumerate(order):
        while k // ppc > chunk:
            _write_chunk(out, chunk, rows)
            per_chunk.append({"chunk": chunk, "records": min(ppc, len(order) - chunk * ppc), "rows": len(rows),
                              "tokens": sum(r["num_tokens"] for r in rows)})
            rows, chunk = [], chunk + 1
        src = sources[entry.source]
        st = per_source[src.spec.name]
        st["read"] += 1
        total["read"] += 1
        try:
            location, conv = src.read(entry.index)
        except MalformedRecordError as e:
            if strict:
                raise
            drop(st, e.reason)
            continue
        if cfg["dedup"]:
            h = conversation_hash(conv)
            origin = (entry.source, entry.index)
            if seen.setdefault(h, origin) != origin:  # repeats of one record (weight > 1) are not duplicates
                drop(st, DUPLICATE)
                continue
        try:
            samples = masker.encode(conv)
        except Exception as e:  # jinja errors (raise_exception in templates) and TemplateError
            if strict:
                raise TemplateError(f"{location}: {e}", getattr(e, "reason", TEMPLATE_ERROR)) from e
            drop(st, getattr(e, "reason", TEMPLATE_ERROR))
            continue
        for sample in samples:  # several when the conversation is split into turns (`split_turns`)
            ids, mask = sample.input_ids, sample.loss_mask
            if msl is not None and len(ids) > msl:
                if not cfg["truncate"]:
                    drop(st, TOO_LONG)
                    continue
                ids, mask = ids[:msl], mask[:msl]
                st["truncated"] += 1
                total["truncated"] += 1
            n_trained = sum(mask)
            if n_trained < cfg["min_trained_tokens"]:
                drop(st, NO_TRAINED_TOKENS)
                continue
            sid = entry.sample_id if sample.turn is None else f"{entry.sample_id}:t{sample.turn}"
            rows.append({"sample_id": sid, "input_ids": ids, "loss_mask": mask, "num_tokens": len(ids),
                         "num_trained": n_trained, "source": src.spec.name})
            freq.update(t for t, m in zip(ids, mask) if m)
            for s in (st, total):
                s["kept"] += 1
                s["tokens"] += len(ids)
                s["trained_tokens"] += n_trained
    _write_chunk(out, chunk, rows)
    per_chunk.append({"chunk": chunk, "records": len(order) - chunk * ppc, "rows": len(rows),
                      "tokens": sum(r["num_tokens"] for r in rows)})

    save_token_freq(dict(freq), out / "token_freq.pt")
    template = tokenizer.chat_template or ""
    summary = {
        **_jsonable(total),
        "num_chunks": num_chunks,
        "prompts_per_chunk": ppc,
        "per_source": {name: _jsonable(s) for name, s in per_source.items()},
        "per_chunk": per_chunk,
        "token_freq": "token_freq.pt",
        "chat_template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
        "masks": dict(sorted(masker.stats.items())),
        "settings": {k: cfg[k] for k in DEFAULTS if k != "chat_template"} | {"prompts_per_chunk": ppc},
    }
    text = json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n"
    _atomic_write_bytes(out / "summary.json", lambda tmp: Path(tmp).write_text(text))
    return summary


def _jsonable(st: dict[str, Any]) -> dict[str, Any]:
    return {**st, "dropped": dict(sorted(st["dropped"].items())), "dropped_total": sum(st["dropped"].values())}


# `token_freq` is re-exported for callers that recompute frequencies from chunks.
__all__ = ["DEFAULTS", "SCHEMA", "chunk_name", "conversation_hash", "load_tokenizer", "num_chunks", "run_prepare",
           "token_freq"]
