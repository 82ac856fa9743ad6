"""Atomic file writes for the whole package; the implementation and its guarantee are in
`hsextract.sglang_plugin.atomic` (there because the SGLang server process imports only the plugin tree)."""

from hsextract.sglang_plugin.atomic import (
    atomic_file,
    commit,
    create_temp,
    fsync_dir,
    remove_temps,
    write_atomic,
    write_bytes_atomic,
    write_json_atomic,
)

__all__ = ["atomic_file", "commit", "create_temp", "fsync_dir", "remove_temps", "write_atomic", "write_bytes_atomic",
           "write_json_atomic"]
