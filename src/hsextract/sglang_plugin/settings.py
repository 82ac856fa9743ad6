"""The plugin's settings: the HSEXTRACT_* environment the server process is started with (see plugin.py's
docstring), parsed and checked. No torch, no SGLang: `sglang.server` builds that environment from these names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hsextract.capture import MAX_AUX_LAYERS
from hsextract.sglang_plugin.dumpcheck import DumpDirError, verify_dir

ENV_DUMP_DIR = "HSEXTRACT_DUMP_DIR"
# named for its convention: a plugin installed by an older hsextract (which read HSEXTRACT_AUX_LAYERS as
# layer outputs) finds nothing and refuses to start instead of capturing one layer deeper
ENV_AUX_LAYERS = "HSEXTRACT_AUX_HIDDEN_STATES"
# Diagnostic (bench/gpu/eagle3_ids.py): a drafter config's eagle_aux_hidden_state_layer_ids, given to the
# model's set_eagle3_layers_to_capture as SGLang's EAGLE-3 worker gives them; the layers it resolves are
# recorded in the marker and dumped, not checked, so that the bench compares SGLang's own choice.
ENV_EAGLE3_IDS = "HSEXTRACT_EAGLE3_IDS"
ENV_FINAL_STATE = "HSEXTRACT_FINAL_STATE"
ENV_STAGING_MB = "HSEXTRACT_STAGING_MB"
ENV_RID_PREFIX = "HSEXTRACT_RID_PREFIX"
ENV_WRITER_THREADS = "HSEXTRACT_WRITER_THREADS"
ENV_COPY_STREAM = "HSEXTRACT_COPY_STREAM"
# 1: the server runs with its radix cache on (share_prefixes, docs/SHARED_PREFIX.md): a request's rows may start
# at its prefix-cache hit, and its `.done` marker says where ("start"); unset or 0: every row from 0, as before
ENV_SHARED_PREFIX = "HSEXTRACT_SHARED_PREFIX"
DEFAULT_WRITER_THREADS = 4
# The plugin dumps only requests whose rid starts with this (default of HSEXTRACT_RID_PREFIX); the capture
# client names its rids with it, and any other request to the server (regenerate's) must not.
DEFAULT_RID_PREFIX = "hsx-"
FINAL_STATES = ("pre_norm", "post_norm", "both")  # both: the fidelity bench's diagnostic, not a config value


class PluginConfigError(RuntimeError):
    """The plugin's environment is wrong: the server refuses to start rather than dump wrong data."""


@dataclass(frozen=True)
class PluginConfig:
    dump_dir: Path
    aux_layers: tuple[int, ...]
    final_state: str = "pre_norm"
    staging_bytes: int = 4096 << 20
    rid_prefix: str = DEFAULT_RID_PREFIX
    writer_threads: int = DEFAULT_WRITER_THREADS
    copy_stream: bool = True
    eagle3_ids: tuple[int, ...] | None = None  # ENV_EAGLE3_IDS (diagnostic)
    shared_prefix: bool = False  # ENV_SHARED_PREFIX

    @property
    def expected_capture(self) -> list[int]:
        """SGLang capture indices ("before layer i"): the hidden_states ids themselves."""
        return list(self.aux_layers)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> PluginConfig | None:
        d = env.get(ENV_DUMP_DIR)
        if not d:
            return None
        dump_dir = Path(d)
        try:
            verify_dir(dump_dir)  # ours, 0700, not a symlink: nobody else can plant files where we write
        except DumpDirError as e:
            raise PluginConfigError(f"{ENV_DUMP_DIR}={d}: {e}") from None
        raw = env.get(ENV_AUX_LAYERS)
        if raw is None:
            raise PluginConfigError(f"{ENV_AUX_LAYERS} is not set: give the aux layer ids, e.g. 2,30,58 "
                                    "(an empty value captures the final state alone)")
        try:
            aux = tuple(int(x) for x in raw.replace(" ", "").split(",") if x)
        except ValueError as e:
            raise PluginConfigError(f"{ENV_AUX_LAYERS}={raw!r}: expected comma-separated integers") from e
        if any(a < 0 for a in aux) or len(set(aux)) != len(aux) or len(aux) > MAX_AUX_LAYERS:
            raise PluginConfigError(f"{ENV_AUX_LAYERS}={raw!r}: need 0 to {MAX_AUX_LAYERS} distinct non-negative "
                                    "layer ids, e.g. 2,30,58")
        final = env.get(ENV_FINAL_STATE, "pre_norm")
        if final not in FINAL_STATES:
            raise PluginConfigError(f"{ENV_FINAL_STATE}={final!r}: use pre_norm or post_norm (or both)")
        try:
            staging = int(env.get(ENV_STAGING_MB, "4096")) << 20
        except ValueError as e:
            raise PluginConfigError(f"{ENV_STAGING_MB} must be an integer number of MiB") from e
        raw_threads = env.get(ENV_WRITER_THREADS, str(DEFAULT_WRITER_THREADS))
        try:
            threads = int(raw_threads)
        except ValueError:
            threads = 0
        if threads < 1:
            raise PluginConfigError(
                f"{ENV_WRITER_THREADS}={raw_threads!r}: expected an integer >= 1 (config key writer_threads)"
            )
        copy_stream = env.get(ENV_COPY_STREAM, "1")
        if copy_stream not in ("0", "1"):
            raise PluginConfigError(f"{ENV_COPY_STREAM}={copy_stream!r}: expected 1 (side stream) or 0")
        raw_e3 = env.get(ENV_EAGLE3_IDS)
        try:
            eagle3 = None if raw_e3 is None else tuple(int(x) for x in raw_e3.replace(" ", "").split(",") if x)
        except ValueError as e:
            raise PluginConfigError(f"{ENV_EAGLE3_IDS}={raw_e3!r}: expected comma-separated integers") from e
        if eagle3 is not None and len(eagle3) != len(aux):
            raise PluginConfigError(f"{ENV_EAGLE3_IDS}={raw_e3!r}: one id per aux layer ({len(aux)})")
        shared = env.get(ENV_SHARED_PREFIX, "0")
        if shared not in ("0", "1"):
            raise PluginConfigError(f"{ENV_SHARED_PREFIX}={shared!r}: expected 1 (radix cache on, rows from each "
                                    "request's prefix-cache hit) or 0")
        return cls(dump_dir, aux, final, staging, env.get(ENV_RID_PREFIX, DEFAULT_RID_PREFIX), threads,
                   copy_stream == "1", eagle3, shared == "1")
