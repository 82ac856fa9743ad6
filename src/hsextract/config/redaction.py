"""Secrets: the config keys no config may hold, the server flags whose values are hidden, and how.

A config never holds a secret (`refuse_secret_keys`). `snakemake --report` reads the text of every config
file for the report (snakemake/report/__init__.py, 9.27: `ConfigfileRecord` reads each of
`workflow.configfiles` as it is on disk and hands it to the report plugin; the HTML reporter of 9.27 does not
render it, a later one or another plugin may), with no hook to hide a value; `--config` puts a value on a
command line, which every local user reads and cluster job scripts repeat; and Snakemake hands the config to
every job and report caption (`snakemake.config`). So the one secret, the SGLang server's API key, lives
in a file of mode 0600 that the config names (`sglang.api_key_file`, read by
`hsextract.sglang.keyfile.read_key_file`), and what the project writes from the config (dataset.json, the
config hash, schema errors, report.html) has no secret to hide. What carries the key after that is hidden
here: patched.json's `launch`, the server's state file and start-up errors (`redact_command`, `redact_text`),
the server's log (`hsextract.sglang.logscrub`, which replaces the key's bytes wherever the server prints them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hsextract.errors import ConfigError

REDACTED = "<redacted>"
# dotted config keys that would hold a secret: refused in any config, each with the key that names a file
# holding it instead
SECRET_KEYS: dict[str, str] = {"sglang.api_key": "sglang.api_key_file"}
# SGLang server flags whose value is a secret (the launcher never passes them; a command read from
# elsewhere is shown with their values hidden)
SECRET_FLAGS: tuple[str, ...] = ("--api-key", "--admin-api-key", "--ssl-keyfile-password")
# SGLang flags that begin another flag's name but are their own (an exact name wins in argparse)
OWN_FLAGS = frozenset({"--ssl-keyfile"})
# config keys whose values a schema error does not quote: a key mistakenly put there would be shown
UNQUOTED_KEYS: tuple[str, ...] = ("sglang.launch_args", "sglang.api_key_file", "sglang.server_url", "sglang.servers",
                                   "regenerate.api_key_file", "regenerate.server_url")
_ABSENT = object()


def flag_meant(arg: str, flags: Iterable[str]) -> str | None:
    """The flag of `flags` that `arg` (`--name` or `--name=value`) names as SGLang's parser might read it, or close
    to it: the flag, any beginning of it argparse expands (`--hos` for `--host`), either with underscores
    (`--api_key`, which the parser refuses, so the failed start's command would show the value); None for a
    value, another flag, or one of OWN_FLAGS."""
    name = arg.split("=", 1)[0].replace("_", "-")
    if not arg.startswith("--") or len(name) < 3 or name in OWN_FLAGS:
        return None
    return next((f for f in flags if f == name), None) or next((f for f in flags if f.startswith(name)), None)


def is_secret_flag(arg: str) -> bool:
    """`arg` names a SECRET_FLAGS flag (flag_meant; `--a`, a beginning of many flags, is none)."""
    return len(arg.split("=", 1)[0]) > 3 and flag_meant(arg, SECRET_FLAGS) is not None


# config keys holding server URLs: none may carry credentials (http://user:KEY@host), which dataset.json would record
URL_KEYS: tuple[str, ...] = ("sglang.server_url", "sglang.servers", "regenerate.server_url")


def _at(config: Mapping[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = node.get(part, _ABSENT) if isinstance(node, Mapping) else _ABSENT
    return node


def refuse_secret_keys(config: Mapping[str, Any]) -> None:
    """ConfigError when `config` sets any of SECRET_KEYS (even to null: the key is gone), before anything
    (a schema error, a hash, a writer) could show its value; the message never holds the value."""
    for key in URL_KEYS:
        urls = _at(config, key)
        for k, url in enumerate(urls if isinstance(urls, list) else [urls]):
            if isinstance(url, str) and "@" in url.split("://", 1)[-1].split("/", 1)[0]:
                where = f"{key}[{k}]" if isinstance(urls, list) else key
                raise ConfigError(f"{where}: the URL holds credentials (user:password@), which dataset.json and the "
                                  "logs would record; give the server's address alone, and its key in a file "
                                  "(sglang.api_key_file, regenerate.api_key_file)")
    for key, file_key in SECRET_KEYS.items():
        if _at(config, key) is not _ABSENT:
            raise ConfigError(
                f"{key}: a config may not hold the key: `snakemake --report` reads every config file's text "
                "for the report, and `--config` puts it on the command line. Write the key alone into a file "
                f"only you can read (chmod 600 FILE) and set {file_key}: FILE, or set neither: each server the "
                "workflow starts gets a random key"
            )


def redact_command(cmd: Sequence[str]) -> list[str]:
    """`cmd` with the value of every SECRET_FLAGS flag hidden (`--flag VALUE` and `--flag=VALUE`), however
    spelled (is_secret_flag)."""
    out: list[str] = []
    hide_next = False
    for arg in cmd:
        secret = is_secret_flag(arg)
        if hide_next:
            out.append(REDACTED)
        elif secret and "=" in arg:
            out.append(f"{arg.split('=', 1)[0]}={REDACTED}")
        else:
            out.append(arg)
        hide_next = not hide_next and secret and "=" not in arg
    return out


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of each secret replaced by REDACTED."""
    for s in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(s, REDACTED)
    return text
