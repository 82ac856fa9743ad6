"""The `sglang` engine: drive a patched SGLang server with many requests in flight, collect dump files.

Each prompt becomes one `/generate` request (token ids, `max_new_tokens` 0, a unique rid); the server's
hsextract plugin writes that request's hidden states to the dump directory, and this client waits for
the `.done` marker, checks the ids, assembles the pieces and deletes the files. Requests run on
`concurrency` threads (`sglang.api`); results come back in input order through a bounded reorder
window. A failed request is retried with exponential backoff (`api.retrying`); after `retries` retries,
or as soon as the server fails its health check, the chunk fails with an EngineError saying which.
"""

from __future__ import annotations

import itertools
import re
import secrets
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from hsextract.engines.base import Captured, CaptureSpec, Engine, Prompt
from hsextract.errors import ConfigError, EngineError
from hsextract.layers import HIDDEN_STATES, UNRECORDED, describe
from hsextract.sglang.api import RequestRefused, SGLangAPI, TransientError, retrying
from hsextract.sglang_plugin import dumpcheck, dumpfiles
from hsextract.sglang_plugin.dumpcheck import verify_dir
from hsextract.sglang_plugin.settings import DEFAULT_RID_PREFIX as RID_PREFIX  # the plugin dumps these rids only

# Failures worth another attempt: the request (TransientError) or its dump files (missing, late, broken).
RETRYABLE = (TransientError, dumpfiles.DumpTimeout, dumpfiles.DumpError)


class ServerLike(Protocol):
    url: str
    dump_dir: Path


class _Fatal(Exception):
    """A failure retrying cannot fix (HTTP 4xx, wrong prompt length, wrong hidden size)."""


class SGLangEngine(Engine):
    name = "sglang"

    def __init__(
        self,
        server: str | ServerLike,
        spec: CaptureSpec,
        dump_dir: str | Path | None = None,
        *,
        concurrency: int = 32,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        run_name: str = "run",
        chunk: int = 0,
        max_new_tokens: int = 0,
        health_timeout_s: float = 10.0,
        progress: Callable[[int], Any] | None = None,
        api_key: str | None = None,
    ) -> None:
        if isinstance(server, str):
            url = server
        else:
            url = server.url
            dump_dir = dump_dir or server.dump_dir
            # a server started by the launcher: the key it made or was given (ServerHandle.api_key)
            api_key = api_key if api_key is not None else getattr(server, "api_key", None)
        if dump_dir is None:
            raise ConfigError("sglang engine: dump_dir is required with server_url (the directory the server's "
                              "HSEXTRACT_DUMP_DIR names, on this machine)")
        if spec.final_state not in ("pre_norm", "post_norm", "both"):
            raise ConfigError(f"final_state: {spec.final_state!r}; use pre_norm or post_norm")
        if concurrency < 1 or retries < 0 or timeout_s <= 0:
            raise ConfigError("sglang engine: concurrency >= 1, retries >= 0 and timeout_s > 0 are required")
        self.api = SGLangAPI(url, timeout_s, api_key=api_key)
        self.url = self.api.url
        self.spec = spec
        self.dump_dir = Path(dump_dir)
        verify_dir(self.dump_dir)  # ours, 0700, not a symlink: its files are read as the server's
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_new_tokens = max_new_tokens
        self.health_timeout_s = health_timeout_s
        self.progress = progress
        safe_run = re.sub(r"[^A-Za-z0-9_.-]", "_", run_name)[:60] or "run"
        # unique per engine instance and per extract() call (the "-x<n>" part): a rid is never sent twice,
        # also when extract() runs twice on one engine with the same prompt indices (a warm-up, then the
        # run): a rid the plugin already completed would wait for a `.done` marker that never comes.
        self._rid_base = f"{RID_PREFIX}{safe_run}-c{chunk:05d}-{secrets.token_hex(4)}"
        self._calls = itertools.count()
        self._marker: dict | None = None
        # `concurrency` bounds the requests the server holds, not the threads: a request's thread frees
        # its slot when the HTTP answer comes and then collects the dump, so the server's queue stays
        # full while dumps are read (collecting inside the slot starves the GPU at short prompts).
        self._http_slots = threading.BoundedSemaphore(concurrency)

    # ---- info -----------------------------------------------------------------------------------------
    def plugin_info(self) -> dict:
        """The plugin's start-up marker in the dump dir; checks it captures this spec's layers."""
        if self._marker is None:
            markers = sorted(self.dump_dir.glob(f"{dumpfiles.PLUGIN_MARKER_PREFIX}*.json"))
            if not markers:
                raise EngineError(
                    f"no hsextract plugin marker in {self.dump_dir}: the server at {self.url} does not run the "
                    "plugin with this dump directory (SGLANG_PLUGINS=hsextract, HSEXTRACT_DUMP_DIR)"
                )
            try:
                info = dumpcheck.load_json(dumpcheck.read_regular(markers[0], dumpcheck.MAX_MARKER_BYTES).tobytes(),
                                           f"plugin marker {markers[0]}")
            except dumpcheck.Refused as e:
                raise EngineError(f"{e}; restart the server") from None
            if not isinstance(info, dict):
                raise EngineError(f"plugin marker {markers[0]} is not a JSON object; restart the server")
            # an older plugin (PLUGIN_VERSION 1) writes no convention: its ids were layer outputs
            convention = info.get("layer_convention", UNRECORDED)
            if convention != HIDDEN_STATES or tuple(info.get("aux_layers", ())) != tuple(self.spec.aux_layers):
                raise EngineError(
                    f"the server at {self.url} captures aux layers {info.get('aux_layers')} ({convention} ids), "
                    f"this run asks for {describe(self.spec.aux_layers)}; restart the server with this run's "
                    f"aux_layers and this hsextract's plugin"
                )
            if info.get("final_state", "post_norm") != self.spec.final_state:  # markers before pre_norm: post
                raise EngineError(
                    f"the server at {self.url} captures final_state {info.get('final_state', 'post_norm')}, this "
                    f"run asks for {self.spec.final_state}; restart the server with this run's final_state"
                )
            self._marker = info
        return self._marker

    def version(self) -> str:
        info = self.plugin_info()
        return (f"sglang {info.get('sglang_version')} + hsextract plugin {info.get('plugin_version')} "
                f"(capture {info.get('capture')})")

    # ---- HTTP -----------------------------------------------------------------------------------------
    def _generate(self, rid: str, ids: list[int]) -> dict:
        try:
            out = self.api.generate({
                "rid": rid,
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0.0},
            })
        except RequestRefused as e:
            raise _Fatal(str(e)) from e
        got = (out.get("meta_info") or {}).get("prompt_tokens")
        if got is not None and got != len(ids):
            raise _Fatal(f"the server counted {got} prompt tokens, the prompt has {len(ids)}")
        return out

    def _collect(self, rid: str, ids: list[int], stop: threading.Event) -> dumpfiles.Collected:
        """The request's dump files, read and removed (waits for the plugin's `.done` marker)."""
        return dumpfiles.collect(self.dump_dir, rid, ids, self.spec.num_tensors, self.timeout_s,
                                 should_stop=stop.is_set)

    def health(self) -> str | None:
        """None when GET /health answers 200, else why not."""
        return self.api.health(self.health_timeout_s)

    # ---- one prompt -----------------------------------------------------------------------------------
    def _attempt(self, p: Prompt, ids: list[int], rid: str, stop: threading.Event) -> Captured:
        with self._http_slots:
            self._generate(rid, ids)
        hs = self._collect(rid, ids, stop).hidden_states
        expected_h = (self._marker or {}).get("hidden_size")
        if expected_h and hs[0].shape[1] != expected_h:
            raise _Fatal(f"dumped hidden size {hs[0].shape[1]}, the model's is {expected_h}")
        return Captured(index=p.index, sample_id=p.sample_id, hidden_states=hs)

    def _one(self, p: Prompt, stop: threading.Event, base: str) -> Captured:
        ids = [int(x) for x in p.input_ids]
        where = f"sample {p.sample_id!r} (index {p.index})"
        cancelled = f"{where}: cancelled because another sample of the chunk failed"
        try:
            for attempt in retrying(self.retries, self.backoff_s, retry_on=RETRYABLE, sleep=stop.wait):
                with attempt:
                    if stop.is_set():
                        raise EngineError(cancelled)
                    n = attempt.retry_state.attempt_number - 1
                    rid = f"{base}-i{p.index}-a{n}"
                    try:
                        return self._attempt(p, ids, rid, stop)
                    except _Fatal as e:
                        dumpfiles.remove_rid(self.dump_dir, rid)
                        raise EngineError(f"{where}: {e} (server {self.url}); the chunk fails, no shard is "
                                          "written") from e
                    except RETRYABLE as e:
                        dumpfiles.remove_rid(self.dump_dir, rid)
                        if stop.is_set():
                            raise EngineError(cancelled) from e
                        down = self.health()
                        if down is not None:
                            raise EngineError(
                                f"{where}: the SGLang server at {self.url} is down (health check: {down}) after "
                                f"attempt {n + 1}: {e}. The chunk fails, no shard is written; rerun to restart the "
                                "server."
                            ) from e
                        raise
        except RETRYABLE as last:
            raise EngineError(
                f"{where}: failed {self.retries + 1} times although the server at {self.url} is healthy; last "
                f"error: {last}. The chunk fails, no shard is written."
            ) from last
        raise AssertionError("unreachable: retrying() returns or raises")

    # ---- many prompts ---------------------------------------------------------------------------------
    def extract(self, prompts: Iterable[Prompt]) -> Iterator[Captured]:
        self.plugin_info()
        base = f"{self._rid_base}-x{next(self._calls)}"
        stop = threading.Event()
        window = 2 * self.concurrency  # bounded reorder buffer: at most this many samples in memory
        pending: deque[Future[Captured]] = deque()
        it = iter(prompts)
        pool = ThreadPoolExecutor(max_workers=window, thread_name_prefix="hsx-sglang")
        # Dozens of threads each take the GIL back after every blocking call (socket, file, zstd); at the
        # default 5 ms switch interval those hand-overs, not the work, bound the client.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, 0.0005))
        try:
            exhausted = False
            while True:
                while not exhausted and len(pending) < window:
                    p = next(it, None)
                    if p is None:
                        exhausted = True
                        break
                    pending.append(pool.submit(self._one, p, stop, base))
                if not pending:
                    break
                res = pending.popleft().result()
                if self.progress is not None:
                    self.progress(1)
                yield res
        except BaseException:
            stop.set()
            for f in pending:
                f.cancel()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            sys.setswitchinterval(switch)
