"""The page cache for the read benchmarks' cold passes: empty it (whole, where permitted) and ask what of
some files stayed. Standard library only, so bench/gpu/read_probe.py runs without the project's wheels."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def drop_method() -> str:
    """'drop_caches' if writing /proc/sys/vm/drop_caches works here, else 'fadvise'."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n", encoding="utf-8")
        return "drop_caches"
    except OSError:
        return "fadvise"


def evict(files: list[Path], method: str) -> None:
    """Drop `files` from the page cache: the whole cache ('drop_caches', root) or each file ('fadvise')."""
    if method == "drop_caches":
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n", encoding="utf-8")
        return
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(files: list[Path]) -> int | None:
    """Bytes of `files` in the page cache (util-linux fincore), or None without it."""
    if not shutil.which("fincore"):
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                         capture_output=True, text=True, check=False)
    return sum(int(x) for x in out.stdout.split()) if out.returncode == 0 else None
