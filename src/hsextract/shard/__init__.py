"""The shard format: writer, reader and their byte layout (docs/FORMAT.md)."""

from hsextract.shard.format import FORMAT_VERSION, SHARD_SUFFIX
from hsextract.shard.reader import ShardReader
from hsextract.shard.writer import REQUIRED_METADATA, ShardSummary, ShardWriter

__all__ = ["FORMAT_VERSION", "REQUIRED_METADATA", "SHARD_SUFFIX", "ShardReader", "ShardSummary", "ShardWriter"]
