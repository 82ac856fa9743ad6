"""Atomic small-file writes: a temporary name in the same directory, then os.replace."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call write(f) on a temp file next to `path`, fsync, and rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, obj: Any) -> None:
    data = (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode()
    write_atomic(path, lambda f: f.write(data))
