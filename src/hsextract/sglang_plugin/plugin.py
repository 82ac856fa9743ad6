"""The hsextract SGLang plugin: dumps every prefill's hidden states per request into a private directory.

Entry point `hsextract = hsextract.sglang_plugin.plugin:register` (group `sglang.srt.plugins`);
enable it with `SGLANG_PLUGINS=hsextract`. Inactive unless `HSEXTRACT_DUMP_DIR` names a directory.

Environment (set by `hsextract.sglang.server`):
    HSEXTRACT_DUMP_DIR      private dump directory (must exist)
    HSEXTRACT_AUX_HIDDEN_STATES aux layers as hidden_states ids, e.g. "2,30,58" (id i = the input of decoder
                            layer i = SGLang's capture index i); 0 to 8 of them,
                            "" (set but empty) for the final state alone (capture: mtp; plugin capture only)
    HSEXTRACT_FINAL_STATE   pre_norm (the last decoder layer's output) or post_norm (after the final norm);
                            both (pre then post, of the same forward: the fidelity benchmark's diagnostic)
    HSEXTRACT_STAGING_MB    pinned staging buffer per scheduler process (default 4096)
    HSEXTRACT_WRITER_THREADS threads writing piece files, per scheduler process (default 4; a rid's
                            pieces and marker always go to one thread, in order)
    HSEXTRACT_RID_PREFIX    only requests whose rid starts with it are dumped (default "hsx-"); this
                            skips SGLang's own warmup (random hex rid) and health checks (HEALTH_CHECK_*)
    HSEXTRACT_COPY_STREAM   1 (default): device-to-host copies on a side stream, beside the next forward;
                            0: on the forward's stream (saves one device copy of each batch's rows)
    HSEXTRACT_SHARED_PREFIX 1: the server runs with its radix cache on (share_prefixes): a request's rows start
                            at its prefix-cache hit m (SGLang's extend prefix length), recorded as "start" in its
                            `.done` marker; unset or 0: a chain that does not start at 0 is an error
    HSEXTRACT_EAGLE3_IDS    diagnostic (bench/gpu/eagle3_ids.py): set the capture with the model's own
                            set_eagle3_layers_to_capture(ids), as SGLang's EAGLE-3 worker does for a drafter
                            config's ids, and dump what it resolves without checking it

Capture source:
  * `builtin`: the server runs with `--enable-return-aux-hidden-states` (SGLang >= 0.5.2x):
    logits_output.hidden_states holds the packed aux layers [T, K*H], last_hidden_states the
    post-norm final state [T, H].
  * `plugin` (SGLang 0.5.16, or a newer one without that flag): after model load the plugin calls the
    model's `set_dflash_layers_to_capture([i - 1 for i in aux])` (always +1; falls back to
    `set_eagle3_layers_to_capture` with the ids hsextract.layers.sglang_eagle3_ids gives for the class),
    forces CaptureHiddenMode.FULL on EXTEND batches, and appends the post-norm final state to the stored
    aux tensor in LogitsProcessor._get_hidden_states_to_store -> [T, (K+1)*H]. Launch with
    `--enable-return-hidden-states` so prefill CUDA graphs are captured in FULL mode.
Either way the resolved `layers_to_capture` must equal aux; otherwise the server refuses to start
(DeepSeek's set_eagle3 takes ids raw unless the first is 1).

Pre-norm final state: the layer-capture list never reaches past the last layer (capture index i is the
input of layer i), and the model returns the normed state. A forward pre-hook on the decoder's final norm
(`<decoder>.norm`, the module that also holds `layers_to_capture`) takes the norm's inputs: hidden states
and residual, which a fused add-RMSNorm adds (in place) itself, so pre-norm = hidden + residual (+ the
optional post_residual_addition, added to the residual first as SGLang does), rounded to the model dtype
once as the fused kernel rounds the residual it writes; hidden states alone when the residual is None
(DeepSeek after a gather). The hook keeps that tensor for the logits processor of the SAME forward, which
stores it instead of the post-norm state: plugin mode appends it in _get_hidden_states_to_store (or stores
it alone, capture: mtp), builtin mode returns it from _get_last_hidden_states_to_store. Both calls run
inside the model's forward, so a graph that takes in the logits processor records the add and the copy and
replays them (a Python-side stash read after the forward would hold a capture-time tensor). SGLang 0.5.16's
prefill graphs do not (read in prefill_cuda_graph_runner.py): they capture the decoder body alone, replay it
in place of its forward (its pre-hook, which clears the tap, still runs; the norm's does not) and run the
logits processor eagerly after it, so the tap is empty and every request of the batch would get an `.err`
marker; the launcher refuses prefill graphs with a pre-norm state (server.check_prefill_graph).

Hooks: AROUND TpModelWorker.forward_batch_generation (outside the CUDA graphs), AFTER
ModelRunner.load_model (set up capture), AFTER ModelRunner.init_attention_backends (verify, allocate the
staging buffer, before graph capture), AROUND LogitsProcessor._get_hidden_states_to_store (plugin mode only).

Length: this module holds every hook and the per-forward state they share (the pre-hook's stash, the capture
mode, the staged Reqs); staging, slicing, writing and settings live in their own modules.

Repeats: a Req whose whole prompt was staged is marked (attribute on the Req object), so a retraction
re-run of that same request is skipped; a NEW request that reuses a completed rid is dumped again (the
writer counts it as `rids_reused`). Dropping reused rids made the client wait for markers that never came.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hsextract.atomic import write_json_atomic
from hsextract.layers import HIDDEN_STATES, sglang_eagle3_ids, to_layer_output
from hsextract.sglang_plugin import dumpfiles
from hsextract.sglang_plugin.settings import (  # noqa: F401 - re-exported: the plugin's public names
    DEFAULT_RID_PREFIX,
    DEFAULT_WRITER_THREADS,
    ENV_AUX_LAYERS,
    ENV_COPY_STREAM,
    ENV_DUMP_DIR,
    ENV_EAGLE3_IDS,
    ENV_FINAL_STATE,
    ENV_RID_PREFIX,
    ENV_SHARED_PREFIX,
    ENV_STAGING_MB,
    ENV_WRITER_THREADS,
    FINAL_STATES,
    MAX_AUX_LAYERS,
    PluginConfig,
    PluginConfigError,
)
from hsextract.sglang_plugin.slicing import slice_extend_batch
from hsextract.sglang_plugin.staging import StagingRing
from hsextract.sglang_plugin.writer import DumpWriter

log = logging.getLogger("hsextract.sglang_plugin")

PLUGIN_VERSION = "2"  # 2: aux ids are hidden_states ids (HSEXTRACT_AUX_HIDDEN_STATES)
WRITER_SWITCH_INTERVAL_S = 0.0005
TARGET_FORWARD = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
TARGET_LOAD_MODEL = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
TARGET_INIT_BACKENDS = "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends"
TARGET_STORE = "sglang.srt.layers.logits_processor.LogitsProcessor._get_hidden_states_to_store"
TARGET_LAST_STORE = "sglang.srt.layers.logits_processor.LogitsProcessor._get_last_hidden_states_to_store"

_DUMPED_ATTR = "_hsextract_dumped"  # set on a Req once its whole prompt was staged


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
        self.tap: PreNormTap | None = PreNormTap() if cfg.final_state != "post_norm" else None
        self.n_final = 2 if cfg.final_state == "both" else 1
        self.norm_module: str | None = None  # class of the hooked final norm (marker file)

    @property
    def writer(self) -> DumpWriter:
        if self._writer is None:
            self._writer = DumpWriter(
                self.cfg.dump_dir, StagingRing(self.cfg.staging_bytes, pin=self._pin),
                threads=self.cfg.writer_threads, write_delay_s=self._delay, copy_stream=self.cfg.copy_stream,
                shared_prefix=self.cfg.shared_prefix,
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
                _ = self.writer  # the property builds the ring and the writer threads
            except (RuntimeError, MemoryError) as e:
                raise PluginConfigError(
                    f"hsextract: cannot allocate {self.cfg.staging_bytes >> 20} MiB of "
                    f"{'pinned ' if self._pin is not False else ''}staging memory ({type(e).__name__}: {e}); "
                    f"lower {ENV_STAGING_MB} (config key staging_mb)"
                ) from e
            # SGLang's scheduler loop runs Python without pause and holds the GIL; a writer thread back
            # from a write (which releases it) waits up to the switch interval to go on, and a piece takes
            # several such hand-overs: at CPython's default 5 ms the writers fall behind the forward.
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
        k = len(self.cfg.aux_layers) + self.n_final - 1  # tensors before the last one
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
            h = self.hidden_size or hs.shape[1] // (k + 1)
            if hs.shape[1] != (k + 1) * h:
                raise RuntimeError(
                    f"captured width {hs.shape[1]} is not {k}+1 tensors of hidden size {h} (final state not "
                    "appended: no pre-norm state in this forward?)"
                )
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
        text_cfg = getattr(cfg_obj, "text_config", None)
        hs = getattr(cfg_obj, "hidden_size", None) or getattr(text_cfg, "hidden_size", None)
        self.hidden_size = int(hs) if hs else None
        if self.mode == "builtin" and self.n_final == 2:
            raise PluginConfigError("hsextract: final_state both needs the plugin capture source (sglang.capture: "
                                    "plugin)")
        if self.mode == "builtin" and not self.cfg.aux_layers:
            raise PluginConfigError("hsextract: the final state alone (no aux layers, capture: mtp) needs the "
                                    "plugin capture source (sglang.capture: plugin), not "
                                    "--enable-return-aux-hidden-states")
        if self.mode == "plugin" and self.cfg.aux_layers:  # none: FULL mode stores the final state by itself
            aux = list(self.cfg.aux_layers)
            if self.cfg.eagle3_ids is not None:  # diagnostic: as SGLang's EAGLE-3 worker sets up its target
                model.set_eagle3_layers_to_capture(list(self.cfg.eagle3_ids))
            elif hasattr(model, "set_dflash_layers_to_capture"):  # DFlash names layers by their output: +1
                model.set_dflash_layers_to_capture(to_layer_output(aux))
            elif hasattr(model, "set_eagle3_layers_to_capture"):
                ids = sglang_eagle3_ids(aux, type(model).__name__)
                if ids is None:
                    raise PluginConfigError(
                        f"hsextract: {type(model).__name__}.set_eagle3_layers_to_capture cannot capture "
                        f"hidden_states {aux} (and it has no set_dflash_layers_to_capture)")
                model.set_eagle3_layers_to_capture(ids)
            else:
                raise PluginConfigError(
                    f"hsextract: {type(model).__name__} has neither set_dflash_layers_to_capture nor "
                    "set_eagle3_layers_to_capture; this model cannot capture aux hidden states in SGLang"
                )
        if self.tap is not None:
            if self.mode == "builtin":  # the method exists from SGLang 0.5.2x on, as the builtin flag does
                _install_hook(TARGET_LAST_STORE, _around_last_store)
            norm = final_norm_module(model)
            norm.register_forward_pre_hook(self.tap.hook, with_kwargs=True)
            find_decoder(model).register_forward_pre_hook(self.tap.clear)  # a forward that skips the norm: None
            self.norm_module = type(norm).__name__
        log.info("hsextract: capture source %s for %s, final state %s%s", self.mode, type(model).__name__,
                 self.cfg.final_state, f" (pre-hook on {self.norm_module})" if self.norm_module else "")

    def verify_model(self, model: Any) -> list[int]:
        """Before graph capture: the resolved capture layers must be aux+1, else refuse to run."""
        resolved = find_layers_to_capture(model)
        expected = self.cfg.expected_capture
        log.info(
            "hsextract: aux_layers %s -> resolved layers_to_capture %s (expected %s, capture source %s)",
            list(self.cfg.aux_layers), resolved, expected, self.mode,
        )
        if self.cfg.eagle3_ids is not None:  # diagnostic: dump what SGLang chose, for the bench to compare
            log.warning("hsextract: %s=%s resolved to layers_to_capture %s (not checked: diagnostic)",
                        ENV_EAGLE3_IDS, list(self.cfg.eagle3_ids), resolved)
            return resolved
        if resolved != expected:
            hint = (
                " With --enable-return-aux-hidden-states pass --speculative-algorithm DFLASH "
                f"--return-aux-hidden-state-layer-ids {' '.join(str(i - 1) for i in self.cfg.aux_layers)} "
                "(always +1); "
                "EAGLE3 takes DeepSeek ids raw unless the first is 1."
                if self.mode == "builtin"
                else ""
            )
            raise PluginConfigError(
                f"hsextract: {type(model).__name__} captures layers {resolved}, but aux_layers "
                f"(hidden_states ids) {list(self.cfg.aux_layers)} need {expected} (SGLang's index = the "
                f"hidden_states id). Refusing to "
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
            "layer_convention": HIDDEN_STATES,
            "layers_to_capture": resolved,
            "eagle3_ids": None if self.cfg.eagle3_ids is None else list(self.cfg.eagle3_ids),
            "final_state": self.cfg.final_state,
            "shared_prefix": self.cfg.shared_prefix,  # radix cache on: rows from each request's cache hit
            "final_norm_module": self.norm_module,
            "hidden_size": self.hidden_size,
            "pid": os.getpid(),
            "writer_rank": self.is_writer_rank(),
        }
        path = self.cfg.dump_dir / f"{dumpfiles.PLUGIN_MARKER_PREFIX}{os.getpid()}.json"
        write_json_atomic(path, info, indent=None, durable=False)
        return path


# Where a decoder sits: a causal LM's `.model`; a multimodal wrapper's text model's `.model` (SGLang's
# KimiK25ForConditionalGeneration: `.language_model`, a DeepseekV3ForCausalLM, which its `.model` aliases).
DECODER_PATHS = (("model",), ("language_model", "model"), ("model", "model"))


def find_decoder(model: Any) -> Any | None:
    """The model's decoder: the module holding `layers_to_capture` beside its `.layers` and final `.norm`, at
    one of DECODER_PATHS, else the first module of the tree with a non-empty list (or an empty one)."""
    for path in DECODER_PATHS:
        inner = model
        for name in path:
            inner = getattr(inner, name, None)
        if inner is not None and isinstance(getattr(inner, "layers_to_capture", None), list):
            return inner
    found = None
    for m in model.modules() if hasattr(model, "modules") else []:
        v = getattr(m, "layers_to_capture", None)
        if isinstance(v, list):
            if v:
                return m
            found = found or m
    return found


def find_layers_to_capture(model: Any) -> list[int] | None:
    """The `layers_to_capture` list of the model's decoder."""
    dec = find_decoder(model)
    return None if dec is None else list(dec.layers_to_capture)


def final_norm_module(model: Any) -> torch.nn.Module:
    """The decoder's final norm (`<decoder>.norm`), whose inputs make the pre-norm state."""
    dec = find_decoder(model)
    norm = getattr(dec, "norm", None) if dec is not None else None
    if not isinstance(norm, torch.nn.Module) or type(norm).__name__ == "PPMissingLayer":
        raise PluginConfigError(
            f"hsextract: {type(model).__name__} has no final norm module (`<decoder>.norm` beside "
            "layers_to_capture; pipeline parallelism keeps it on the last stage only), so final_state: pre_norm "
            "cannot be captured; use final_state: post_norm"
        )
    return norm


class PreNormTap:
    """Forward pre-hook on the final norm: its input sum, kept for the logits processor of the same forward."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("x", kwargs.get("hidden_states"))
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        extra = args[2] if len(args) > 2 else kwargs.get("post_residual_addition")
        if residual is None:
            self.value = x.clone()  # the norm reads x out of place; a copy keeps it whatever follows
            return
        if extra is not None:
            residual = residual + extra
        self.value = (x + residual).to(x.dtype)

    def clear(self, *_: Any) -> None:
        self.value = None

    def take(self, rows: int) -> torch.Tensor | None:
        """The pre-norm state of this forward if it has `rows` rows (else None: an idle or skipped norm)."""
        v, self.value = self.value, None
        return v if v is not None and v.shape[0] == rows else None


def _attn_tp_rank() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_rank)
    except Exception:  # noqa: BLE001 - older layouts (no module, no attribute, not initialised)
        try:
            from sglang.srt.layers.dp_attention import get_attention_tp_rank

            return int(get_attention_tp_rank())
        except Exception:  # noqa: BLE001 - neither layout: a single rank, said in the log
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
    # the final state comes from a store hook (plugin mode, or pre_norm in builtin mode): it must be in place
    target = TARGET_STORE if _DUMPER.mode == "plugin" else TARGET_LAST_STORE if _DUMPER.tap is not None else None
    if target is not None:
        from sglang.srt.layers.logits_processor import LogitsProcessor

        if not hasattr(getattr(LogitsProcessor, target.rsplit(".", 1)[1], None), "__wrapped__"):
            raise PluginConfigError(
                f"hsextract: the hook on {target} is not applied (see the log above); "
                f"the final state ({_DUMPER.cfg.final_state}) cannot be captured with this SGLang"
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
    """Plugin mode: [aux..., final] rows, the final state pre-norm (the tap) or post-norm (hidden_states)."""
    out = original(*args, **kwargs)
    d = _DUMPER
    if d is None or d.mode != "plugin":
        return out
    global _STORE_SIG
    if _STORE_SIG is None:
        _STORE_SIG = inspect.signature(original)
    a = _STORE_SIG.bind(*args, **kwargs).arguments
    hidden = a["hidden_states"]
    pre = d.tap.take(hidden.shape[0]) if d.tap is not None else None  # taken every forward: never stale
    aux, before, meta = a.get("aux_hidden_states"), a.get("hidden_states_before_norm"), a.get("logits_metadata")
    if out is None or before is not None or meta is None or not meta.capture_hidden_mode.is_full():
        return out
    if d.tap is not None and pre is None:
        # leave the rows without a final state: the dump becomes an `.err` marker, never post-norm data
        return out if aux is not None else None
    final = [pre, hidden] if d.n_final == 2 else [pre if pre is not None else hidden]
    if aux is None and len(final) == 1:
        return final[0]
    return torch.cat(final if aux is None else [out, *final], dim=-1)


def _around_last_store(original: Any, *args: Any, **kwargs: Any) -> Any:
    """Builtin mode, final_state pre_norm: last_hidden_states is the tap's pre-norm state, not the normed one."""
    out = original(*args, **kwargs)
    d = _DUMPER
    if d is None or d.mode != "builtin" or d.tap is None:
        return out
    pre = d.tap.take(out.shape[0]) if out is not None else d.tap.take(-1)
    return pre if out is not None else None


def _install_hook(target: str, hook: Any) -> None:
    """An AROUND hook registered and applied after start-up (apply_hooks skips targets already patched)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, hook, HookType.AROUND)
    HookRegistry.apply_hooks()


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
    log.info("hsextract plugin active: dump dir %s, aux layers %s, final state %s", cfg.dump_dir,
             list(cfg.aux_layers), cfg.final_state)
