"""A stand-in SGLang server for CPU tests: `/generate` + `/health`, dump files written by the real plugin code.

It batches concurrent requests like SGLang's scheduler (one pass takes up to `--chunked-prefill-size`
tokens across queued requests, so prompts are split into pieces and passes mix requests), builds the
pass's hidden-state rows from a deterministic function of (token id, position, column) plus padding
rows, and hands them to `hsextract.sglang_plugin.plugin.Dumper.on_extend` exactly as the hook does.

The radix cache (`radix=True`, or the command line without --disable-radix-cache, as SGLang's default): per
`extra_key` (the request's cache namespace), the id prefixes its requests have computed, each pass's progress
included (SGLang inserts a chunked request's progress, cache_unfinished_req); a request's first pass starts at its
longest match, capped at n - 1 (schedule_batch.py:1296-1301 in 0.5.16), and rows are emitted only from there, at
their positions. `prefill_tokens` counts the rows computed (SGLang's #new-token). `abort_after_first_pass` (rid
suffixes): such a request is answered 500 after its first pass, its progress left in the cache (a retry hitting
its own partial pass); `misplace_rows`: the rows of a pass that starts past position 0 (after a cache hit or an
earlier chunk) emitted as if from position 0 (a wrong offset).

Failure injection (command line, or FakeServer kwargs): --fail-first N (HTTP 500), --hang-first N
(never answer), --skip-dump-first N (answer 200, dump nothing), --die-after N (exit the process /
close the socket on request N+1), --wrong-prompt-tokens, --no-marker (plugin not active), --crash-at-start
(print the settings, then exit 1, as a server that fails to load its model).

The door, as SGLang 0.5.16 keeps it: `--api-key KEY`, or a `--config FILE.yaml` whose keys become flags
(`api-key: KEY`; the command line wins over the file), and then every request but /health and /metrics needs
`Authorization: Bearer KEY` (401 {"error": "Unauthorized"} otherwise; sglang/srt/utils/auth.py). At start-up
it prints its settings, key in clear, as SGLang's `logger.info(f"{server_args=}")` does.

    python tests/fake_sglang.py --model-path x --host 127.0.0.1 --port 30000   # env HSEXTRACT_DUMP_DIR, ..._AUX_LAYERS

SGLang's model object: with `model=` (FakeServer) or a `--model-path` whose config.json is Kimi-K2.5's wrapper
(KimiK25ForConditionalGeneration), a pass goes through an object of SGLang's class shape (FakeKimiK25, below: the
wrapper around a DeepseekV3ForCausalLM, as sglang/srt/models/kimi_k25.py builds it) and the plugin's own model
hooks: at start the plugin's set-up finds the decoder and its final norm inside it, sets the capture layers
through the wrapper's delegating setters and verifies them (the marker says what it resolved); each pass runs the
decoder (capture layers' inputs as aux, the final norm called on hidden + residual, so the plugin's pre-hook
takes the pre-norm state) and SGLang's LogitsProcessor store through the plugin's hook. The rows it dumps are the
same expected_states, so a whole run is checked value for value either way.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import torch

from hsextract.config.model_info import text_config
from hsextract.sglang_plugin import plugin as plg

HIDDEN = 16


def expected_states(ids: list[int], num_tensors: int, hidden: int = HIDDEN) -> list[torch.Tensor]:
    """The fake model's hidden states: exact small integers in bf16, distinct per token, position, layer."""
    x = torch.tensor(ids, dtype=torch.int64)[:, None]
    t = torch.arange(len(ids))[:, None]
    c = torch.arange(num_tensors * hidden)[None, :]
    full = (((x * 7 + t * 3 + c * 5) % 97) - 48).to(torch.bfloat16)
    return [full[:, i * hidden : (i + 1) * hidden].contiguous() for i in range(num_tensors)]


@dataclass
class _Req:
    rid: str
    origin_input_ids: list[int]
    done: threading.Event = field(default_factory=threading.Event)
    progress: int | None = None  # None until its first pass: then its prefix-cache hit
    extra_key: str | None = None
    cached: int = 0
    aborted: bool = False


def lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class _Mode:
    def is_extend(self) -> bool:
        return True


@dataclass
class _Batch:
    reqs: list
    prefix_lens: list
    extend_lens: list
    forward_mode: _Mode = field(default_factory=_Mode)


@dataclass
class _LogitsOut:
    hidden_states: torch.Tensor
    last_hidden_states: torch.Tensor | None = None


# ---- SGLang's model objects, in the shape the plugin reads ----------------------------------------------------
class FusedAddRMSNorm(torch.nn.Module):
    """SGLang's RMSNorm called with a residual (fused_add_rmsnorm): writes the sum into `residual` and the normed
    state into `x`, in place, and returns both."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, hidden).to(torch.bfloat16))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual.add_(x)
        r = residual.float()
        x.copy_((r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype))
        return x, residual


class FakeDecoder(torch.nn.Module):
    """SGLang's DeepseekV2Model: decoder `.layers`, the final `.norm`, `layers_to_capture` (capture index i = the
    input of layer i). A pass's rows [T, (K+1)*H] of expected_states come out as that model's would: the first K
    blocks as the captured layers' inputs (in layer order), the last as hidden + residual entering the norm."""

    def __init__(self, num_layers: int, hidden: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(num_layers))
        self.norm = FusedAddRMSNorm(hidden)
        self.layers_to_capture: list[int] = []
        self.hidden = hidden

    def forward(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h = self.hidden
        if len(self.layers_to_capture) != k:
            raise RuntimeError(f"fake decoder: {k} aux layers wanted, layers_to_capture {self.layers_to_capture}")
        aux = [rows[:, j * h:(j + 1) * h] for j in range(k)]
        pre = rows[:, k * h:(k + 1) * h]
        residual = torch.ones_like(pre)  # hidden + residual == pre exactly: small integers in bf16
        hidden, _ = self.norm((pre - residual).contiguous(), residual)
        return hidden, aux


class FakeDeepseekV3ForCausalLM(torch.nn.Module):
    """SGLang 0.5.16's DeepseekV3ForCausalLM: `.model` the decoder; its capture setters (deepseek_v2.py:2915-2942)."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.model = FakeDecoder(config.num_hidden_layers, config.hidden_size)

    def forward(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model(rows, k)

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        if layer_ids is None:
            n = self.config.num_hidden_layers
            self.model.layers_to_capture = [2, n // 2, n - 3]
        elif layer_ids and layer_ids[0] == 1:
            self.model.layers_to_capture = [v + 1 for v in layer_ids]
        else:
            self.model.layers_to_capture = list(layer_ids)

    def set_dflash_layers_to_capture(self, layer_ids: list[int]) -> None:
        self.model.layers_to_capture = [v + 1 for v in layer_ids]


class FakeKimiK25Config:
    """SGLang's KimiK25Config: the text model's settings in `text_config`; hidden_size reads them."""

    def __init__(self, text_config: SimpleNamespace) -> None:
        self.text_config = text_config
        self.architectures = ["KimiK25ForConditionalGeneration"]

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size


class FakeKimiK25(torch.nn.Module):
    """SGLang 0.5.16's KimiK25ForConditionalGeneration (models/kimi_k25.py:642-941): `vision_tower`,
    `mm_projector`, `language_model` (a DeepseekV3ForCausalLM); `.model` aliases language_model and assigning
    `.model` is a no-op; the capture setters delegate to the language model."""

    def __init__(self, text_config: SimpleNamespace) -> None:
        super().__init__()
        self.config = FakeKimiK25Config(text_config)
        self.vision_tower = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        self.mm_projector = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, text_config.hidden_size))
        self.language_model = FakeDeepseekV3ForCausalLM(text_config)

    @property
    def model(self) -> FakeDeepseekV3ForCausalLM:
        return self.language_model

    def __setattr__(self, name: str, value: object) -> None:
        if name == "model":
            return
        super().__setattr__(name, value)

    def forward(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.language_model(rows, k)  # general_mm_embed_routine: text only, straight to the language model

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        self.language_model.set_eagle3_layers_to_capture(layer_ids)

    def set_dflash_layers_to_capture(self, layer_ids: list[int]) -> None:
        self.language_model.set_dflash_layers_to_capture(layer_ids)


def sglang_model_for(model_path: str | os.PathLike[str]) -> FakeKimiK25 | None:
    """The SGLang model object for a Kimi-K2.5-packaged checkpoint (config.json's class and text_config), else
    None (the server dumps its rows without a model object)."""
    cfg_file = Path(model_path) / "config.json"
    if not cfg_file.is_file():
        return None
    cfg = json.loads(cfg_file.read_text())
    if (cfg.get("architectures") or [None])[0] != "KimiK25ForConditionalGeneration":
        return None
    text = cfg["text_config"]
    return FakeKimiK25(SimpleNamespace(num_hidden_layers=int(text["num_hidden_layers"]),
                                       hidden_size=int(text["hidden_size"])))


def sgl_store(self: object, hidden_states: torch.Tensor, hidden_states_before_norm: torch.Tensor | None,
              aux_hidden_states: list[torch.Tensor] | None, pruned_states: torch.Tensor | None,
              pruned_states_before_norm: torch.Tensor | None, aux_pruned_states: list[torch.Tensor] | None,
              sample_indices: torch.Tensor | None, logits_metadata: object) -> torch.Tensor | None:
    """SGLang 0.5.16's LogitsProcessor._get_hidden_states_to_store, FULL capture (logits_processor.py:630-650)."""
    return torch.cat(aux_hidden_states, dim=-1) if aux_hidden_states is not None else hidden_states


_FULL = SimpleNamespace(capture_hidden_mode=SimpleNamespace(is_full=lambda: True))
_PLUGIN_LOCK = threading.Lock()  # the plugin's hooks read one module-level Dumper; servers in one process take turns


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = 256  # listen backlog; the default 5 resets connections at 32 in flight (uvicorn: 2048)


class FakeServer:
    def __init__(self, dump_dir: Path, aux_layers: tuple[int, ...], host: str = "127.0.0.1", port: int = 0, *,
                 chunk: int = 64, builtin: bool = False, fail_first: int = 0, hang_first: int = 0,
                 skip_dump_first: int = 0, die_after: int | None = None, wrong_prompt_tokens: bool = False,
                 marker: bool = True, exit_on_die: bool = False, pass_delay_s: float = 0.002,
                 hidden: int = HIDDEN, staging_bytes: int = 4 << 20, write_delay_s: float = 0.0,
                 gather: int = 0, gather_after: int = 0, final_state: str = "post_norm", api_key: str | None = None,
                 model: torch.nn.Module | None = None, radix: bool = False, shared_prefix: bool | None = None,
                 abort_after_first_pass: tuple[str, ...] = (), misplace_rows: bool = False,
                 abort_first: int = 0) -> None:
        cfg = plg.PluginConfig(dump_dir=Path(dump_dir), aux_layers=tuple(aux_layers), final_state=final_state,
                               staging_bytes=staging_bytes,
                               shared_prefix=radix if shared_prefix is None else shared_prefix)
        self.dumper = plg.Dumper(cfg, pin=False, write_delay_s=write_delay_s)
        self.dumper._is_writer_rank = True
        self.dumper.mode = "builtin" if builtin else "plugin"
        self.dumper.hidden_size = self.hidden = hidden
        self.k1 = len(aux_layers) + (2 if final_state == "both" else 1)  # tensors per row
        self.chunk, self.builtin = chunk, builtin
        self.fail_first, self.hang_first, self.skip_first = fail_first, hang_first, skip_dump_first
        self.abort_first = abort_first  # after fail_first: answered 200 with finish_reason abort, nothing dumped
        self.die_after, self.wrong, self.exit_on_die = die_after, wrong_prompt_tokens, exit_on_die
        self.pass_delay_s = pass_delay_s
        # the first pass waits for `gather` requests (5 s at most) and takes them in rid order: a test whose
        # outcome depends on which requests share that pass gets the same pass on a loaded machine
        self.gather = gather
        self.gather_after = gather_after  # the gathering pass is the first once this many requests are finished
        self.finished = 0
        self.api_key = api_key
        self.radix = radix
        self.cache: dict[str | None, list[list[int]]] = {}  # extra_key -> the id prefixes computed under it
        self.abort_after_first_pass, self.misplace_rows = tuple(abort_after_first_pass), misplace_rows
        self.prefill_tokens = 0  # rows computed, over all passes (SGLang's #new-token)
        self.log_passes = False  # print SGLang's prefill log line per pass (the server process: bench dry runs)
        self.extra_keys: list[str | None] = []  # every request's extra_key, in arrival order
        self.refused = 0  # requests answered 401 (no or a wrong key)
        self.n_requests = 0
        self.rids: list[str] = []  # every rid /generate received, in arrival order
        self.passes = 0
        self.max_batch = 0
        self.inflight = 0  # /generate requests being served right now, and the most at once
        self.max_inflight = 0
        self._lock = threading.Lock()
        self._queue: list[_Req] = []
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self.model = model
        resolved = self._set_up_model(model) if model is not None else list(aux_layers)
        if marker:
            self.dumper.write_marker(resolved)  # SGLang capture index = hidden_states id
        self.httpd = _HTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._threads = [threading.Thread(target=self.httpd.serve_forever, daemon=True),
                         threading.Thread(target=self._schedule, daemon=True)]

    def _set_up_model(self, model: torch.nn.Module) -> list[int]:
        """The plugin's hooks after ModelRunner.load_model and init_attention_backends, on SGLang's model object."""
        if self.builtin:
            raise ValueError("fake sglang: a model object runs the plugin capture source only")
        self.dumper.setup_model(model, SimpleNamespace(enable_return_aux_hidden_states=False))
        if self.dumper.hidden_size != self.hidden:
            raise ValueError(f"fake sglang: model hidden size {self.dumper.hidden_size}, rows of {self.hidden}")
        return self.dumper.verify_model(model)

    def _forward(self, rows: torch.Tensor) -> torch.Tensor:
        """The model's forward on a pass's rows, then the logits processor's store through the plugin's hook."""
        k = self.k1 - self.dumper.n_final
        with _PLUGIN_LOCK:
            previous, plg._DUMPER = plg._DUMPER, self.dumper
            try:
                hidden, aux = self.model(rows, k)
                return plg._around_store(sgl_store, None, hidden, None, aux or None, None, None, None, None, _FULL)
            finally:
                plg._DUMPER = previous

    def start(self) -> FakeServer:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    def die(self) -> None:
        if self.exit_on_die:
            os._exit(3)
        threading.Thread(target=self.stop, daemon=True).start()

    # ---- scheduler: chunked-prefill batching --------------------------------------------------------
    def _schedule(self) -> None:
        gather = self.gather
        while not self._stop.is_set():
            with self._cv:
                while not self._queue and not self._stop.is_set():
                    self._cv.wait(0.1)
                if gather and self.finished >= self.gather_after:
                    self._cv.wait_for(lambda n=gather: len(self._queue) >= n or self._stop.is_set(), timeout=5.0)
                    self._queue.sort(key=lambda r: r.rid)
                    gather = 0
                if self._stop.is_set():
                    return
                time.sleep(self.pass_delay_s)  # let concurrent requests gather into one pass
                budget, parts = self.chunk, []
                for r in list(self._queue):
                    if budget <= 0:
                        break
                    if r.progress is None:  # scheduled for the first time: its prefix-cache hit
                        r.progress = r.cached = self._match(r)
                    ext = min(budget, len(r.origin_input_ids) - r.progress)
                    parts.append((r, r.progress, ext))
                    budget -= ext
            self._run_pass(parts)
            if self.log_passes:  # as SGLang 0.5.16's metrics_reporter.py:557-561 (the fields a bench parses)
                new = [(r, ext) for r, pre, ext in parts if pre == r.cached]
                print(f"Prefill batch, #new-seq: {len(new)}, #new-token: {sum(e for _, _, e in parts)}, "
                      f"#cached-token: {sum(r.cached for r, _ in new)}, #running-req: 0, #queue-req: "
                      f"{len(self._queue) - len(parts)}, ", flush=True)
            with self._cv:
                for r, pre, ext in parts:
                    r.progress = pre + ext
                    self.prefill_tokens += ext
                    if self.radix:
                        self.cache.setdefault(r.extra_key, []).append(list(r.origin_input_ids[:r.progress]))
                    if r.progress == len(r.origin_input_ids):
                        self._queue.remove(r)
                        self.finished += 1
                        r.done.set()
                    elif (pre == r.cached and self.abort_after_first_pass
                          and r.rid.endswith(self.abort_after_first_pass)):
                        r.aborted = True  # its first pass stays in the cache
                        self._queue.remove(r)
                        r.done.set()

    def _match(self, r: _Req) -> int:
        """The longest cached prefix under the request's extra_key, at most n - 1 (SGLang computes >= 1 token)."""
        if not self.radix:
            return 0
        best = max((lcp(c, r.origin_input_ids) for c in self.cache.get(r.extra_key, ())), default=0)
        return min(best, len(r.origin_input_ids) - 1)

    def _run_pass(self, parts: list) -> None:
        rows = [torch.cat(expected_states(r.origin_input_ids[pre: pre + ext] if self.misplace_rows else
                                          r.origin_input_ids[: pre + ext], self.k1, self.hidden), dim=1)[
                    0 if self.misplace_rows else pre:] for r, pre, ext in parts]
        rows.append(torch.full((3, self.k1 * self.hidden), -77.0, dtype=torch.bfloat16))  # graph padding
        hs = torch.cat(rows)
        if self.model is not None:
            lo = _LogitsOut(self._forward(hs))
        elif self.builtin:
            k = (self.k1 - 1) * self.hidden
            lo = _LogitsOut(hs[:, :k].contiguous(), hs[:, k:].contiguous())
        else:
            lo = _LogitsOut(hs)
        # a request told to skip its dump gets a rid the plugin does not accept (like SGLang's warmup)
        reqs = [_Req("skipped", r.origin_input_ids) if getattr(r, "skip", False) else r for r, _, _ in parts]
        self.dumper.on_extend(_Batch(reqs, [p[1] for p in parts], [p[2] for p in parts]), lo)
        self.passes += 1
        self.max_batch = max(self.max_batch, len(parts))

    # ---- HTTP ---------------------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        srv = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def _send(self, code: int, obj: object) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorized(self) -> bool:
                """SGLang's decide_request_auth for a NORMAL endpoint; a refusal is answered here."""
                if self.path.startswith(("/health", "/metrics")) or not srv.api_key:
                    return True
                parts = (self.headers.get("Authorization") or "").split(" ", 1)
                if len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1],
                                                                                               srv.api_key):
                    return True
                with srv._lock:
                    srv.refused += 1
                self.close_connection = True  # the body, if any, is left unread
                self._send(401, {"error": "Unauthorized"})
                return False

            def do_GET(self) -> None:
                if not self._authorized():
                    return
                if self.path == "/health":
                    self._send(200, {})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                if not self._authorized():
                    return
                n = int(self.headers.get("Content-Length", 0))
                req = json.loads(self.rfile.read(n))
                if self.path != "/generate":
                    return self._send(404, {"error": "not found"})
                with srv._lock:
                    srv.n_requests += 1
                    srv.rids.append(req.get("rid"))
                    k = srv.n_requests
                if srv.die_after is not None and k > srv.die_after:
                    srv.die()
                    self.close_connection = True
                    return
                if k <= srv.fail_first:
                    return self._send(500, {"error": "injected failure"})
                if k <= srv.fail_first + srv.abort_first:  # SGLang's /abort_request: 200, nothing computed
                    return self._send(200, {"output_ids": [], "meta_info": {
                        "id": req.get("rid"), "finish_reason": {"type": "abort", "message": "Abort before prefill",
                                                                "status_code": None, "err_type": None}}})
                if k <= srv.fail_first + srv.abort_first + srv.hang_first:
                    srv._stop.wait(3600)
                    return
                ids = req["input_ids"]
                r = _Req(req.get("rid") or f"plain-{k}", ids, extra_key=req.get("extra_key"))  # no rid: random hex
                with srv._lock:
                    srv.extra_keys.append(r.extra_key)
                r.skip = k <= srv.fail_first + srv.abort_first + srv.hang_first + srv.skip_first
                with srv._lock:  # counted before it is queued: no pass can answer it first
                    srv.inflight += 1
                    srv.max_inflight = max(srv.max_inflight, srv.inflight)
                with srv._cv:
                    srv._queue.append(r)
                    srv._cv.notify_all()
                # a dead server's connections close (a real one's process exit resets them): without this,
                # a request in flight when the fake "died" hung until the client's timeout
                while not r.done.wait(0.05):
                    if srv._stop.is_set():
                        self.close_connection = True
                        return
                with srv._lock:
                    srv.inflight -= 1
                if r.aborted:
                    return self._send(500, {"error": "injected abort after the first pass"})
                n_ids = len(ids) + (1 if srv.wrong else 0)
                self._send(200, {"output_ids": [], "meta_info": {"id": r.rid, "prompt_tokens": n_ids,
                                                                  "completion_tokens": 0, "cached_tokens": r.cached}})

        return H


def merge_config_file(argv: list[str]) -> list[str]:
    """SGLang's ConfigArgumentMerger: the YAML file after --config becomes `--key value` flags, put before the
    other arguments (so the command line wins)."""
    import yaml

    if "--config" not in argv:
        return argv
    i = argv.index("--config")
    path = argv[i + 1]
    if not path.endswith((".yaml", ".yml")):
        raise SystemExit(f"Config file must be YAML format, got: {path}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    flags = [x for k, v in data.items() for x in ((f"--{k}",) if v is True else (f"--{k}", str(v)))]
    return flags + argv[:i] + argv[i + 2:]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default="")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--chunked-prefill-size", type=int, default=64)
    ap.add_argument("--enable-return-aux-hidden-states", action="store_true")
    ap.add_argument("--disable-radix-cache", action="store_true")
    ap.add_argument("--fail-first", type=int, default=0)
    ap.add_argument("--hang-first", type=int, default=0)
    ap.add_argument("--skip-dump-first", type=int, default=0)
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--wrong-prompt-tokens", action="store_true")
    ap.add_argument("--startup-delay", type=float, default=0.0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--crash-at-start", action="store_true")
    a, _unknown = ap.parse_known_args(merge_config_file(list(sys.argv[1:] if argv is None else argv)))
    # what SGLang 0.5.16 logs at start-up (sglang/srt/entrypoints/engine.py), the key in clear
    print(f"server_args=ServerArgs(model_path={a.model_path!r}, host={a.host!r}, port={a.port}, "
          f"api_key={a.api_key!r}, chunked_prefill_size={a.chunked_prefill_size})", flush=True)
    if a.crash_at_start:
        raise SystemExit("RuntimeError: Not enough memory (injected start-up failure)")
    time.sleep(a.startup_delay)
    cfg = plg.PluginConfig.from_env()
    marker = cfg is not None
    if cfg is None:
        cfg = plg.PluginConfig(Path("/nonexistent"), (0,))
    model_cfg = Path(a.model_path) / "config.json"  # a real model dir: its hidden size (throughput dry run)
    hidden = text_config(json.loads(model_cfg.read_text())).get("hidden_size", HIDDEN) if model_cfg.is_file() \
        else HIDDEN
    srv = FakeServer(cfg.dump_dir, cfg.aux_layers, a.host, a.port, chunk=a.chunked_prefill_size,
                     builtin=a.enable_return_aux_hidden_states, fail_first=a.fail_first, hang_first=a.hang_first,
                     skip_dump_first=a.skip_dump_first, die_after=a.die_after,
                     wrong_prompt_tokens=a.wrong_prompt_tokens, marker=marker, exit_on_die=True, hidden=hidden,
                     staging_bytes=min(cfg.staging_bytes, 1 << 30), final_state=cfg.final_state,
                     api_key=a.api_key, model=sglang_model_for(a.model_path) if a.model_path else None,
                     radix=not a.disable_radix_cache, shared_prefix=cfg.shared_prefix)
    srv.log_passes = True
    print(f"fake sglang serving on {srv.url}, pid {os.getpid()}", flush=True)
    srv.start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.stop()


if __name__ == "__main__":
    main()
