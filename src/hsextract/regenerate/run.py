"""Regenerate one chunk of a run: the generator the settings ask for, the chunk's input records (same sources,
mixture order and chunking as `prepare`, hsextract.config.chunks), the regenerator, the chunk files."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

import torch

from hsextract.config import chunks
from hsextract.config.checks import check_regenerate_server
from hsextract.config.settings import RegenerateSettings, Settings
from hsextract.engines.base import Generator
from hsextract.errors import ConfigError
from hsextract.prepare.conversations import (
    Conversation,
    MalformedRecordError,
    conversation_hash,
    mixture,
    open_sources,
)
from hsextract.regenerate.files import record, stats_path, write_chunk
from hsextract.regenerate.regenerator import Regenerator, RegenStats
from hsextract.regenerate.template import end_of_turn_ids


def make_generator(settings: Settings, regen: RegenerateSettings, tokenizer: Any,
                   stop_ids: Sequence[int]) -> Generator:
    """The generator `regen` asks for: `regenerate.engine`, or else the run's `engine`, loading `settings.extract.model`
    (transformers) or talking to `regenerate.server_url` (sglang)."""
    if (regen.engine or settings.extract.engine) == "sglang":
        check_regenerate_server("sglang", regen.server_url)
        assert regen.server_url is not None
        from hsextract.sglang.generate import SGLangGenerator
        from hsextract.sglang.keyfile import read_key_file

        key = read_key_file(regen.api_key_file, "regenerate.api_key_file") if regen.api_key_file else None
        return SGLangGenerator(regen.server_url, regen, stop_ids, api_key=key)
    from hsextract.engines.transformers_engine import resolve_device
    from hsextract.engines.transformers_generate import TransformersGenerator
    from hsextract.extract.text_model import load_causal_lm

    device = resolve_device(regen.device)
    dtype: Any = "auto" if regen.dtype == "auto" else getattr(torch, regen.dtype)  # the schema's enum: torch dtypes
    try:
        model = load_causal_lm(settings.extract.model, dtype).to(device).eval()  # a wrapper's (Kimi-K2.5's) text model
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key `model`: cannot load {settings.extract.model} for regeneration: {e}") from e
    return TransformersGenerator(model, regen, stop_ids, pad_token_id=tokenizer.pad_token_id)


def run_regenerate_chunk(settings: Settings, chunk_index: int, out_path: str | os.PathLike[str], *,
                         tokenizer: Any = None, generator: Generator | None = None) -> dict[str, Any]:
    """Regenerate the input records of chunk `chunk_index` and write `out_path` (JSONL) and its stats JSON.

    `tokenizer` defaults to the run's tokenizer directory (`tokenizer`, else `model`) with `chat_template`
    applied; `generator` defaults to `make_generator`. Returns the stats dict."""
    from hsextract.prepare.tokenizer_loading import load_tokenizer

    prep = settings.prepare
    ppc = prep.prompts_per_chunk
    kwargs = dict(prep.chat_template_kwargs)
    sources = open_sources(prep.sources)
    order = mixture(sources, prep.seed)
    total = chunks.count(len(order), ppc)
    if not 0 <= chunk_index < total:
        raise ConfigError(f"regenerate: chunk {chunk_index} does not exist: the sources hold {len(order)} records "
                          f"= {total} chunks of {ppc}")
    tok = load_tokenizer(tokenizer if tokenizer is not None else settings.extract.tokenizer_dir, prep.chat_template,
                         trust_remote_code=settings.extract.trust_remote_code)
    regen = settings.regenerate
    if regen.stop_token_ids is None:
        regen = replace(regen, stop_token_ids=tuple(end_of_turn_ids(tok, kwargs, settings.extract.model)))
    stop_ids = list(regen.stop_token_ids or ())
    unknown = [t for t in stop_ids if not 0 <= t < len(tok)]
    if unknown:  # never generated: the turns would run to max_new_tokens
        raise ConfigError(f"regenerate.stop_token_ids: {unknown} {'is' if len(unknown) == 1 else 'are'} not in the "
                          f"tokenizer's vocabulary (ids 0..{len(tok) - 1}), so no generation would stop there; give "
                          f"the ids of the tokens that end a turn (or leave the key out: the template's are found)")
    gen = generator if generator is not None else make_generator(settings, regen, tok, stop_ids)

    entries = [order[k] for k in chunks.records(chunk_index, ppc, len(order))]
    stats = RegenStats()
    convs: list[Conversation | None] = []
    locations: list[str] = []
    bad: dict[int, str] = {}
    for k, entry in enumerate(entries):
        try:
            location, conv = sources[entry.source].read(entry.index)
        except MalformedRecordError as e:
            if prep.strict:
                raise
            stats.malformed[e.reason] += 1
            bad[k] = e.reason
            location, conv = e.location, None
        convs.append(conv)
        locations.append(location)
    regenerator = Regenerator(tok, gen, regen, kwargs, max_context=prep.max_seq_len)
    out = regenerator.regenerate(convs, [e.sample_id for e in entries], stats, strict=prep.strict,
                                 locations=locations)
    bad |= regenerator.refusals

    lines = []
    for k, (entry, conv) in enumerate(zip(entries, out, strict=True)):
        name = sources[entry.source].spec.name
        if conv is None:
            rec = {"id": entry.sample_id, "source": name, "messages": [], "malformed": bad[k]}
        else:
            inp = convs[k]
            assert inp is not None
            rec = record(entry.sample_id, name, conv) | {"input_sha256": conversation_hash(inp)}
        # key order as rendered: a template's tojson keeps it (tool declarations, tool-call arguments), so sorted
        # keys would give prepare a context other than the one the target answered
        lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
    summary = {"chunk": chunk_index, "records": len(entries), **stats.as_dict(),
               "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(regen).items()
                            if k != "enabled"} | {"seed_mixture": prep.seed}}
    write_chunk(out_path, lines, summary)
    for what, n in (("turns reached max_new_tokens (kept unless drop_truncated; those inside their reasoning cut)",
                     stats.turns_hit_max_new_tokens),
                    ("turns whose rendering trains other ids than the generated ones (roundtrip text)",
                     stats.roundtrip["text"]),
                    ("turns no message renders back to the generated ids (roundtrip none)", stats.roundtrip["none"])):
        if n:
            print(f"WARNING: regenerate chunk {chunk_index}: {n} {what}; {stats_path(out_path)}", file=sys.stderr,
                  flush=True)
    return summary
