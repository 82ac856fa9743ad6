"""hsextract: EAGLE-3 hidden-state training data, stored in compressed, checksummed shards."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hsextract.dataset import HiddenStateDataset

__version__ = "0.1.0"


def open_dataset(path: Any, **kwargs: Any) -> HiddenStateDataset:
    """Every shard of a run (as its dataset.json lists them) or a list of shards, as one map-style torch
    Dataset; see hsextract.dataset.open_dataset. Imported lazily: importing torch is slow."""
    from hsextract.dataset import open_dataset as _open

    return _open(path, **kwargs)
