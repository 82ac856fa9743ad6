"""The API key of a local SGLang server: made by the launcher, kept in a file only this user can read.

How the key reaches the server. SGLang 0.5.16 takes it from its `--api-key` flag only (`ServerArgs.api_key`,
sglang/srt/server_args.py); no environment variable sets it (sglang/srt/environ.py has none) and it reads
nothing from standard input. A flag on the command line is readable by every local user (/proc/<pid>/cmdline,
`ps`), so the launcher uses SGLang's `--config FILE.yaml` instead (`prepare_server_args`: when "--config" is
in argv, `ConfigArgumentMerger.merge_config_with_args` reads the YAML file and turns its keys into flags
inside the process; sglang/srt/server_args_config_parser.py, sglang/srt/utils/ in 0.5.2x). The command line
then names the file, not the key; the file is mode 0600 in a 0700 directory (`private/` in the run's
server state directory), so only this user (and root) reads it: as private as a process environment, which
SGLang would not read the key from anyway.

The file stays while the server runs: a later extraction job reuses the server and reads the key from it
(its client sends `Authorization: Bearer <key>`). `stop_servers` removes it.

A configured key comes the same way, from a file: `sglang.api_key_file` names a file of the user's, mode 0600,
that holds the key alone (`read_key_file`); a config never holds the key itself (hsextract.config.redaction
says why: `snakemake --report` reads config files for the report, `--config` is a command line).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from pathlib import Path

from hsextract.atomic import write_bytes_atomic
from hsextract.errors import ConfigError, EngineError

KEY_DIR = "private"
FILE_KEY = "api-key"  # the key's name in SGLang's --config file (its flag without the dashes)
_MAX_BYTES = 4096
# a configured key: printable ASCII without spaces, quotes or backslash (it travels in an HTTP header and a YAML
# string), not starting with '-' (SGLang's argparse would read a flag), 16 to 1,000 characters: a short key is
# guessed, and the log filter, which hides the key's bytes wherever they appear, would garble the log
MIN_KEY_CHARS = 16
KEY_PATTERN = re.compile(r"[!#-&(-,.-\[\]-~][!#-&(-\[\]-~]{" + str(MIN_KEY_CHARS - 1) + ",999}")
_OPEN = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def key_path(state_dir: str | Path, replica: int) -> Path:
    """The key file of `replica` (absolute: the server opens it from its own working directory)."""
    return Path(state_dir).absolute() / KEY_DIR / f"replica-{replica}.yaml"


def new_key() -> str:
    """A fresh random key: 256 bits, hex (never starts with '-', which SGLang's argparse would take for a flag)."""
    return secrets.token_hex(32)


def private_dir(path: Path) -> Path:
    """`path` as a directory of this user's, mode 0700, not a symlink (made if missing)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise EngineError(f"{path} is not a directory of this user's (a symlink, or someone else's): the server's "
                          "API key cannot be kept there. Remove it; the launcher makes it again.")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def write_key(path: Path, key: str) -> None:
    """Write `key` to `path` (mode 0600) as SGLang's --config YAML: `api-key: "<key>"` (a JSON string is a
    YAML double-quoted scalar)."""
    private_dir(path.parent)
    write_bytes_atomic(path, f"{FILE_KEY}: {json.dumps(key)}\n".encode(), mode=0o600)


def read_key(path: Path) -> str | None:
    """The key in `path`; None when it is missing, not a regular file of this user's with mode 0600 or
    stricter, or not a key file."""
    try:
        fd = os.open(path, _OPEN)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        data = os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_BYTES:
        return None
    prefix = f"{FILE_KEY}: ".encode()
    if not data.startswith(prefix):
        return None
    try:
        key = json.loads(data[len(prefix):])
    except ValueError:
        return None
    return key if isinstance(key, str) and key else None


def remove_key(path: Path) -> None:
    path.unlink(missing_ok=True)


def read_key_file(path: str | os.PathLike[str], key: str = "sglang.api_key_file") -> str:
    """The key in the file config `sglang.api_key_file` names: a regular file of this user's, readable by its
    owner only, holding the key alone (surrounding whitespace, a final newline, ignored). ConfigError naming the
    config key (`key`) and what to do otherwise; no message holds the file's text."""
    fix = f"write the server's API key alone into it and run `chmod 600 {path}`"
    # a value that names no file is not quoted: it may be the key itself, written there by mistake
    unquoted = "(its value is not shown: a key written there by mistake would be)"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))  # FIFO: no wait
    except FileNotFoundError:
        raise ConfigError(f"{key}: names no existing file {unquoted}; give the path of a file of mode 0600 that "
                          "holds the server's API key alone") from None
    except OSError as e:
        raise ConfigError(f"{key}: cannot be read ({e.strerror}) {unquoted}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{key}: {path} is not a regular file; {fix}")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{key}: {path} belongs to another user (uid {st.st_uid}), who can read or change "
                              f"the key; {fix}")
        if st.st_mode & 0o077:
            raise ConfigError(f"{key}: {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users can read or "
                              f"change the key; run `chmod 600 {path}`")
        data = os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)
    text = data.decode("ascii", errors="replace").strip() if len(data) <= _MAX_BYTES else ""
    if not KEY_PATTERN.fullmatch(text):
        raise ConfigError(
            f"{key}: {path} does not hold one key: printable ASCII without spaces, quotes or backslash, not "
            f"starting with '-', {MIN_KEY_CHARS} to 1,000 characters (the file holds the key alone; a random one: "
            "python3 -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return text
