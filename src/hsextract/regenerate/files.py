"""Chunk files of regeneration: chunk-NNNNN.jsonl with its .stats.json, written atomically (stats first), and
their concatenation into the conversation file `prepare` reads."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hsextract.atomic import write_atomic, write_json_atomic
from hsextract.config import chunks
from hsextract.errors import ConfigError
from hsextract.prepare.conversations import Conversation, as_openai


def chunk_name(chunk: int) -> str:
    return chunks.name(chunk, ".jsonl")


def stats_path(out_path: str | os.PathLike[str]) -> Path:
    p = Path(out_path)
    return p.with_name(p.name.removesuffix(".jsonl") + ".stats.json")


def record(sample_id: str, source: str, conv: Conversation) -> dict[str, Any]:
    msgs = [as_openai(m) | ({"weight": 0} if i in conv.untrained else {}) for i, m in enumerate(conv.messages)]
    rec: dict[str, Any] = {"id": sample_id, "source": source, "messages": msgs}
    if conv.tools:
        rec["tools"] = conv.tools
    return rec


def write_chunk(out_path: str | os.PathLike[str], lines: Sequence[str], summary: dict[str, Any]) -> None:
    """The chunk's stats JSON, then its JSONL: the JSONL (what Snakemake tracks) exists only once both are
    written."""
    out = Path(out_path)
    write_json_atomic(stats_path(out), summary, indent=2, sort_keys=True)
    write_atomic(out, lambda f: f.writelines(line.encode() for line in lines))


def records_written(stats: Path) -> int | None:
    """The records a chunk's stats say its file holds (one line each); None without a readable count."""
    try:
        n = json.loads(stats.read_text(encoding="utf-8")).get("records")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def concat_chunks(chunk_paths: Sequence[str | os.PathLike[str]], out_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Join chunk JSONL files (in the given order) into one conversation file; also sums their stats into
    `<out>.stats.json` when every chunk has one. Returns the summed stats."""
    out = Path(out_path)
    paths = [Path(p) for p in chunk_paths]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ConfigError(f"regenerate: chunk files missing: {missing[:5]} (rerun their chunks)")

    def write(f: Any) -> None:
        for p in paths:
            with open(p, "rb") as src:
                data = src.read()
            if data and not data.endswith(b"\n"):
                raise ConfigError(f"{p}: the chunk file does not end with a newline: truncated? delete it and "
                                  f"rerun its chunk")
            written, lines = records_written(stats_path(p)), data.count(b"\n")
            if written is not None and lines != written:  # a whole line lost or added: no other sign of it
                raise ConfigError(f"{p}: {lines} lines, but its {stats_path(p).name} records {written} "
                                  f"(one line per input record): the file was edited or damaged since. Delete it "
                                  f"and rerun its chunk")
            f.write(data)

    write_atomic(out, write)
    summed: dict[str, Any] = {"chunks": len(paths)}
    uncounted = False
    for p in paths:
        sp = stats_path(p)
        if not sp.is_file():
            uncounted = True
            continue
        st = json.loads(sp.read_text(encoding="utf-8"))
        summed.setdefault("settings", st.get("settings"))
        for k, v in st.items():
            if k in ("chunk", "settings"):
                continue
            if isinstance(v, dict):
                acc = summed.setdefault(k, {})
                for kk, vv in v.items():
                    acc[kk] = acc.get(kk, 0) + vv
            elif isinstance(v, int):
                summed[k] = summed.get(k, 0) + v
    if uncounted:  # the records of the chunks without stats are unknown: no total that prepare could check
        summed.pop("records", None)
    write_json_atomic(stats_path(out), summed, indent=2, sort_keys=True)
    return summed
