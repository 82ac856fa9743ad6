"""The prepare stage: sources -> mixture -> chat template + loss mask -> filters -> prompts parquet chunks.

Outputs in `out_dir`:
  chunk-NNNNN.parquet   one per chunk, always all `num_chunks` of them (some may hold 0 rows).
                        Record k of the mixture (0-based, malformed records included) goes to chunk
                        k // prompts_per_chunk, so the chunk count is known before anything is read:
                        `num_chunks(settings)` = ceil(count_records / prompts_per_chunk) (hsextract.config.chunks).
                        Columns: sample_id string, input_ids list<int64>, loss_mask list<int8>,
                        num_tokens int32, num_trained int32, source string; with `share_prefixes` also parent
                        int32 (the earlier row of the chunk it shares its longest prefix with, or -1) and
                        prefix_len int32 (the leading tokens whose rows it takes from it:
                        hsextract.prepare.prefix_share).
  token_freq.pt         torch.save({token_id: count}) over trained tokens of kept samples (speculators format).
  summary.json          records read, samples kept (a record split into turns gives several: `split_turns`,
                        sample ids `<id>:t<message index>`), dropped by reason (`not_prefix_stable` among them),
                        truncated (kept samples cut to max_seq_len), tokens, trained tokens, per source and per
                        chunk (with `share_prefixes` also `distinct_tokens`, Σ tokens − prefix_len, and
                        `shared_samples`, rows with a parent; absent
                        without: `hsextract plan` tells the two apart by them); `masks`: the masker's
                        counters (conversations, split_conversations, samples, turns, turns_history_fallback, ...).
Every file is written to a temporary name in `out_dir` and renamed. A `chunk-NNNNN.parquet` of a chunk >= num_chunks (an
earlier configuration's) is removed, with one line on stdout each (hsextract.config.chunks.remove_beyond).

Settings: hsextract.config.settings.PrepareSettings (the config's sources, mixture and filter keys).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hsextract import provenance
from hsextract.atomic import write_bytes_atomic
from hsextract.config import chunks
from hsextract.config.reruns import plain
from hsextract.config.settings import PrepareSettings
from hsextract.errors import ConfigError
from hsextract.masks.masker import ChatMasker
from hsextract.masks.refusals import TEMPLATE_ERROR, TemplateError, failure
from hsextract.prepare import drops
from hsextract.prepare.conversations import (
    Conversation,
    MalformedRecordError,
    OpenSource,
    conversation_hash,
    count_records,
    decode_raw,
    mixture,
    no_records,
    open_sources,
)
from hsextract.prepare.drops import DUPLICATE, DUPLICATE_SAMPLE, NO_TRAINED_TOKENS, TOO_LONG, TRUNCATED_UNTRAINED
from hsextract.prepare.prefix_share import distinct_tokens, find_parents
from hsextract.prepare.sources import data_files
from hsextract.prepare.tokenizer_loading import load_tokenizer
from hsextract.prepare.vocab import save_token_freq, token_freq
from hsextract.progress import bar

SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("input_ids", pa.list_(pa.int64())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("num_trained", pa.int32()),
    ("source", pa.string()),
])

SHARED_SCHEMA = SCHEMA.append(pa.field("parent", pa.int32())).append(pa.field("prefix_len", pa.int32()))

def chunk_name(chunk: int) -> str:
    return chunks.name(chunk, ".parquet")


def num_chunks(settings: PrepareSettings) -> int:
    """Chunk count from the settings alone (cheap: counts records, parses nothing): what Snakemake needs."""
    return chunks.count(count_records(settings.sources), settings.prompts_per_chunk)


def _write_chunk(out_dir: Path, chunk: int, rows: list[dict[str, Any]],
                 records: list[int] | None = None) -> tuple[list[tuple[int, int]] | None, str]:
    """Write a chunk's rows; `records` (share_prefixes: the record each row came from) adds each row's parent and
    prefix length. Returns the (parent, prefix length) of each row (None without `records`) and the file's sha256
    (summary.json's per_chunk: extract refuses a prompts file that is not the one written here)."""
    if records is None:
        table = pa.Table.from_pylist(rows, schema=SCHEMA) if rows else SCHEMA.empty_table()
        refs = None
    else:
        refs = find_parents([r["input_ids"] for r in rows], records)
        shared = [r | {"parent": p, "prefix_len": k} for r, (p, k) in zip(rows, refs, strict=True)]
        table = pa.Table.from_pylist(shared, schema=SHARED_SCHEMA) if rows else SHARED_SCHEMA.empty_table()
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    data = sink.getvalue().to_pybytes()
    write_bytes_atomic(out_dir / chunk_name(chunk), data)
    return refs, hashlib.sha256(data).hexdigest()


def _count_shared(st: dict[str, Any], rows: Sequence[Mapping[str, Any]], refs: Sequence[tuple[int, int]]) -> None:
    """Add rows to a summary entry's `distinct_tokens` (each sample's tokens less the prefix it takes from its
    parent: what extract stores and computes) and `shared_samples` (samples with a parent)."""
    st["distinct_tokens"] = st.get("distinct_tokens", 0) + distinct_tokens([r["num_tokens"] for r in rows], refs)
    st["shared_samples"] = st.get("shared_samples", 0) + sum(p >= 0 for p, _ in refs)


def _source_hash(src: OpenSource) -> str:
    """sha256 of the files the source's reader reads (every byte: a few seconds a GB)."""
    try:
        return provenance.data_hash(data_files(src.spec))
    except OSError as e:
        raise ConfigError(f"source {src.spec.name!r} ({src.spec.path}): cannot read it to record its checksum: "
                          f"{e}") from None


def _check_regenerated_count(sources: list[OpenSource], n: int) -> None:
    """ConfigError where regenerate's joined file holds another number of records than its stats say it wrote."""
    from hsextract.regenerate.files import records_written, stats_path

    for src in sources:
        written = records_written(stats_path(src.spec.path))
        if written is not None and written != n:
            raise ConfigError(
                f"{src.spec.path}: {n} records, but {stats_path(src.spec.path).name} beside it says regenerate "
                f"joined {written} (one line per input record): the file was edited or damaged since. Delete it and "
                f"rerun: its chunks are joined again")


def _regenerated(src: OpenSource, index: int) -> tuple[re.Match[str] | None, str | None]:
    """Of a line of regenerate's file: its id, the input record's sample id (`source:index`, `#k` for a weight's
    repeat), matched as (record, repeat), and the hash of the input conversation it was regenerated from (what
    dedup compares: sampled generations of two equal inputs differ); None for a line without one."""
    rec = decode_raw(src.reader.raw(index)[1])
    sid = rec.get("id") if isinstance(rec, dict) else None
    h = rec.get("input_sha256") if isinstance(rec, dict) else None
    return (re.fullmatch(r"(.+:\d+)(#\d+)?", sid) if isinstance(sid, str) else None,
            h if isinstance(h, str) else None)


# The masker of a worker process (inherited through fork: the tokenizer, its custom code and the template's clock
# are the parent's own, so every worker renders exactly as the parent would).
_WORKER_MASKER: ChatMasker | None = None


def _encode(conv: Conversation) -> tuple[Any, Counter[str]]:
    """(samples, or (failure text, reason) when the template refuses the conversation; the masker's counters that
    this conversation added). Runs in a worker, or in the main process with one worker."""
    m = _WORKER_MASKER
    assert m is not None
    before = Counter(m.stats)
    try:
        out: Any = m.encode(conv)
    except Exception as e:  # noqa: BLE001 - jinja errors (raise_exception in templates) and TemplateError
        out = (failure(e), getattr(e, "reason", TEMPLATE_ERROR))
    added, m.stats = m.stats - before, before  # the caller counts them, in record order
    return out, added


def _start_workers(masker: ChatMasker, workers: int) -> ProcessPoolExecutor | None:
    """`workers` forked processes holding `masker` (None for one worker: this process encodes). A worker that dies
    (the OOM killer) breaks the pool: BrokenProcessPool, never a wait without end."""
    global _WORKER_MASKER
    _WORKER_MASKER = masker
    if workers <= 1:
        return None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the Rust tokenizer's own threads do not survive a fork
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))


def _stop_workers(pool: ProcessPoolExecutor | None) -> None:
    global _WORKER_MASKER
    _WORKER_MASKER = None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def _encoded(convs: list[Conversation], pool: ProcessPoolExecutor | None,
             workers: int) -> list[tuple[Any, Counter[str]]]:
    if pool is None:
        return [_encode(c) for c in convs]
    return list(pool.map(_encode, convs, chunksize=max(1, len(convs) // (4 * workers))))


# Records read and encoded together, per worker: enough to keep each busy across the batch's slowest conversation,
# few enough to bound the memory, as a batch's samples are held until they are counted in record order (8 workers:
# 64 records, config/kimi.yaml's prompts_per_chunk, whose rows a chunk holds anyway).
BATCH_PER_WORKER = 8


def _new_stats() -> dict[str, Any]:
    return {"read": 0, "kept": 0, "truncated": 0, "dropped": Counter(), "tokens": 0, "trained_tokens": 0}


def run_prepare(settings: PrepareSettings, tokenizer_path: Any, out_dir: str | os.PathLike[str],
                num_chunks: int, *, regenerated: bool = False, workers: int = 1) -> dict[str, Any]:
    """Run the stage; returns the summary dict (also written to out_dir/summary.json).

    `num_chunks` is the count the workflow computed at parse time (`num_chunks(settings)`); a mismatch means
    the sources changed since, and is an error. `tokenizer_path` may also be a tokenizer object.
    `regenerated`: the sources are regenerate's conversation file, whose records' ids name the input record
    each line regenerates (a weight's repeats, lines of their own there, are then no duplicates either).
    `workers`: processes that render and mask the conversations (the stage's cost: a long agentic conversation
    takes seconds); records are read, filtered and written in order by this process, so every output is byte
    for byte the one of `workers=1`.
    """
    cfg = settings
    sources = open_sources(cfg.sources)
    order = mixture(sources, cfg.seed)
    ppc = cfg.prompts_per_chunk
    expected = chunks.count(len(order), ppc)
    if not order:
        raise ConfigError(f"config key `sources`: the sources hold no records after weights and max_records "
                          f"({no_records(cfg.sources)})")
    if regenerated:  # one line per input record: a count off by a line is an edited or damaged joined file
        _check_regenerated_count(sources, len(order))
    if num_chunks != expected:
        raise ConfigError(
            f"num_chunks is {num_chunks} but the sources now hold {len(order)} records = {expected} chunks of "
            f"{ppc}; the inputs changed after the workflow was parsed: rerun snakemake")
    # what the data was, before a record is read (dataset.json's provenance): a source edited later no longer matches
    source_files = {src.spec.name: {"path": str(src.spec.path), "sha256": _source_hash(src)} for src in sources}
    tokenizer = load_tokenizer(tokenizer_path, cfg.chat_template, trust_remote_code=cfg.trust_remote_code)
    masker = ChatMasker(tokenizer, train_on_eot=cfg.train_on_eot, train_on_reasoning=cfg.train_on_reasoning,
                        chat_template_kwargs=dict(cfg.chat_template_kwargs or {}), split_turns=cfg.split_turns)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    strict, msl = cfg.strict, cfg.max_seq_len
    total = _new_stats()
    per_source = {s.spec.name: _new_stats() for s in sources}
    per_chunk: list[dict[str, Any]] = []
    seen: dict[str, tuple[int, int | str]] = {}
    seen_samples: dict[bytes, tuple[int, int | str]] = {}  # a kept sample's ids and mask -> its record (dedup)
    freq: Counter[int] = Counter()
    rows: list[dict[str, Any]] = []
    chunk = 0

    row_records: list[int] = []  # the record (mixture entry) of each row: its turns share a conversation

    def close_chunk() -> None:
        refs, sha = _write_chunk(out, chunk, rows, row_records if cfg.share_prefixes else None)
        entry: dict[str, Any] = {"chunk": chunk, "records": len(chunks.records(chunk, ppc, len(order))),
                                 "rows": len(rows), "tokens": sum(r["num_tokens"] for r in rows), "sha256": sha}
        if refs is not None:  # share_prefixes: the chunk's, the total's and each source's (a saving counts for
            _count_shared(entry, rows, refs)  # the source of the sample that takes the prefix)
            _count_shared(total, rows, refs)
            for name, st in per_source.items():
                own = [(r, ref) for r, ref in zip(rows, refs, strict=True) if r["source"] == name]
                _count_shared(st, [r for r, _ in own], [ref for _, ref in own])
        per_chunk.append(entry)

    def drop(st: dict[str, Any], reason: str) -> None:
        st["dropped"][reason] += 1
        total["dropped"][reason] += 1

    def read(k: int) -> tuple[str, Any]:
        """Record k of the mixture: ("conv", (location, conversation, sample id, input record)), ("malformed", the
        error) or ("duplicate",). A regenerated record's sample id and input record are those of the input record
        it regenerates (not its line there)."""
        entry = order[k]
        src = sources[entry.source]
        try:
            location, conv = src.read(entry.index)
        except MalformedRecordError as e:
            return "malformed", e
        rid, input_hash = _regenerated(src, entry.index) if regenerated else (None, None)
        # the input record: repeats of one (weight > 1, lines of their own in regenerate's file) are no duplicates
        origin = (entry.source, rid.group(1) if rid else entry.index)
        if cfg.dedup and seen.setdefault(input_hash or conversation_hash(conv), origin) != origin:
            return "duplicate", None
        return "conv", (location, conv, rid.group(0) if rid else entry.sample_id, origin)

    def outcomes(pool: ProcessPoolExecutor | None) -> Iterator[tuple[int, str, Any, Any]]:
        """(k, what read gave, the encoding or None) of every record, in order; a batch encoded at once."""
        step = BATCH_PER_WORKER * workers
        for start in range(0, len(order), step):
            got = [read(k) for k in range(start, min(start + step, len(order)))]
            encoded = iter(_encoded([p[1] for kind, p in got if kind == "conv"], pool, workers))
            for k, (kind, payload) in enumerate(got, start):
                yield k, kind, payload, next(encoded) if kind == "conv" else None

    pool = _start_workers(masker, workers)
    try:
        for k, kind, payload, encoding in bar(outcomes(pool), desc="prepare", unit="record", total=len(order)):
            entry = order[k]
            while chunks.of_record(k, ppc) > chunk:
                close_chunk()
                rows, row_records, chunk = [], [], chunk + 1
            src = sources[entry.source]
            st = per_source[src.spec.name]
            st["read"] += 1
            total["read"] += 1
            if kind == "malformed":
                if strict:
                    raise payload
                drop(st, payload.reason)
                continue
            if kind == "duplicate":
                drop(st, DUPLICATE)
                continue
            samples, counted = encoding
            masker.stats.update(counted)
            base = payload[2]
            if isinstance(samples, tuple):  # the template refused it: (failure text, reason)
                if strict:
                    text = samples[0] if "strict: false" in samples[0] else (
                        f"{samples[0]} (or set `strict: false` to drop such records, counted as {samples[1]})")
                    raise TemplateError(f"{payload[0]}: {text}", samples[1])
                drop(st, samples[1])
                continue
            for sample in samples:  # several when the conversation is split into turns (`split_turns`)
                ids, mask = sample.input_ids, sample.loss_mask
                cut = msl is not None and len(ids) > msl
                if cut:
                    if not cfg.truncate:
                        drop(st, TOO_LONG)
                        continue
                    ids, mask = ids[:msl], mask[:msl]
                n_trained = sum(mask)
                if n_trained < cfg.min_trained_tokens:
                    drop(st, TRUNCATED_UNTRAINED if cut and sum(sample.loss_mask) >= cfg.min_trained_tokens
                         else NO_TRAINED_TOKENS)
                    continue
                if cfg.dedup:  # of another input record (a weight's repeats are one, as for records)
                    h = hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes() + bytes(mask), digest_size=16)
                    if seen_samples.setdefault(h.digest(), payload[3]) != payload[3]:
                        drop(st, DUPLICATE_SAMPLE)
                        continue
                if cut:  # kept samples only: a dropped one is counted once, under its reason
                    st["truncated"] += 1
                    total["truncated"] += 1
                sid = base if sample.turn is None else f"{base}:t{sample.turn}"
                rows.append({"sample_id": sid, "input_ids": ids, "loss_mask": mask, "num_tokens": len(ids),
                             "num_trained": n_trained, "source": src.spec.name})
                row_records.append(k)
                freq.update(t for t, m in zip(ids, mask, strict=True) if m)
                for s in (st, total):
                    s["kept"] += 1
                    s["tokens"] += len(ids)
                    s["trained_tokens"] += n_trained
    finally:
        _stop_workers(pool)
    if total["read"] and not total["kept"]:  # strict: false, and every record dropped: extract would run for nothing
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(total["dropped"].items()))
        raise ConfigError(f"prepare kept no sample of the {total['read']} records read (dropped: {reasons}): "
                          "config/README.md says what each reason means (filters drop whatever `strict` says; a "
                          "malformed record or a template's refusal stops a strict run, naming it)")
    close_chunk()
    # the prompts of chunks an earlier configuration of more chunks had: the manifest step removes their shards,
    # reports and statistics
    chunks.remove_beyond(out, ".parquet", num_chunks)
    missing = [chunk_name(k) for k in range(num_chunks) if not (out / chunk_name(k)).is_file()]
    if missing:  # every chunk's prompts, or no summary: the workflow's extract jobs read one each
        raise RuntimeError(f"prepare did not write {', '.join(missing)} in {out}")

    save_token_freq(dict(freq), out / "token_freq.pt")
    template = tokenizer.chat_template or ""
    summary = {
        **_jsonable(total),
        "num_chunks": num_chunks,
        "prompts_per_chunk": ppc,
        "per_source": {name: _jsonable(s) for name, s in per_source.items()},
        "source_files": source_files,
        "per_chunk": per_chunk,
        "token_freq": "token_freq.pt",
        "chat_template_sha256": provenance.text_hash(template),
        "masks": dict(sorted(masker.stats.items())),
        # the whole section, each field's effective value (the chat template by its hash, above)
        "settings": {k: v for k, v in plain(cfg).items() if k != "chat_template"},
    }
    text = json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n"
    write_bytes_atomic(out / "summary.json", text.encode())
    return summary


def _jsonable(st: dict[str, Any]) -> dict[str, Any]:
    return {**st, "dropped": dict(sorted(st["dropped"].items())), **drops.totals(st["dropped"])}


# `token_freq` is re-exported for callers that recompute frequencies from chunks.
__all__ = ["SCHEMA", "chunk_name", "conversation_hash", "load_tokenizer", "num_chunks", "run_prepare",
           "token_freq"]
