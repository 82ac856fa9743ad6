"""The `sglang` engine: drive a patched SGLang server with many requests in flight, collect dump files.

Each prompt becomes one `/generate` request (token ids, `max_new_tokens` 0, a unique rid); the server's
hsextract plugin writes that request's hidden states to the dump directory, and this client waits for
the `.done` marker, checks the ids, assembles the pieces and deletes the files. Requests run on
`concurrency` threads (http.client, no extra dependency); results come back in input order through a
bounded reorder window. A failed request is retried with exponential backoff; after `retries` retries,
or as soon as the server fails its health check, the chunk fails with an EngineError saying which.
"""

from __future__ import annotations

import http.client
import itertools
import json
import re
import secrets
import sys
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from hsextract.sglang_plugin import dumpfiles
from hsextract.engines.base import CaptureSpec, Captured, Engine, Prompt
from hsextract.errors import ConfigError, EngineError

RID_PREFIX = "hsx-"  # the plugin dumps only rids with this prefix (HSEXTRACT_RID_PREFIX)


class ServerLike(Protocol):
    url: str
    dump_dir: Path


class _Transient(Exception):
    """A failure worth retrying (connection error, timeout, HTTP 5xx, missing dump)."""


class _Fatal(Exception):
    """A failure retrying cannot fix (HTTP 4xx, wrong prompt length)."""


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
    ) -> None:
        if isinstance(server, str):
            url = server
        else:
            url = server.url
            dump_dir = dump_dir or server.dump_dir
        if dump_dir is None:
            raise ConfigError("sglang engine: dump_dir is required with server_url (the directory the server's "
                              "HSEXTRACT_DUMP_DIR names, on this machine)")
        if spec.final_state != "post_norm":
            raise ConfigError(f"final_state: {spec.final_state!r} is not available from SGLang (it hands out the "
                              "final state after the final norm); use post_norm or engine: transformers")
        if concurrency < 1 or retries < 0 or timeout_s <= 0:
            raise ConfigError("sglang engine: concurrency >= 1, retries >= 0 and timeout_s > 0 are required")
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ConfigError(f"sglang server url {url!r}: expected http://host:port")
        self.url = url.rstrip("/")
        self._host, self._port = u.hostname, u.port or 80
        self.spec = spec
        self.dump_dir = Path(dump_dir)
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_new_tokens = max_new_tokens
        self.health_timeout_s = health_timeout_s
        self.progress = progress
        safe_run = re.sub(r"[^A-Za-z0-9_.-]", "_", run_name)[:60] or "run"
        # unique per engine instance and per extract() call (the "-x<n>" part): a rid is never sent twice.
        # The H200 throughput run called extract() twice on one engine (warm-up, then the measured run)
        # with the same prompt indices; the plugin had already completed those rids and dropped them, so
        # the second run waited for `.done` markers that never came.
        self._rid_base = f"{RID_PREFIX}{safe_run}-c{chunk:05d}-{secrets.token_hex(4)}"
        self._calls = itertools.count()
        self._marker: dict | None = None
        # `concurrency` bounds the requests the server holds, not the threads: a request's thread frees
        # its slot when the HTTP answer comes and then collects the dump, so the server's queue stays
        # full while dumps are read (on the H200, collecting inside the slot starved the GPU: 0.66 of
        # the plain server at 512-token prompts with 32 in flight).
        self._http_slots = threading.BoundedSemaphore(concurrency)
        # Set to a list to record, per sample, when (wall clock) it was queued, sent, answered, dumped by
        # the plugin and collected: where a slow run loses its time (bench/sglang_throughput.py).
        self.timeline: list[dict] | None = None

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
            info = json.loads(markers[0].read_text())
            if tuple(info.get("aux_layers", ())) != tuple(self.spec.aux_layers):
                raise EngineError(
                    f"the server at {self.url} captures aux layers {info.get('aux_layers')}, this run asks for "
                    f"{list(self.spec.aux_layers)}; restart the server with this run's aux_layers"
                )
            self._marker = info
        return self._marker

    def version(self) -> str:
        info = self.plugin_info()
        return (f"sglang {info.get('sglang_version')} + hsextract plugin {info.get('plugin_version')} "
                f"(capture {info.get('capture')})")

    # ---- HTTP -----------------------------------------------------------------------------------------
    def _generate(self, rid: str, ids: list[int]) -> dict:
        body = json.dumps({
            "rid": rid,
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0.0},
        })
        # A fresh connection per request: a kept-alive one goes stale while its thread waits for the
        # dump files (the server closes idle connections after a few seconds), and the next POST on
        # it fails with BrokenPipe, seen on the H200 run. On loopback a connect costs ~0.1 ms.
        c = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)
        try:
            c.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
        except (OSError, http.client.HTTPException) as e:
            raise _Transient(f"POST /generate failed: {type(e).__name__}: {e}") from e
        finally:
            c.close()
        text = data[:300].decode(errors="replace")
        if r.status >= 500:
            raise _Transient(f"POST /generate returned HTTP {r.status}: {text}")
        if r.status != 200:
            raise _Fatal(f"POST /generate was refused with HTTP {r.status}: {text}")
        try:
            out = json.loads(data)
        except ValueError as e:
            raise _Transient(f"POST /generate returned non-JSON: {text}") from e
        got = (out.get("meta_info") or {}).get("prompt_tokens") if isinstance(out, dict) else None
        if got is not None and got != len(ids):
            raise _Fatal(f"the server counted {got} prompt tokens, the prompt has {len(ids)}")
        return out

    def health(self) -> str | None:
        """None when GET /health answers 200, else why not."""
        from hsextract.sglang.server import health

        return health(self.url, self.health_timeout_s)

    # ---- one prompt -----------------------------------------------------------------------------------
    def _one(self, p: Prompt, stop: threading.Event, base: str) -> Captured:
        ids = [int(x) for x in p.input_ids]
        where = f"sample {p.sample_id!r} (index {p.index})"
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if stop.is_set():
                raise EngineError(f"{where}: cancelled because another sample of the chunk failed")
            rid = f"{base}-i{p.index}-a{attempt}"
            try:
                t_queued = time.time()
                with self._http_slots:
                    t_sent = time.time()
                    self._generate(rid, ids)
                t_answer = time.time()
                col = dumpfiles.collect(self.dump_dir, rid, ids, self.spec.num_tensors, self.timeout_s,
                                        should_stop=stop.is_set)
                if self.timeline is not None:
                    self.timeline.append({
                        "index": p.index, "tokens": len(ids), "queued": t_queued, "sent": t_sent,
                        "answered": t_answer, "staged": col.marker.get("staged_at"),
                        "written": col.marker.get("written_at"), "lane": col.marker.get("lane"),
                        "collected": time.time(),
                    })
                hs = col.hidden_states
                expected_h = (self._marker or {}).get("hidden_size")
                if expected_h and hs[0].shape[1] != expected_h:
                    raise _Fatal(f"dumped hidden size {hs[0].shape[1]}, the model's is {expected_h}")
                return Captured(index=p.index, sample_id=p.sample_id, hidden_states=hs)
            except _Fatal as e:
                dumpfiles.remove_rid(self.dump_dir, rid)
                raise EngineError(f"{where}: {e} (server {self.url}); the chunk fails, no shard is written") from e
            except (_Transient, dumpfiles.DumpTimeout, dumpfiles.DumpError) as e:
                last = e
                dumpfiles.remove_rid(self.dump_dir, rid)
                if stop.is_set():
                    raise EngineError(f"{where}: cancelled because another sample of the chunk failed") from e
                down = self.health()
                if down is not None:
                    raise EngineError(
                        f"{where}: the SGLang server at {self.url} is down (health check: {down}) after attempt "
                        f"{attempt + 1}: {e}. The chunk fails, no shard is written; rerun to restart the server."
                    ) from e
                if attempt < self.retries:
                    stop.wait(self.backoff_s * 2**attempt)
        raise EngineError(
            f"{where}: failed {self.retries + 1} times although the server at {self.url} is healthy; last error: "
            f"{last}. The chunk fails, no shard is written."
        )

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
        # default 5 ms switch interval those hand-overs, not the work, bounded the client on the H200.
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
                if self.timeline is not None:
                    self.timeline.append({"index": res.index, "yielded": time.time()})
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
