"""hsextract: EAGLE-3 hidden-state training data, stored in compressed, checksummed shards."""

from __future__ import annotations

__version__ = "0.1.0"


def open_dataset(path):  # noqa: ANN001, ANN201 - re-exported lazily: importing torch is slow
    """Every shard of a run (or a list of shards) as one map-style torch Dataset."""
    from hsextract.dataset import open_dataset as _open

    return _open(path)
