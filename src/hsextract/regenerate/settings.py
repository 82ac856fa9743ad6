"""The `regenerate:` config section (RegenSettings, parse_settings) and the run-level keys regeneration reads."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from hsextract.errors import ConfigError

TOOL_TURNS = ("keep", "truncate")
ENGINES = ("transformers", "sglang")


@dataclass(frozen=True)
class RegenSettings:
    """The `regenerate:` config section (defaults here; documented in config/README.md)."""

    enabled: bool = False
    engine: str | None = None  # None: the run's `engine`
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 1024
    seed: int = 0
    batch_size: int = 8  # transformers: prompts per generate call; sglang: requests in flight
    tool_turns: str = "keep"
    complete_last_turn: bool = True
    drop_truncated: bool = False  # a turn that hit max_new_tokens cuts the conversation there
    stop_token_ids: tuple[int, ...] | None = None  # None: the template's end-of-turn token + eos
    think_start: str = "<think>"
    think_end: str = "</think>"
    # transformers engine
    device: str = "auto"  # auto: cuda if available
    dtype: str = "auto"  # auto: the checkpoint's dtype (float32 on the CPU)
    # sglang engine
    server_url: str | None = None
    request_timeout_s: float = 600.0
    retries: int = 3
    send_seed: bool = True  # send `sampling_seed` (SGLang versions without it reject the request)


def parse_settings(section: Any) -> RegenSettings:
    """Validate the `regenerate:` mapping; ConfigError names the key."""
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ConfigError("config key `regenerate` must be a mapping")
    allowed = {f.name for f in fields(RegenSettings)}
    unknown = set(section) - allowed
    if unknown:
        raise ConfigError(f"config key `regenerate` has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    s = dict(section)

    def num(key: str, lo: float, hi: float = math.inf, integer: bool = False) -> None:
        v = s.get(key, getattr(RegenSettings, key))
        ok = not isinstance(v, bool) and isinstance(v, int if integer else (int, float)) and lo <= v <= hi
        if not ok:
            raise ConfigError(f"config key `regenerate.{key}` must be {'an integer' if integer else 'a number'} in "
                              f"[{lo}, {hi}], got {v!r}")

    num("temperature", 0.0, 100.0)
    num("top_p", 1e-9, 1.0)
    num("top_k", 0, 2**31, integer=True)
    num("max_new_tokens", 1, 2**31, integer=True)
    num("seed", 0, 2**63 - 1, integer=True)
    num("batch_size", 1, 2**20, integer=True)
    num("request_timeout_s", 1e-3)
    num("retries", 0, 100, integer=True)
    for key in ("enabled", "complete_last_turn", "drop_truncated", "send_seed"):
        if key in s and not isinstance(s[key], bool):
            raise ConfigError(f"config key `regenerate.{key}` must be true or false, got {s[key]!r}")
    if s.get("engine") is not None and s["engine"] not in ENGINES:
        raise ConfigError(f"config key `regenerate.engine` is {s['engine']!r}; allowed: {', '.join(ENGINES)} or null")
    if s.get("tool_turns", "keep") not in TOOL_TURNS:
        raise ConfigError(f"config key `regenerate.tool_turns` is {s['tool_turns']!r}; allowed: keep, truncate")
    stops = s.get("stop_token_ids")
    if stops is not None:
        if not isinstance(stops, Sequence) or not stops or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stops):
            raise ConfigError(f"config key `regenerate.stop_token_ids` must be a non-empty list of token ids or "
                              f"null, got {stops!r}")
        s["stop_token_ids"] = tuple(stops)
    for key in ("think_start", "think_end"):
        if key in s and (not isinstance(s[key], str) or not s[key]):
            raise ConfigError(f"config key `regenerate.{key}` must be a non-empty string")
    return RegenSettings(**s)


def run_settings(config: Mapping[str, Any]) -> tuple[list[Any], int, int, bool]:
    """(sources, prompts_per_chunk, seed, strict) of the run, checked."""
    sources = config.get("sources")
    ppc = config.get("prompts_per_chunk")
    if isinstance(ppc, bool) or not isinstance(ppc, int) or ppc <= 0:
        raise ConfigError(f"config key `prompts_per_chunk` must be a positive integer, got {ppc!r}")
    seed = config.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"config key `seed` must be an integer, got {seed!r}")
    strict = config.get("strict", True)
    if not isinstance(strict, bool):
        raise ConfigError(f"config key `strict` must be true or false, got {strict!r}")
    return sources, ppc, seed, strict
