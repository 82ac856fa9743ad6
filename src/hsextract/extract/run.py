"""The extract stage as a library function: one chunk of prompts in, one shard out.

Reads a prompts parquet written by prepare, runs an Engine over it, and writes every
captured sample with its ids and loss mask through ShardWriter (atomic: the shard exists
whole or not at all). Padding never reaches the shard: engines return each sample sliced
to its own length, and this module checks that.

Shared prefixes (prepare's `share_prefixes`: the parquet's parent and prefix_len columns): each prompt carries its
reference to the engine; a sample the engine computed from position m on (Captured.start = m, 0 < m <= its prefix
length: the transformers engine's m is the prefix length, SGLang's its radix-cache hit) is stored with the reference
(parent, m) and its own rows only (shard format version 2, docs/SHARED_PREFIX.md); one it computed whole is stored
whole.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hsextract import provenance
from hsextract.atomic import remove_temps
from hsextract.config import chunks, plan
from hsextract.config.model_info import read_model_shape
from hsextract.config.settings import ExtractSettings
from hsextract.engines.base import CaptureSpec, Engine, Prompt
from hsextract.errors import EngineError, ShardError
from hsextract.extract.final_norm import final_norm_metadata
from hsextract.layers import HIDDEN_STATES
from hsextract.progress import counter

PROMPT_COLUMNS = ("sample_id", "input_ids", "loss_mask")
REFERENCE_COLUMNS = ("parent", "prefix_len")  # prepare's, with share_prefixes


@dataclass
class ChunkPrompts:
    sample_ids: list[str]
    input_ids: list[list[int]]
    loss_masks: list[list[int]]
    # per prompt the earlier prompt it shares a prefix with (-1: none) and that prefix's length; None: no sharing
    parents: list[int] | None = None
    prefix_lens: list[int] | None = None
    # sha256 of the parquet read (read_prompts), recorded in the shard as `prompts_sha256`; None: not from a file
    sha256: str | None = None

    def __len__(self) -> int:
        return len(self.sample_ids)


def read_prompts(path: str | Path) -> ChunkPrompts:
    """Read a prompts parquet (prepare's output) and its sha256; any unreadable file is a ShardError naming it."""
    try:
        data = Path(path).read_bytes()  # read once: the rows are those of the bytes hashed
        sha = hashlib.sha256(data).hexdigest()
        shared = set(REFERENCE_COLUMNS) <= set(pq.read_schema(pa.BufferReader(data)).names)
        table = pq.read_table(pa.BufferReader(data),
                              columns=list(PROMPT_COLUMNS) + (list(REFERENCE_COLUMNS) if shared else []))
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for damaged files
        raise ShardError(
            f"{path}: cannot read the prompts parquet ({type(e).__name__}: {e}); "
            f"delete it and rerun prepare"
        ) from None
    cols = table.to_pydict()
    ids, masks = cols["input_ids"], cols["loss_mask"]
    for i, (a, b) in enumerate(zip(ids, masks, strict=True)):
        if len(a) != len(b):
            raise ShardError(f"{path}: row {i}: input_ids has {len(a)} tokens, loss_mask {len(b)}")
    if not shared:
        return ChunkPrompts([str(s) for s in cols["sample_id"]], ids, masks, sha256=sha)
    return ChunkPrompts([str(s) for s in cols["sample_id"]], ids, masks, [int(p) for p in cols["parent"]],
                        [int(k) for k in cols["prefix_len"]], sha256=sha)


def check_written(path: str | Path, sha256: str | None, chunk: int, summary: Mapping[str, Any],
                  summary_path: str | Path) -> None:
    """ShardError when the prompts file is not the one prepare wrote: a damaged parquet can still read cleanly (a
    bit flipped in a compressed page), and its chunk would then be extracted from other tokens."""
    want = chunks.written_sha256(summary, chunk)
    if want is not None and sha256 != want:
        raise ShardError(
            f"{path}: its sha256 is {sha256}, but prepare wrote chunk {chunk}'s prompts with sha256 {want} "
            f"({summary_path}): the file was damaged or changed after prepare, and would be extracted as other "
            f"tokens. Restore it (`cp -p` from a copy), or delete it and run the same command: prepare writes "
            f"every chunk's prompts again, and every chunk is then extracted again")


def capture_spec(settings: ExtractSettings) -> CaptureSpec:
    return CaptureSpec(aux_layers=settings.aux_layers, final_state=settings.final_state)


def build_engine(settings: ExtractSettings, spec: CaptureSpec, chunk: int = 0) -> Engine:
    """The engine the settings ask for; `engine: sglang` picks (or starts) the chunk's server
    through hsextract.sglang.config."""
    name = settings.engine
    if name == "transformers":
        from hsextract.engines.transformers_engine import TransformersEngine, resolve_device

        t = settings.transformers
        return TransformersEngine(settings.model, spec, device=resolve_device(t.device), dtype=t.dtype,
                                  token_budget=t.token_budget)
    if name == "sglang":
        from hsextract.sglang.config import engine_from_config

        return engine_from_config(settings, spec, chunk)
    raise EngineError(f"engine: unknown engine {name!r}; use transformers or sglang")


def shard_metadata(
    settings: ExtractSettings,
    engine: Engine,
    hidden_size: int,
    chunk: int,
    chat_template_hash: str | None = None,
    vocab_size: int | None = None,
    num_hidden_layers: int | None = None,
    architecture: str | None = None,
    prompts_sha256: str | None = None,
) -> dict[str, Any]:
    """The self-description every shard carries (docs/FORMAT.md, "Metadata").

    `chat_template_hash` is the sha256 of the template prepare applied (its summary.json); without
    it, the tokenizer's stored template is hashed. `prompts_sha256`: the sha256 of the prompts parquet the shard is
    made from (the manifest step compares it with the prompts file then there).
    """
    s = settings
    tok_dir = s.tokenizer_dir
    norm, why = final_norm_metadata(s.model, s.activation_dtype)
    if norm is None and s.final_state == "pre_norm":
        print(f"WARNING: the final norm is not recorded in the shards ({why}): `hsextract export --format "
              "specforge` will write these pre_norm states without the final RMSNorm, which SpecForge expects "
              "applied (the export warns too). For SpecForge, set `final_state: post_norm` and extract again",
              file=sys.stderr, flush=True)
    if chat_template_hash is None:
        chat_template_hash = provenance.text_hash(provenance.chat_template_text(tok_dir))
    return {
        "model": s.model,
        "engine": s.engine,
        "engine_version": engine.version(),
        "aux_layers": list(s.aux_layers),
        "layer_convention": HIDDEN_STATES,  # hsextract.layers; shards without it hold layer-output ids
        "num_hidden_layers": num_hidden_layers,
        "architecture": architecture,  # the checkpoint's class: which SGLang layer-id rule its drafter meets
        "final_state": s.final_state,
        "final_norm": norm,  # hsextract.extract.final_norm: post-norm = norm(pre-norm) at export
        "hidden_size": int(hidden_size),
        "dtype": s.activation_dtype,
        "config_hash": s.config_hash,
        "model_hash": provenance.model_hash(s.model),
        "tokenizer_hash": provenance.tokenizer_hash(tok_dir),
        "chat_template_hash": chat_template_hash,
        "vocab_size": vocab_size,  # validation checks every id against it
        "run_name": s.run_name,
        "chunk": int(chunk),
        "prompts_sha256": prompts_sha256,  # hsextract.report.manifest: a shard older than its prompts file
    }


def extract_chunk(
    prompts: ChunkPrompts,
    shard_path: str | Path,
    engine: Engine,
    metadata: Mapping[str, Any],
    *,
    level: int = 3,
    threads: int = 1,
    precision: str = "bf16",
    progress: bool = True,
) -> dict[str, Any]:
    """Run `engine` over `prompts` and write one shard; returns a summary of the chunk."""
    from hsextract.shard import ShardWriter

    n_tensors = len(metadata["aux_layers"]) + 1
    hidden_size = int(metadata["hidden_size"])
    refs = list(zip(prompts.parents, prompts.prefix_lens, strict=True)) if prompts.parents is not None \
        and prompts.prefix_lens is not None else [(-1, 0)] * len(prompts)
    items = [Prompt(index=i, sample_id=s, input_ids=list(ids), parent=p, prefix_len=k)
             for i, (s, ids, (p, k)) in enumerate(zip(prompts.sample_ids, prompts.input_ids, refs, strict=True))]
    n_tokens = sum(len(p.input_ids) for p in items)
    start = time.perf_counter()
    bar = counter(n_tokens, desc=Path(shard_path).name, unit="tok", enabled=progress)
    written = 0
    # where the chunk's time went: waiting for the engine, or inside the shard writer (add blocks while
    # `threads` + 1 samples are still encoding or the file's writer thread is 256 MB behind; close writes
    # the last records, the index and the fsync)
    wait_s = add_s = close_s = 0.0
    computed = 0  # rows the engine computed (fewer than the tokens where samples took a prefix from a parent)
    lost = short = 0  # samples computed whole although they have a prefix (its cache gone), or from inside it
    share = any(p >= 0 for p, _ in refs)
    with ShardWriter(shard_path, metadata=dict(metadata), level=level, threads=threads, precision=precision,
                     share_prefixes=share) as writer:
        samples = iter(engine.extract(items))
        while True:
            t = time.perf_counter()
            captured = next(samples, None)
            wait_s += time.perf_counter() - t
            if captured is None:
                break
            if captured.index != written or captured.sample_id != prompts.sample_ids[written]:
                raise EngineError(
                    f"{shard_path}: engine returned sample {captured.sample_id!r} (index {captured.index}) "
                    f"where {prompts.sample_ids[written]!r} (index {written}) was due; engines must keep input order"
                )
            seq = len(prompts.input_ids[written])
            hs = captured.hidden_states
            row0 = captured.start  # the first row computed: > 0 where the sample took a prefix from its parent
            if not 0 <= row0 <= items[written].prefix_len:  # SGLang's cache hit may stop short of the prefix
                raise EngineError(f"{shard_path}: sample {captured.sample_id}: engine returned rows from position "
                                  f"{row0}, outside [0, its prefix length {items[written].prefix_len}]")
            if len(hs) != n_tensors or any(tuple(t.shape) != (seq - row0, hidden_size) for t in hs):
                shapes = [tuple(t.shape) for t in hs]
                raise EngineError(
                    f"{shard_path}: sample {captured.sample_id}: engine returned tensors {shapes}, expected "
                    f"{n_tensors} of ({seq - row0}, {hidden_size}); padding must be sliced off per sample"
                )
            t = time.perf_counter()
            writer.add(
                input_ids=torch.tensor(prompts.input_ids[written], dtype=torch.int64),
                hidden_states=hs,
                loss_mask=torch.tensor(prompts.loss_masks[written], dtype=torch.int64),
                sample_id=captured.sample_id,
                parent=items[written].parent if row0 else None,
                prefix_len=row0,
            )
            computed += seq - row0
            lost += row0 == 0 < items[written].prefix_len
            short += 0 < row0 < items[written].prefix_len  # SGLang's hit cut to its page size, or part evicted
            add_s += time.perf_counter() - t
            written += 1
            bar.update(seq)
        if written != len(items):
            raise EngineError(f"{shard_path}: engine returned {written} of {len(items)} samples")
        t = time.perf_counter()
        stored = writer.close()
        close_s = time.perf_counter() - t
    bar.close()
    seconds = time.perf_counter() - start
    planned = n_tokens - sum(p.prefix_len for p in items if p.parent >= 0)
    # the data is the same, the shard larger and the chunk slower than prepare and `hsextract plan` said; a few
    # positions recomputed per sample (a page's worth) are the engine's way, not worth a warning
    if lost or computed > 1.05 * planned:
        print(f"WARNING: {Path(shard_path).name}: of {sum(p.parent >= 0 for p in items)} samples that share a prefix, "
              f"{lost} were computed whole and {short} from inside their prefix ({computed:,} tokens computed and "
              f"stored where prepare planned {planned:,}): {engine.lost_prefixes()}", file=sys.stderr, flush=True)
    return {
        "shard": str(shard_path),
        "samples": written,
        "tokens": n_tokens,
        "trained_tokens": int(sum(sum(m) for m in prompts.loss_masks)),
        "computed_tokens": computed,
        "planned_computed_tokens": planned,  # prepare's: each shared prefix once
        "lost_prefixes": lost,
        "shortened_prefixes": short,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(n_tokens / seconds, 1) if seconds > 0 else None,
        # what `hsextract plan --tokens-per-s` takes: with shared prefixes, each prefix once
        "computed_tokens_per_s": round(computed / seconds, 1) if seconds > 0 else None,
        "bytes": stored.stored_bytes,
        "raw_bytes": stored.raw_bytes,
        "engine_wait_s": round(wait_s, 3),
        "shard_add_s": round(add_s, 3),
        "shard_close_s": round(close_s, 3),
        # of add + close: waiting for the encoder threads, and for the file's writer thread (a slow disk);
        # disk_s: the writer thread's time in write(), mostly hidden behind the run by the write-ahead
        "shard_encode_wait_s": stored.encode_wait_s,
        "shard_write_s": stored.write_s,
        "shard_disk_s": stored.disk_s,
    }


def shard_estimate(prompts: ChunkPrompts, hidden_size: int, n_tensors: int, precision: str,
                   dtype: str = "bfloat16") -> tuple[int, str]:
    """The bytes a chunk's shard will take, by `hsextract plan`'s arithmetic (hidden rows of the tokens the engine
    computes, ids and mask of every token, the codec's measured ratio), and how that was reckoned."""
    tokens = sum(len(ids) for ids in prompts.input_ids)
    computed = tokens
    if prompts.parents is not None and prompts.prefix_lens is not None:
        computed -= sum(k for p, k in zip(prompts.parents, prompts.prefix_lens, strict=True) if p >= 0)
    b = plan.shard_bytes(computed, tokens, n_tensors, hidden_size, dtype, precision)
    how = f"{computed:,} tokens computed x {b.raw_per_token:,} B raw x codec ratio {b.ratio}, as hsextract plan reckons"
    return b.stored, how


def check_free_space(shard_path: str | Path, need: int, how: str, chunk: int) -> None:
    """ShardError before any GPU time is spent when the shard's folder cannot hold the estimated shard."""
    folder = Path(shard_path).parent
    folder.mkdir(parents=True, exist_ok=True)
    remove_temps(shard_path)  # a killed attempt's partial shard is space this attempt gets back
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ShardError(
            f"{folder}: {free / 1e9:,.3f} GB free, but chunk {chunk}'s shard will take about {need / 1e9:,.3f} GB "
            f"({how}): free space there (or move results/ to a larger disk), or lower prompts_per_chunk; "
            "shard.check_free_space: false starts anyway (a full disk then fails the chunk alone, which reruns)")


def run_extract(
    settings: ExtractSettings,
    prompts_path: str | Path,
    shard_path: str | Path,
    chunk: int,
    prepare_summary: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The whole extract job: read the chunk, build the engine, write the shard."""
    prompts = read_prompts(prompts_path)
    template_hash = None
    if prepare_summary is not None:
        summary = json.loads(Path(prepare_summary).read_text(encoding="utf-8"))
        template_hash = summary.get("chat_template_sha256")
        check_written(prompts_path, prompts.sha256, chunk, summary, prepare_summary)
    spec = capture_spec(settings)
    shape = read_model_shape(settings.model)
    shard = settings.shard
    if shard.check_free_space:  # before the server starts (minutes for Kimi-K2.5) and hours of prefill
        need, how = shard_estimate(prompts, shape.hidden_size, len(spec.aux_layers) + 1, shard.precision,
                                   settings.activation_dtype)
        check_free_space(shard_path, need, how, chunk)
    with build_engine(settings, spec, chunk) as engine:
        meta = shard_metadata(settings, engine, shape.hidden_size, chunk, template_hash, shape.vocab_size,
                              shape.num_layers, shape.architecture, prompts.sha256)
        return extract_chunk(
            prompts, shard_path, engine, meta,
            level=shard.compression_level, threads=shard.threads, precision=shard.precision, progress=progress,
        )
