"""The file that marks a folder as a tiny model hsextract built: what its builder may replace, and nothing else."""

from __future__ import annotations

import os
from pathlib import Path

MARKER = "hsextract_tiny.json"


def foreign_contents(path: str | os.PathLike[str]) -> str | None:
    """Why building the tiny model at `path` would destroy something not built as one (a user's model put under
    resources/, a file), or None: nothing there, an empty folder, or a folder holding MARKER."""
    p = Path(path)
    if not os.path.lexists(p):
        return None
    if p.is_symlink() or not p.is_dir():
        return "path is not a folder of its own (a file or a link)"
    if (p / MARKER).is_file() or not any(p.iterdir()):
        return None
    return (f"folder holds files and no {MARKER}, so it is not a tiny model hsextract built (one of an hsextract "
            f"release before that file: delete the folder)")


__all__ = ["MARKER", "foreign_contents"]
