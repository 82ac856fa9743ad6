"""Checks that make reading a workflow config safe before anything walks it or opens what it names.

- `check_bounded`: a YAML config may hold aliases (`&a` / `*a`). PyYAML builds them as shared objects, so
  loading a "billion laughs" file is cheap; anything that walks the config as a tree (jsonschema, its error
  messages, json.dumps for the config hash) expands them, exponentially. Snakemake's own `validate` does:
  on an alias bomb under an unknown key its ValidationError prints the whole config (tests/README.md has
  the figures). So the Snakefile calls this first: it counts the config's values as a tree would, and
  stops at MAX_CONFIG_VALUES without expanding anything.
- `check_remote`: a non-loopback `sglang.host` needs `sglang.api_key_file` or an explicit `allow_remote`.
- `check_source_path`: a source must be a regular file or a dataset folder; a FIFO would block the record
  count at parse time forever, a device (/dev/zero) would be read without end, and any other folder is
  refused by name before a reader fails on it.
"""

from __future__ import annotations

import ipaddress
import math
import os
import stat
import sys
from collections.abc import Mapping
from typing import Any

from hsextract.errors import ConfigError

MAX_CONFIG_VALUES = 100_000  # the bundled configs hold a few hundred
MAX_CONFIG_DEPTH = 64


def check_bounded(config: Any, limit: int = MAX_CONFIG_VALUES, max_depth: int = MAX_CONFIG_DEPTH) -> int:
    """The number of values in `config` counted as a tree (aliases counted at every use); ConfigError as soon
    as it passes `limit` or nesting passes `max_depth`, or at a NaN or infinite number. Walks at most `limit`
    values: never expands."""
    count = 0
    stack: list[tuple[Any, str, int]] = [(config, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        count += 1
        if count > limit:
            raise ConfigError(
                f"config: more than {limit} values when aliases are expanded (near {where or 'the top'}); "
                "a YAML alias (*name) repeated inside repeated aliases grows without bound. Write the values out."
            )
        if depth > max_depth:
            raise ConfigError(f"config: {where}: nested more than {max_depth} levels deep")
        if isinstance(value, float) and not math.isfinite(value):  # the schema's bounds let NaN through
            raise ConfigError(f"{where or 'config'}: {value} is not a finite number (YAML reads .nan and .inf as "
                              "numbers); give a number")
        if isinstance(value, Mapping):
            stack.extend((v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    return count


# what makes a folder a source: `datasets.save_to_disk` of a Dataset, or of a DatasetDict
DATASET_FOLDER_FILES = ("state.json", "dataset_dict.json")


def resolved_from(path: str | os.PathLike[str]) -> str:
    """" (relative to the working directory ...)" for a relative path, else "": said where a path is not found, for a
    command run from another folder (`snakemake -d DIR` resolves a config's paths against DIR)."""
    return "" if os.path.isabs(path) else f" (relative to the working directory {os.getcwd()})"


def check_source_path(key: str, path: str | os.PathLike[str]) -> None:
    """`path` exists and is a regular file or a `save_to_disk` folder (symlinks followed); else ConfigError
    naming `key`."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"{key}: {path} does not exist{resolved_from(path)}") from None
    except OSError as e:
        raise ConfigError(f"{key}: {path} cannot be read ({e.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
        raise ConfigError(f"{key}: {path} is {kind}; a source must be a regular file or a dataset folder")
    if stat.S_ISDIR(mode) and not any(os.path.isfile(os.path.join(path, n)) for n in DATASET_FOLDER_FILES):
        raise ConfigError(f"{key}: {path} is a folder but not a `datasets.save_to_disk` dataset (it has no "
                          f"{' or '.join(DATASET_FOLDER_FILES)}); name a .jsonl, .json, .parquet or .arrow file, "
                          "or such a dataset folder")


def is_small_regular(path: str | os.PathLike[str], max_bytes: int) -> bool:
    """Whether `path` (symlinks followed) is a regular file of at most `max_bytes`: one a parse-time check may read
    whole without blocking on a FIFO or reading a device (/dev/zero) without end."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size <= max_bytes


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def check_remote(config: Mapping[str, Any]) -> None:
    """A local SGLang server bound to a non-loopback `sglang.host` needs `sglang.api_key_file`, or an explicit
    `sglang.allow_remote: true` (then a warning on stderr)."""
    sg = config.get("sglang") or {}
    if config.get("engine") != "sglang" or not isinstance(sg, Mapping):
        return
    host = str(sg.get("host", "127.0.0.1"))
    if ":" in host:  # the launcher's port probe and the client's http://host:port are IPv4 (or a name's)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"sglang.host: {host} holds a ':': give the interface alone (127.0.0.1, say) and the "
                              "port as sglang.port") from None
        raise ConfigError(f"sglang.host: {host} is an IPv6 address, which the launcher does not serve: use 127.0.0.1 "
                          "(loopback), an IPv4 address or a host name")
    if is_loopback(host) or sg.get("api_key_file"):
        return
    if sg.get("allow_remote") is True:
        print(f"hsextract: warning: sglang.host {host} is not a loopback address and sglang.api_key_file is not set: "
              "anyone who can reach the port can try the server; it requires the random key the launcher makes "
              "(sglang.allow_remote: true)", file=sys.stderr)
        return
    raise ConfigError(
        f"sglang.host: {host} is not a loopback address: the server would accept requests from the network. "
        "Set sglang.api_key_file (the servers require its key and every client sends it), or sglang.allow_remote: true "
        "to listen there with the random key each server gets (only this user can read it, in "
        "results/<run_name>/server/hosts/<host>/private/), or use 127.0.0.1."
    )
