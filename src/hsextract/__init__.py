"""hsextract: EAGLE-3 hidden-state training data, stored in compressed, checksummed shards."""

from __future__ import annotations

__version__ = "0.1.0"
