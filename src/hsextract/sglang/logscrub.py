"""Copy a local server's output into its log with its API key hidden.

    python -m hsextract.sglang.logscrub KEYFILE      # stdin: the server's stdout+stderr; stdout: the log

SGLang prints its settings at start-up, the key among them (0.5.16: `server_args=ServerArgs(...,
api_key='...', ...)`, sglang/srt/entrypoints/engine.py; 0.5.23 prints the resolved dict, api_key included).
So the launcher does not hand the server the log file: the server writes into a pipe, and this process,
in the server's process group, copies the pipe to the log with every occurrence of the key (read from
KEYFILE, hsextract.sglang.keyfile) replaced. A key split across two reads is caught: the bytes at the
end of a read that could begin the key wait for the next read.

It ignores SIGTERM, SIGINT and SIGHUP and ends at end of input, when the server and its children are gone,
so their last lines (a traceback at start-up) reach the log; a stop that has to SIGKILL the group ends it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

from hsextract.config.redaction import REDACTED
from hsextract.sglang.keyfile import read_key

_READ = 1 << 16


def _held(buf: bytes, secrets: Sequence[bytes]) -> int:
    """Length of the longest end of `buf` that is a proper beginning of a secret (0 when none)."""
    longest = max((len(s) for s in secrets), default=0)
    for k in range(min(len(buf), longest - 1), 0, -1):
        tail = buf[-k:]
        if any(s.startswith(tail) for s in secrets):
            return k
    return 0


def copy_scrubbed(chunks: Iterable[bytes], out: BinaryIO, secrets: Sequence[bytes]) -> None:
    """Copy `chunks` (reads of a pipe) to `out`, each secret replaced by REDACTED; flushed after each chunk."""
    secrets = sorted((s for s in secrets if s), key=len, reverse=True)
    red = REDACTED.encode()
    pending = b""
    for chunk in chunks:
        buf = pending + chunk
        for s in secrets:
            buf = buf.replace(s, red)
        keep = _held(buf, secrets)
        out.write(buf[: len(buf) - keep])
        out.flush()
        pending = buf[len(buf) - keep :]
    out.write(pending)
    out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m hsextract.sglang.logscrub KEYFILE", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    key = read_key(Path(args[0]))
    if key is None:
        sys.stdout.buffer.write(f"hsextract: no API key in {args[0]}; the server's output is copied as is\n".encode())
    fd = sys.stdin.fileno()
    copy_scrubbed(iter(lambda: os.read(fd, _READ), b""), sys.stdout.buffer, [key.encode()] if key else [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
