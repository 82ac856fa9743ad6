"""Regenerate one chunk from the workflow config: the generator the config asks for, the chunk's input records
(same sources, mixture order and chunking as `prepare`), the regenerator, the chunk files."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from hsextract.conversations import Conversation, MalformedRecordError, mixture, open_sources
from hsextract.engines.base import Generator
from hsextract.errors import ConfigError
from hsextract.regenerate.files import record, write_chunk
from hsextract.regenerate.regenerator import RegenStats, regenerate_chunk
from hsextract.regenerate.settings import ENGINES, RegenSettings, parse_settings, run_settings
from hsextract.regenerate.template import end_of_turn_ids


def make_generator(config: Mapping[str, Any], settings: RegenSettings, tokenizer: Any,
                   stop_ids: Sequence[int]) -> Generator:
    """The generator the config asks for: `regenerate.engine` or else the run's `engine`."""
    engine = settings.engine or config.get("engine", "transformers")
    if engine == "sglang":
        if not settings.server_url:
            raise ConfigError("config key `regenerate.server_url` must be set (http://host:port of the SGLang "
                              "server) when regeneration runs on the sglang engine")
        from hsextract.sglang.generate import SGLangGenerator

        return SGLangGenerator(settings.server_url, settings, stop_ids)
    if engine != "transformers":
        raise ConfigError(f"config key `engine` is {engine!r}; regeneration supports {', '.join(ENGINES)}")
    from transformers import AutoModelForCausalLM

    from hsextract.engines.transformers_generate import TransformersGenerator

    model_path = config.get("model")
    if not model_path:
        raise ConfigError("config key `model` must name a model directory for regeneration")
    device = settings.device if settings.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype: Any = "auto" if settings.dtype == "auto" else getattr(torch, settings.dtype, None)
    if dtype is None:
        raise ConfigError(f"config key `regenerate.dtype` is {settings.dtype!r}: not a torch dtype")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(device).eval()
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key `model`: cannot load {model_path} for regeneration: {e}") from e
    return TransformersGenerator(model, settings, stop_ids, pad_token_id=tokenizer.pad_token_id)


def num_chunks(config: Mapping[str, Any]) -> int:
    """Same count as prepare's: ceil(input records / prompts_per_chunk)."""
    from hsextract.conversations import count_records

    sources, ppc, _, _ = run_settings(config)
    return math.ceil(count_records(sources) / ppc)


def run_regenerate_chunk(config: Mapping[str, Any], chunk_index: int, out_path: str | os.PathLike[str], *,
                         tokenizer: Any = None, generator: Generator | None = None) -> dict[str, Any]:
    """Regenerate the input records of chunk `chunk_index` and write `out_path` (JSONL) and its stats JSON.

    `tokenizer` defaults to config `tokenizer` or `model` (with config `chat_template` applied); `generator`
    defaults to `make_generator`. Returns the stats dict."""
    from hsextract.tokenizer_loading import load_tokenizer

    settings = parse_settings(config.get("regenerate"))
    sources_cfg, ppc, seed, strict = run_settings(config)
    kwargs = config.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise ConfigError("config key `chat_template_kwargs` must be a mapping")
    sources = open_sources(sources_cfg)
    order = mixture(sources, seed)
    total = math.ceil(len(order) / ppc)
    if not 0 <= chunk_index < total:
        raise ConfigError(f"regenerate: chunk {chunk_index} does not exist: the sources hold {len(order)} records "
                          f"= {total} chunks of {ppc}")
    tok = load_tokenizer(tokenizer if tokenizer is not None else (config.get("tokenizer") or config.get("model")),
                         config.get("chat_template"), trust_remote_code=bool(config.get("trust_remote_code")))
    stop_ids = list(settings.stop_token_ids or end_of_turn_ids(tok, kwargs))
    settings = RegenSettings(**{**asdict(settings), "stop_token_ids": tuple(stop_ids)})
    gen = generator if generator is not None else make_generator(config, settings, tok, stop_ids)

    entries = order[chunk_index * ppc:(chunk_index + 1) * ppc]
    stats = RegenStats()
    convs: list[Conversation | None] = []
    bad: dict[int, str] = {}
    for k, entry in enumerate(entries):
        try:
            _, conv = sources[entry.source].read(entry.index)
        except MalformedRecordError as e:
            if strict:
                raise
            stats.malformed[e.reason] += 1
            bad[k] = e.reason
            conv = None
        convs.append(conv)
    regen = regenerate_chunk(convs, gen, settings, tokenizer=tok, chat_template_kwargs=kwargs,
                             sample_ids=[e.sample_id for e in entries], stats=stats)

    lines = []
    for k, (entry, conv) in enumerate(zip(entries, regen, strict=True)):
        name = sources[entry.source].spec.name
        if conv is None:
            rec = {"id": entry.sample_id, "source": name, "messages": [], "malformed": bad[k]}
        else:
            rec = record(entry.sample_id, name, conv)
        lines.append(json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n")
    summary = {"chunk": chunk_index, "records": len(entries), **stats.as_dict(),
               "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()
                            if k != "enabled"} | {"seed_mixture": seed}}
    write_chunk(out_path, lines, summary)
    return summary
