"""One error family. Every message says what was wrong, where, and what to do."""

from __future__ import annotations


class HsxError(Exception):
    """Base class of every error hsextract raises on purpose."""


class ConfigError(HsxError):
    """A configuration key has a value that cannot work (names the key and what is allowed)."""


class ShardError(HsxError):
    """A shard cannot be written or read as asked (wrong path, wrong arguments, wrong version)."""


class CorruptShardError(ShardError):
    """A shard's bytes do not match their checksums or structure: never returns wrong data.

    `path` is the file, `sample` the sample index (or None for header, index and footer).
    """

    def __init__(self, path: object, sample: int | None = None, what: str | None = None) -> None:
        if what is None:  # its message alone: how torch re-raises a DataLoader worker's error in the main process
            super().__init__(str(path))
            self.path, self.sample, self.what = None, None, None
            return
        where = f"sample {sample}" if sample is not None else "shard structure"
        super().__init__(
            f"{path}: {where}: {what}. The shard is damaged: delete it and rerun its chunk "
            f"(snakemake reruns a missing shard)."
        )
        self.path = str(path)
        self.sample = sample
        self.what = what

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return type(self), (self.path, self.sample, self.what) if self.what is not None else self.args


class ValidationFailure(HsxError):
    """A shard or sample breaks a content or layout check."""


class EngineError(HsxError):
    """An engine (transformers forward, SGLang server) failed to produce a sample's hidden states."""
