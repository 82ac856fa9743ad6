"""Secrets in the config and on command lines: the one list of them, and how every writer hides them.

`SECRET_KEYS` are the config keys whose values are secrets. Whatever writes or prints the config or a
server command goes through this module: dataset.json's `provenance.config` and the config hash
(`redact_config`), schema errors (`redact_text` over `secret_values`), patched.json's `launch`, the
server's state file and start-up errors (`redact_command`), the server's log (`hsextract.sglang.logscrub`,
which replaces the key's bytes wherever the server prints them).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

REDACTED = "<redacted>"
# dotted config keys whose values are secrets
SECRET_KEYS: tuple[str, ...] = ("sglang.api_key",)
# SGLang server flags whose value is a secret (the launcher never passes them; a command read from
# elsewhere is shown with their values hidden)
SECRET_FLAGS: tuple[str, ...] = ("--api-key", "--admin-api-key", "--ssl-keyfile-password")


def _lookup(config: Mapping[str, Any], dotted: str) -> tuple[Mapping[str, Any] | None, str]:
    """(the mapping that holds the last part of `dotted`, that part); (None, part) when a level is missing."""
    *parents, last = dotted.split(".")
    node: Any = config
    for part in parents:
        node = node.get(part) if isinstance(node, Mapping) else None
    return (node if isinstance(node, Mapping) else None), last


def secret_values(config: Mapping[str, Any]) -> list[str]:
    """The values of SECRET_KEYS that `config` sets, as text and as quoted text shows them (Python's repr,
    JSON: a message that quotes the value escapes a newline or a quote), longest first."""
    out = set()
    for key in SECRET_KEYS:
        node, last = _lookup(config, key)
        value = node.get(last) if node is not None else None
        if value is not None and str(value):
            text = str(value)
            out |= {text, repr(text)[1:-1], json.dumps(text)[1:-1]}
    return sorted(out, key=len, reverse=True)


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `config` with every secret that is set replaced by REDACTED (null stays null: whether a
    key was configured is not a secret)."""
    out = copy.deepcopy(dict(config))
    for key in SECRET_KEYS:
        node, last = _lookup(out, key)
        if node is not None and node.get(last) is not None:
            node[last] = REDACTED  # type: ignore[index] - a copy's dict
    return out


def redact_command(cmd: Sequence[str]) -> list[str]:
    """`cmd` with the value of every SECRET_FLAGS flag hidden (`--flag VALUE` and `--flag=VALUE`)."""
    out: list[str] = []
    hide_next = False
    for arg in cmd:
        name = arg.split("=", 1)[0]
        if hide_next:
            out.append(REDACTED)
        elif name in SECRET_FLAGS and "=" in arg:
            out.append(f"{name}={REDACTED}")
        else:
            out.append(arg)
        hide_next = not hide_next and arg in SECRET_FLAGS
    return out


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of each secret replaced by REDACTED."""
    for s in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(s, REDACTED)
    return text
