"""The hsextract SGLang plugin: dumps every prefill's hidden states per request into a private directory.

Entry point `hsextract = hsextract.sglang_plugin.plugin:register` (group `sglang.srt.plugins`);
enable it with `SGLANG_PLUGINS=hsextract`. Inactive unless `HSEXTRACT_DUMP_DIR` names a directory.

Environment (set by `hsextract.sglang.server`):
    HSEXTRACT_DUMP_DIR      private dump directory (must exist)
    HSEXTRACT_AUX_LAYERS    EAGLE-3 aux layer ids, e.g. "2,30,58" (output of decoder layer i)
    HSEXTRACT_FINAL_STATE   post_norm (the only state SGLang hands out without patching the model)
    HSEXTRACT_STAGING_MB    pinned staging buffer per scheduler process (default 4096)
    HSEXTRACT_WRITER_THREADS threads writing piece files, per scheduler process (default 4; a rid's
                            pieces and marker always go to one thread, in order)
    HSEXTRACT_RID_PREFIX    only requests whose rid starts with it are dumped (default "hsx-"); this
                            skips SGLang's own warmup (random hex rid) and health checks (HEALTH_CHECK_*)
    HSEXTRACT_COPY_STREAM   1 (default): device-to-host copies on a side stream, beside the next forward;
                            0: on the forward's stream (saves one device copy of each batch's rows)

Capture source:
  * `builtin`: the server runs with `--enable-return-aux-hidden-states` (SGLang >= 0.5.2x):
    logits_output.hidden_states holds the packed aux layers [T, K*H], last_hidden_states the
    post-norm final state [T, H].
  * `plugin` (SGLang 0.5.16, or a newer one without that flag): after model load the plugin calls the
    model's `set_dflash_layers_to_capture(aux)` (always +1; falls back to `set_eagle3_layers_to_capture`),
    forces CaptureHiddenMode.FULL on EXTEND batches, and appends the post-norm final state to the stored
    aux tensor in LogitsProcessor._get_hidden_states_to_store -> [T, (K+1)*H]. Launch with
    `--enable-return-hidden-states` so prefill CUDA graphs are captured in FULL mode.
Either way the resolved `layers_to_capture` must equal [i+1 for i in aux]; otherwise the server refuses
to start (DeepSeek's set_eagle3 takes ids raw unless the first is 1).

Hooks: AROUND TpModelWorker.forward_batch_generation (outside the CUDA graphs), AFTER
ModelRunner.load_model (set up capture), AFTER ModelRunner.init_attention_backends (verify, allocate the
staging buffer, before graph capture), AROUND LogitsProcessor._get_hidden_states_to_store (plugin mode only).

Repeats: a Req whose whole prompt was staged is marked (attribute on the Req object), so a retraction
re-run of that same request is skipped; a NEW request that reuses a completed rid is dumped again (the
writer counts it as `rids_reused`). Dropping reused rids made the client wait for markers that never came.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsextract.sglang_plugin import dumpfiles
from hsextract.sglang_plugin.slicing import slice_extend_batch
from hsextract.sglang_plugin.staging import StagingRing
from hsextract.sglang_plugin.writer import DumpWriter

log = logging.getLogger("hsextract.sglang_plugin")

PLUGIN_VERSION = "1"
WRITER_SWITCH_INTERVAL_S = 0.0005
TARGET_FORWARD = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
TARGET_LOAD_MODEL = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
TARGET_INIT_BACKENDS = "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends"
TARGET_STORE = "sglang.srt.layers.logits_processor.LogitsProcessor._get_hidden_states_to_store"

ENV_DUMP_DIR = "HSEXTRACT_DUMP_DIR"
ENV_AUX_LAYERS = "HSEXTRACT_AUX_LAYERS"
ENV_FINAL_STATE = "HSEXTRACT_FINAL_STATE"
ENV_STAGING_MB = "HSEXTRACT_STAGING_MB"
ENV_RID_PREFIX = "HSEXTRACT_RID_PREFIX"
ENV_WRITER_THREADS = "HSEXTRACT_WRITER_THREADS"
ENV_COPY_STREAM = "HSEXTRACT_COPY_STREAM"
DEFAULT_WRITER_THREADS = 4
DEFAULT_RID_PREFIX = "hsx-"
_DUMPED_ATTR = "_hsextract_dumped"  # set on a Req once its whole prompt was staged


class PluginConfigError(RuntimeError):
    """The plugin's environment is wrong: the server refuses to start rather than dump wrong data."""


@dataclass(frozen=True)
class PluginConfig:
    dump_dir: Path
    aux_layers: tuple[int, ...]
    final_state: str = "post_norm"
    staging_bytes: int = 4096 << 20
    rid_prefix: str = DEFAULT_RID_PREFIX
    writer_threads: int = DEFAULT_WRITER_THREADS
    copy_stream: bool = True

    @property
    def expected_capture(self) -> list[int]:
        """SGLang capture indices: aux id i (output of layer i) is the input of layer i+1."""
        return [i + 1 for i in self.aux_layers]

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "PluginConfig | None":
        d = env.get(ENV_DUMP_DIR)
        if not d:
            return None
        dump_dir = Path(d)
        if not dump_dir.is_dir():
            raise PluginConfigError(f"{ENV_DUMP_DIR}={d} is not a directory; create it (mode 0700) first")
        raw = env.get(ENV_AUX_LAYERS, "")
        try:
            aux = tuple(int(x) for x in raw.replace(" ", "").split(",") if x)
        except ValueError as e:
            raise PluginConfigError(f"{ENV_AUX_LAYERS}={raw!r}: expected comma-separated integers") from e
        if not aux or any(a < 0 for a in aux) or len(set(aux)) != len(aux):
            raise PluginConfigError(f"{ENV_AUX_LAYERS}={raw!r}: need distinct non-negative layer ids, e.g. 2,30,58")
        final = env.get(ENV_FINAL_STATE, "post_norm")
        if final != "post_norm":
            raise PluginConfigError(
                f"{ENV_FINAL_STATE}={final!r}: the SGLang path hands out the final state after the final "
                "norm only; use final_state: post_norm (or the transformers engine for pre_norm)"
            )
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
        return cls(dump_dir, aux, final, staging, env.get(ENV_RID_PREFIX, DEFAULT_RID_PREFIX), threads,
                   copy_stream == "1")


class Dumper:
    """Everything per scheduler process: slicing, staging, writing. Duck-typed on SGLang's objects."""

    def __init__(self, cfg: PluginConfig, *, pin: bool | None = None, write_delay_s: float = 0.0) -> None:
        self.cfg = cfg
        self.mode: str | None = None  # "builtin" | "plugin", decided at model load
        self.hidden_size: int | None = None
        self._pin = pin
        self._delay = write_delay_s
        self._writer: DumpWriter | None = None
        self._is_writer_rank: bool | None = None
        self.duplicates_skipped = 0  # retraction re-runs of already dumped requests (stats file)

    @property
    def writer(self) -> DumpWriter:
        if self._writer is None:
            self._writer = DumpWriter(
                self.cfg.dump_dir, StagingRing(self.cfg.staging_bytes, pin=self._pin),
                threads=self.cfg.writer_threads, write_delay_s=self._delay, copy_stream=self.cfg.copy_stream,
                extra_stats=lambda: {"duplicates_skipped": self.duplicates_skipped},
            )
        return self._writer

    def accept(self, rid: str) -> bool:
        return rid.startswith(self.cfg.rid_prefix) and dumpfiles.is_safe_rid(rid)

    def is_writer_rank(self) -> bool:
        """Only attention-TP rank 0 of each DP group writes: its rows are the same on every TP rank."""
        if self._is_writer_rank is None:
            self._is_writer_rank = _attn_tp_rank() == 0
        return self._is_writer_rank

    def start(self) -> DumpWriter:
        """Allocate the staging buffer and start the writer now (at server start-up, writer rank only).

        Lazily, an 8 GiB pinned allocation would stall the first batch, and a failing one would leave
        the requests of that batch without any marker (the client would wait for its timeout)."""
        if self._writer is None:
            t0 = time.monotonic()
            try:
                self.writer
            except (RuntimeError, MemoryError) as e:
                raise PluginConfigError(
                    f"hsextract: cannot allocate {self.cfg.staging_bytes >> 20} MiB of "
                    f"{'pinned ' if self._pin is not False else ''}staging memory ({type(e).__name__}: {e}); "
                    f"lower {ENV_STAGING_MB} (config key staging_mb)"
                ) from e
            # SGLang's scheduler loop runs Python without pause and holds the GIL; a writer thread back
            # from a write (which releases it) waits up to the switch interval to go on. At the default
            # 5 ms the writers lagged the forward by 0.2-0.4 s per request and ~1 GB/s in all on the H200
            # (bench/plugin_writer_gil.py reproduces it on a CPU).
            sys.setswitchinterval(min(sys.getswitchinterval(), WRITER_SWITCH_INTERVAL_S))
            log.info("hsextract: staging buffer of %d MiB (pinned %s) allocated in %.2f s; %d writer threads, "
                     "GIL switch interval %.1f ms", self.cfg.staging_bytes >> 20, self._writer.ring.buf.is_pinned(),
                     time.monotonic() - t0, self.cfg.writer_threads, sys.getswitchinterval() * 1e3)
        return self._writer

    def _already_dumped(self, req: Any) -> bool:
        """A request object whose whole prompt was already staged: a retraction re-run, not new data.

        Tracked on the request object, not by rid: a client may legitimately send a rid again after it
        collected the first dump (a new request), and that one must be dumped again."""
        if getattr(req, _DUMPED_ATTR, False):
            self.duplicates_skipped += 1
            return True
        return False

    def on_extend(self, batch: Any, logits_output: Any) -> None:
        """Dump the accepted requests of one EXTEND batch; problems become `.err` markers, never crashes."""
        hs = getattr(logits_output, "hidden_states", None) if logits_output is not None else None
        last = getattr(logits_output, "last_hidden_states", None) if logits_output is not None else None
        rows = hs.shape[0] if hs is not None else sum(int(e) for e in batch.extend_lens)
        pieces = slice_extend_batch(
            batch.reqs, batch.prefix_lens, batch.extend_lens, rows, self.accept, skip=self._already_dumped
        )
        if not pieces:
            return
        by_rid = {r.rid: r for r in batch.reqs if isinstance(getattr(r, "rid", None), str)}
        for p in pieces:  # marked before staging: a failed dump is not retried by a re-run either
            if p.end == p.n_tokens:
                try:
                    setattr(by_rid[p.rid], _DUMPED_ATTR, True)
                except (AttributeError, KeyError):
                    pass
        writer = self.start()
        try:
            sources = self._sources(hs, last, logits_output)
            writer.submit(pieces, sources)
        except Exception as e:
            log.exception("hsextract: cannot dump batch of %d pieces", len(pieces))
            writer.fail(sorted({(p.rid, p.n_tokens) for p in pieces}), f"{type(e).__name__}: {e}")

    def _sources(self, hs: Any, last: Any, lo: Any) -> list[torch.Tensor]:
        k = len(self.cfg.aux_layers)
        if hs is None:
            raise RuntimeError("the batch carries no captured hidden states (capture mode not FULL?)")
        if getattr(lo, "hidden_states_token_indices", None) is not None:
            raise RuntimeError("only a subset of rows was captured (hidden_states_token_indices set)")
        if last is not None:
            h = last.shape[1]
            if hs.shape[1] != k * h or last.shape[0] != hs.shape[0]:
                raise RuntimeError(f"aux tensor {tuple(hs.shape)} is not {k} layers of the final state's {h}")
            sources = [hs, last]
        else:
            if hs.shape[1] % (k + 1):
                raise RuntimeError(
                    f"captured width {hs.shape[1]} is not {k}+1 tensors (final state not appended?)"
                )
            h = hs.shape[1] // (k + 1)
            sources = [hs]
        if self.hidden_size is not None and h != self.hidden_size:
            raise RuntimeError(f"captured hidden size {h}, model hidden size {self.hidden_size}")
        # One block per tensor (column views; staging makes each contiguous): the client then uses a
        # one-piece dump's blocks as they are, instead of copying columns out of [T, (K+1)*H] rows.
        return [src[:, j : j + h] for src in sources for j in range(0, src.shape[1], h)]

    # ---- capture set-up ---------------------------------------------------------------------------
    def setup_model(self, model: Any, server_args: Any) -> None:
        """After load_model: choose the capture source and, in plugin mode, set the capture layers."""
        self.mode = "builtin" if getattr(server_args, "enable_return_aux_hidden_states", False) else "plugin"
        cfg_obj = getattr(model, "config", None)
        hs = getattr(cfg_obj, "hidden_size", None) or getattr(getattr(cfg_obj, "text_config", None), "hidden_size", None)
        self.hidden_size = int(hs) if hs else None
        if self.mode == "plugin":
            setter = getattr(model, "set_dflash_layers_to_capture", None) or getattr(
                model, "set_eagle3_layers_to_capture", None
            )
            if setter is None:
                raise PluginConfigError(
                    f"hsextract: {type(model).__name__} has neither set_dflash_layers_to_capture nor "
                    "set_eagle3_layers_to_capture; this model cannot capture aux hidden states in SGLang"
                )
            setter(list(self.cfg.aux_layers))
        log.info("hsextract: capture source %s for %s", self.mode, type(model).__name__)

    def verify_model(self, model: Any) -> list[int]:
        """Before graph capture: the resolved capture layers must be aux+1, else refuse to run."""
        resolved = find_layers_to_capture(model)
        expected = self.cfg.expected_capture
        log.info(
            "hsextract: aux_layers %s -> resolved layers_to_capture %s (expected %s, capture source %s)",
            list(self.cfg.aux_layers), resolved, expected, self.mode,
        )
        if resolved != expected:
            hint = (
                " With --enable-return-aux-hidden-states pass --speculative-algorithm DFLASH "
                f"--return-aux-hidden-state-layer-ids {' '.join(map(str, self.cfg.aux_layers))} (always +1); "
                "EAGLE3 takes DeepSeek ids raw unless the first is 1."
                if self.mode == "builtin"
                else ""
            )
            raise PluginConfigError(
                f"hsextract: {type(model).__name__} captures layers {resolved}, but aux_layers "
                f"{list(self.cfg.aux_layers)} need {expected} (SGLang index = layer id + 1). Refusing to "
                f"dump the wrong layers.{hint}"
            )
        return resolved

    def write_marker(self, resolved: list[int]) -> Path:
        """`plugin-<pid>.json` in the dump dir: the client's proof that this server dumps, and with what."""
        try:
            sgl = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            sgl = None
        info = {
            "plugin_version": PLUGIN_VERSION,
            "sglang_version": sgl,
            "capture": self.mode,
            "aux_layers": list(self.cfg.aux_layers),
            "layers_to_capture": resolved,
            "final_state": self.cfg.final_state,
            "hidden_size": self.hidden_size,
            "pid": os.getpid(),
            "writer_rank": self.is_writer_rank(),
        }
        path = self.cfg.dump_dir / f"{dumpfiles.PLUGIN_MARKER_PREFIX}{os.getpid()}.json"
        tmp = path.with_name("." + path.name + ".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, path)
        return path


def find_layers_to_capture(model: Any) -> list[int] | None:
    """The `layers_to_capture` list of the model's decoder (model.model, or deeper for wrappers)."""
    inner = getattr(model, "model", None)
    if inner is not None and isinstance(getattr(inner, "layers_to_capture", None), list):
        return list(inner.layers_to_capture)
    modules = model.modules() if hasattr(model, "modules") else []
    for m in modules:
        v = getattr(m, "layers_to_capture", None)
        if isinstance(v, list) and v:
            return list(v)
    return None


def _attn_tp_rank() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_rank)
    except Exception:  # older layouts
        try:
            from sglang.srt.layers.dp_attention import get_attention_tp_rank

            return int(get_attention_tp_rank())
        except Exception:
            log.warning("hsextract: cannot read the attention-TP rank; assuming a single rank")
            return 0


# ---- SGLang hooks ---------------------------------------------------------------------------------
_DUMPER: Dumper | None = None


def _after_load_model(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    if _DUMPER is None or getattr(runner, "is_draft_worker", False):
        return None
    _DUMPER.setup_model(runner.model, runner.server_args)
    return None


def _after_init_attention_backends(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    if _DUMPER is None or getattr(runner, "is_draft_worker", False):
        return None
    resolved = _DUMPER.verify_model(runner.model)
    if _DUMPER.mode == "plugin":  # the final state comes from the store hook: it must be in place
        from sglang.srt.layers.logits_processor import LogitsProcessor

        if not hasattr(LogitsProcessor._get_hidden_states_to_store, "__wrapped__"):
            raise PluginConfigError(
                f"hsextract: the hook on {TARGET_STORE} is not applied (see the log above); "
                "the final state cannot be captured with this SGLang"
            )
    if _DUMPER.is_writer_rank():
        _DUMPER.start()  # allocate the staging buffer now: fail at start-up, not on the first batch
    _DUMPER.write_marker(resolved)
    return None


def _around_forward(original: Any, worker: Any, batch: Any = None, *args: Any, **kwargs: Any) -> Any:
    d = _DUMPER
    extend = (
        d is not None
        and batch is not None
        and not kwargs.get("is_verify", False)
        and batch.forward_mode is not None
        and batch.forward_mode.is_extend()
    )
    if extend and d.mode == "plugin" and kwargs.get("capture_hidden_mode") is None:
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        kwargs["capture_hidden_mode"] = CaptureHiddenMode.FULL
    result = original(worker, batch, *args, **kwargs)
    if extend and d.is_writer_rank():
        try:
            d.on_extend(batch, getattr(result, "logits_output", None))
        except Exception:  # a dump problem must not take the server down
            log.exception("hsextract: dump hook failed")
    return result


_STORE_SIG: inspect.Signature | None = None


def _around_store(original: Any, *args: Any, **kwargs: Any) -> Any:
    out = original(*args, **kwargs)
    if _DUMPER is None or _DUMPER.mode != "plugin" or out is None:
        return out
    global _STORE_SIG
    if _STORE_SIG is None:
        _STORE_SIG = inspect.signature(original)
    a = _STORE_SIG.bind(*args, **kwargs).arguments
    aux, before, meta = a.get("aux_hidden_states"), a.get("hidden_states_before_norm"), a.get("logits_metadata")
    if aux is None or before is not None or meta is None or not meta.capture_hidden_mode.is_full():
        return out
    return torch.cat([out, a["hidden_states"]], dim=-1)


def register() -> None:
    """Entry point: register the hooks when HSEXTRACT_DUMP_DIR is set; otherwise do nothing."""
    global _DUMPER
    cfg = PluginConfig.from_env()
    if cfg is None:
        log.info("hsextract plugin inactive (%s not set)", ENV_DUMP_DIR)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _DUMPER = Dumper(cfg)
    HookRegistry.register(TARGET_LOAD_MODEL, _after_load_model, HookType.AFTER)
    HookRegistry.register(TARGET_INIT_BACKENDS, _after_init_attention_backends, HookType.AFTER)
    HookRegistry.register(TARGET_STORE, _around_store, HookType.AROUND)
    HookRegistry.register(TARGET_FORWARD, _around_forward, HookType.AROUND)
    log.info("hsextract plugin active: dump dir %s, aux layers %s", cfg.dump_dir, list(cfg.aux_layers))
