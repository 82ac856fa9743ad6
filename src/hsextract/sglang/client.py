"""The `sglang` engine: drive a patched SGLang server with many requests in flight, collect dump files.
One module, over 400 lines: the request loop, the reorder window and the shared-prefix admission share one state.

Each prompt becomes one `/generate` request (token ids, `max_new_tokens` 0, a unique rid); the server's
hsextract plugin writes that request's hidden states to the dump directory, and this client waits for
the `.done` marker, checks the ids, assembles the pieces and deletes the files. Requests run on
`concurrency` threads (`sglang.api`); results come back in input order through a bounded reorder
window. A failed request is retried with exponential backoff (`api.retrying`); after `retries` retries,
or as soon as the server fails its health check, the chunk fails with an EngineError saying which.

Shared prefixes (`share_prefixes`, docs/SHARED_PREFIX.md section 5; the server runs with its radix cache on and
HSEXTRACT_SHARED_PREFIX=1): a prompt with a parent is sent only once the dump of its source (the parent, or the
ancestor whose request computed the shared prefix's last token: `_Admission`) is collected, so the prefix's keys
and values are in SGLang's prefix cache and the request computes only from its cache hit m on.
The slots are filled from every family's ready prompts in chunk order (`_Admission`). Each request carries a
cache key (`extra_key`: SGLang 0.5.16's GenerateReqInput field, sglang/srt/managers/io_struct.py:271, which
namespaces the radix tree, mem_cache/radix_cache.py:356-367) unique to this extract() call and to the
prompt's family: a hit then comes only from this attempt's own requests of the family, never from another
chunk, an earlier run or the common template opening of an unrelated sample. The rows [m, n) are stored
with the reference (parent, m) when 0 < m <= prefix_len, as a root when m = 0; m > prefix_len (a retry that
matches its own partial pass) sends the prompt again under a fresh key, computed in full, and its
descendants then use that key.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import os
import re
import secrets
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol

from hsextract.engines.base import Captured, CaptureSpec, Engine, Prompt, check_references
from hsextract.errors import ConfigError, EngineError
from hsextract.layers import HIDDEN_STATES, UNRECORDED, describe
from hsextract.sglang.api import RequestRefused, ServerGone, SGLangAPI, TransientError, retrying
from hsextract.sglang_plugin import dumpcheck, dumpfiles
from hsextract.sglang_plugin.dumpcheck import verify_dir
from hsextract.sglang_plugin.settings import DEFAULT_RID_PREFIX as RID_PREFIX  # the plugin dumps these rids only

# Failures worth another attempt: the request (TransientError) or its dump files (missing, late, broken).
RETRYABLE = (TransientError, dumpfiles.DumpTimeout, dumpfiles.DumpError)


# The prompts sent or collected and not yet handed on in input order (the reorder window) hold their rows in RAM,
# in the server's dump directory and then here: at most this many bytes of them together (at 2 bytes a value), the
# first always. Kimi-K2.5's 2 x 64 samples of 128k tokens would be close to a TB; samples of a few thousand tokens
# never reach it.
HELD_BYTES = 32 << 30


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
        share_prefixes: bool = False,
        on_close: Callable[[], Any] | None = None,
    ) -> None:
        self._on_close = on_close  # the launcher's replica claim, released when the job is done with it
        self._gone: Callable[..., str | None] | None = None  # ServerHandle.gone
        if isinstance(server, str):
            url = server
        else:
            url = server.url
            dump_dir = dump_dir or server.dump_dir
            # a server started by the launcher: the key it made or was given (ServerHandle.api_key), sent only
            # while that server lives (ServerHandle.gone)
            api_key = api_key if api_key is not None else getattr(server, "api_key", None)
            self._gone = getattr(server, "gone", None)
        if dump_dir is None:
            raise ConfigError("sglang engine: dump_dir is required with server_url (the directory the server's "
                              "HSEXTRACT_DUMP_DIR names, on this machine)")
        if spec.final_state not in ("pre_norm", "post_norm", "both"):
            raise ConfigError(f"final_state: {spec.final_state!r}; use pre_norm or post_norm")
        if concurrency < 1 or retries < 0 or timeout_s <= 0:
            raise ConfigError("sglang engine: concurrency >= 1, retries >= 0 and timeout_s > 0 are required")
        self.api = SGLangAPI(url, timeout_s, api_key=api_key, gone=self._gone)
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
        # the prompts' references are used (parent first, rows from the radix-cache hit); the server must run in
        # shared-prefix mode (its marker says so), and a flat run's server must not
        self.share_prefixes = share_prefixes
        safe_run = re.sub(r"[^A-Za-z0-9_.-]", "_", run_name)[:100] or "run"  # the schema's run_name, whole
        # unique per engine instance and per extract() call (the "-x<n>" part): a rid is never sent twice,
        # also when extract() runs twice on one engine with the same prompt indices (a warm-up, then the
        # run): a rid the plugin already completed would wait for a `.done` marker that never comes.
        # this chunk's, by any attempt of its job: one job at a time extracts a chunk of a run. The working
        # folder's hash keeps apart two projects with one run_name on one external server (each sweeps its own)
        where = hashlib.sha256(os.fsencode(os.path.realpath(os.getcwd()))).hexdigest()[:8]
        self._chunk_rids = f"{RID_PREFIX}{safe_run}.{where}-c{chunk:05d}-"
        self._rid_base = f"{self._chunk_rids}{secrets.token_hex(4)}"
        self._calls = itertools.count()
        self._marker: dict | None = None
        # `concurrency` bounds the requests the server holds, not the threads: a request's thread frees
        # its slot when the HTTP answer comes and then collects the dump, so the server's queue stays
        # full while dumps are read (collecting inside the slot starves the GPU at short prompts).
        self._http_slots = threading.BoundedSemaphore(concurrency)

    def close(self) -> None:
        # dumps of requests given up (a timeout, a failed chunk's cancelled requests: collect removes only what it
        # reads), landed by now, of this attempt or an earlier one of the chunk's job
        dumpfiles.remove_prefixed(self.dump_dir, self._chunk_rids)
        if self._on_close is not None:
            release, self._on_close = self._on_close, None
            release()

    def lost_prefixes(self) -> str:
        return ("the server's radix cache no longer held the whole prefix when the sample ran (evicted for other "
                "requests, or cut to its page size): a larger --mem-fraction-static, or fewer requests in flight, "
                "keeps more")

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
            if bool(info.get("shared_prefix", False)) != self.share_prefixes:
                have = "on (HSEXTRACT_SHARED_PREFIX=1)" if info.get("shared_prefix") else "off"
                want = ("on (share_prefixes: true; a server started with HSEXTRACT_SHARED_PREFIX=1 and without "
                        "--disable-radix-cache)" if self.share_prefixes else
                        "off (share_prefixes: false; a server started with --disable-radix-cache)")
                raise EngineError(f"the server at {self.url} runs with shared prefixes {have}, this run needs them "
                                  f"{want}; restart the server with this run's settings")
            self._marker = info
        return self._marker

    def version(self) -> str:
        info = self.plugin_info()
        return (f"sglang {info.get('sglang_version')} + hsextract plugin {info.get('plugin_version')} "
                f"(capture {info.get('capture')})")

    # ---- HTTP -----------------------------------------------------------------------------------------
    def _generate(self, rid: str, ids: list[int], cache_key: str | None = None) -> dict:
        payload: dict[str, Any] = {
            "rid": rid,
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0.0},
        }
        if cache_key is not None:  # the radix namespace of this request (module docstring)
            payload["extra_key"] = cache_key
        try:
            out = self.api.generate(payload)
        except RequestRefused as e:
            raise _Fatal(str(e)) from e
        meta = out.get("meta_info") or {}
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":
            # SGLang answers 200 for a request aborted without a status (/abort_request): nothing will be dumped
            raise TransientError(f"the server aborted request {rid}: {finish.get('message') or 'no reason given'}")
        got = meta.get("prompt_tokens")
        if got is not None and got != len(ids):
            raise _Fatal(f"the server counted {got} prompt tokens, the prompt has {len(ids)}")
        return out

    def _collect(self, rid: str, ids: list[int], stop: threading.Event) -> dumpfiles.Collected:
        """The request's dump files, read and removed (waits for the plugin's `.done` marker)."""
        return dumpfiles.collect(self.dump_dir, rid, ids, self.spec.num_tensors, self.timeout_s,
                                 should_stop=stop.is_set, allow_start=self.share_prefixes)

    def health(self) -> str | None:
        """None when the server started for this run still holds its port and GET /health answers 200, else why
        not (a port another process took after the server died answers /health too)."""
        gone = self._gone(True) if self._gone is not None else None
        return gone if gone is not None else self.api.health(self.health_timeout_s)

    # ---- one prompt -----------------------------------------------------------------------------------
    def _attempt(self, p: Prompt, ids: list[int], rid: str, stop: threading.Event,
                 cache_key: str | None = None) -> Captured:
        with self._http_slots:
            self._generate(rid, ids, cache_key)
        got = self._collect(rid, ids, stop)
        hs = got.hidden_states
        expected_h = (self._marker or {}).get("hidden_size")
        if expected_h and hs[0].shape[1] != expected_h:
            raise _Fatal(f"dumped hidden size {hs[0].shape[1]}, the model's is {expected_h}")
        return Captured(index=p.index, sample_id=p.sample_id, hidden_states=hs, start=got.start)

    def _shared_attempt(self, p: Prompt, ids: list[int], rid: str, stop: threading.Event,
                        cache_key: str) -> tuple[Captured, str]:
        """One attempt in shared-prefix mode: the rows from the cache hit m on if m <= prefix_len, else (a hit
        on this prompt's own partial pass of an earlier attempt) the whole prompt again under a fresh cache key;
        returns the result and the key its rows were computed under (its children's)."""
        got = self._attempt(p, ids, rid, stop, cache_key)
        if got.start <= p.prefix_len:
            return got, cache_key
        fresh = f"{rid}-full"
        got = self._attempt(p, ids, fresh, stop, fresh)
        if got.start:
            raise _Fatal(f"the server matched {got.start} cached tokens of a request under the fresh cache key "
                         f"{fresh!r}: it does not keep its prefix cache apart by extra_key, so the rows it skips "
                         "may come from anywhere; use an SGLang whose /generate takes extra_key (0.5.16 to 0.5.23)")
        return got, fresh

    def _one(self, p: Prompt, stop: threading.Event, base: str,
             cache_key: str | None = None) -> tuple[Captured, str | None]:
        """The prompt's Captured and the cache key its rows were computed under (None outside shared mode)."""
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
                        if cache_key is None:
                            return self._attempt(p, ids, rid, stop), cache_key
                        return self._shared_attempt(p, ids, rid, stop, cache_key)
                    except ServerGone as e:
                        self._remove(rid)
                        raise EngineError(f"{where}: {e}. The chunk fails, no shard is written; rerun to restart "
                                          "the server.") from e
                    except _Fatal as e:
                        self._remove(rid)
                        raise EngineError(f"{where}: {e} (server {self.url}); the chunk fails, no shard is "
                                          "written") from e
                    except RETRYABLE as e:
                        self._remove(rid)
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
            times = "once" if self.retries == 0 else f"{self.retries + 1} times"
            raise EngineError(
                f"{where}: failed {times} although the server at {self.url} is healthy; last error: {last}. The "
                "chunk fails, no shard is written."
            ) from last
        raise AssertionError("unreachable: retrying() returns or raises")

    def _remove(self, rid: str) -> None:
        """Delete the dump files of an attempt and of its fresh-key resend."""
        dumpfiles.remove_rid(self.dump_dir, rid)
        dumpfiles.remove_rid(self.dump_dir, f"{rid}-full")

    # ---- many prompts ---------------------------------------------------------------------------------
    def extract(self, prompts: Iterable[Prompt]) -> Iterator[Captured]:
        self.plugin_info()
        # what an earlier attempt of this chunk's job left (its late dumps): the server's dump dir is RAM, and
        # a chunk is extracted by one job at a time
        dumpfiles.remove_prefixed(self.dump_dir, self._chunk_rids, keep=self._rid_base)
        base = f"{self._rid_base}-x{next(self._calls)}"
        items = list(prompts)
        if self.share_prefixes:
            check_references(items)
        row = int((self._marker or {}).get("hidden_size") or 0) * self.spec.num_tensors * 2  # bf16 or wider
        plan = _Admission(items, self.share_prefixes, 2 * self.concurrency, HELD_BYTES // row if row else None)
        keys: dict[int, str | None] = {}  # position -> the cache key its rows were computed under
        stop = threading.Event()
        running: dict[Future[tuple[Captured, str | None]], int] = {}
        finished: dict[int, Future[tuple[Captured, str | None]]] = {}
        # one thread more than the window: the first unyielded prompt is admitted even when the window is busy
        pool = ThreadPoolExecutor(max_workers=plan.window + 1, thread_name_prefix="hsx-sglang")
        # Dozens of threads each take the GIL back after every blocking call (socket, file, zstd); at the
        # default 5 ms switch interval those hand-overs, not the work, bound the client.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, 0.0005))
        try:
            while plan.head < len(items):
                for k in plan.admit(len(running)):
                    p = items[k]
                    key = None
                    if self.share_prefixes:  # a root starts its family's namespace, a child takes its source's
                        key = f"{base}-f{p.index}" if p.parent < 0 else keys[plan.source[k]]
                    running[pool.submit(self._one, p, stop, base, key)] = k
                if plan.head in finished:  # in input order; a failure is raised when its turn comes
                    res, _ = finished.pop(plan.head).result()
                    plan.yielded()
                    if self.progress is not None:
                        self.progress(1)
                    yield res
                    continue
                if not running:  # the head is always admissible (_Admission): something must be in flight
                    raise AssertionError(f"sglang client: nothing in flight at sample {plan.head}")
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in done:
                    k = running.pop(f)
                    finished[k] = f
                    if f.exception() is None:
                        keys[k] = f.result()[1]
                        plan.captured(k)
        except BaseException:
            stop.set()
            for f in running:
                f.cancel()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            sys.setswitchinterval(switch)


class _Admission:
    """Which prompts may be sent, in which order, while results go out in input order.

    Flat: in input order, at most `window` prompts sent and not yet yielded (a bounded reorder buffer, as
    many samples in memory). Shared prefixes: a prompt becomes ready when its *source* is captured: the nearest
    ancestor (its parent, or above) whose own rows hold position prefix_len - 1, so whose request put the whole
    prefix in the cache. Not always the parent: one whose own rows start after prefix_len - 1 (it took them from
    its own ancestor) put none of them there; rare since prepare's ties go to the shallower candidate. A hit
    m <= prefix_len still holds (docs/SHARED_PREFIX.md 5.5, with the source for the parent: a sample sharing more
    than prefix_len tokens with the prompt comes later in the chunk, and so does every node between it and its own
    source, which therefore shares as many: by induction none runs before the prompt is captured). The lowest ready
    position goes first (so every family's frontier fills the slots), at most `window` requests at once, and the
    rows held (sent or collected, not yet yielded: seq - prefix_len each) at most `window` x the mean prompt
    length, the memory the flat window holds. In both, the rows held at most `max_rows` (HELD_BYTES of them). The
    first unyielded prompt is always admitted: its source, earlier, has been yielded, so the chunk always makes
    progress."""

    def __init__(self, items: Sequence[Prompt], shared: bool, window: int, max_rows: int | None = None) -> None:
        self.window, self.shared, self.head, self.max_rows = window, shared, 0, max_rows
        pos = {p.index: k for k, p in enumerate(items)}
        parent = [pos[p.parent] if shared and p.parent >= 0 else -1 for p in items]
        start = [p.prefix_len if pp >= 0 else 0 for p, pp in zip(items, parent, strict=True)]
        # source[k]: the nearest ancestor whose first own row is below prefix_len; it is also the nearest ancestor
        # with a smaller start, so the walk jumps from source to source (linear overall)
        self.source = [-1] * len(items)
        for k, pp in enumerate(parent):
            x = pp
            while x >= 0 and start[x] >= start[k]:
                x = self.source[x]
            self.source[k] = x
        self.children: dict[int, list[int]] = {}
        self.ready: list[int] = []
        for k, src in enumerate(self.source):
            if src >= 0:
                self.children.setdefault(src, []).append(k)
            else:
                self.ready.append(k)  # ascending: already a heap
        self.cost = [len(p.input_ids) - s for p, s in zip(items, start, strict=True)]
        total = sum(len(p.input_ids) for p in items)
        self.budget = window * -(-total // max(1, len(items))) if shared else None
        self.held = self.held_rows = 0  # admitted and not yet yielded: prompts, rows

    def admit(self, running: int) -> Iterator[int]:
        """The positions to send now, given `running` requests in flight."""
        while self.ready:
            k = self.ready[0]
            if k != self.head:
                if self.max_rows is not None and self.held_rows + self.cost[k] > self.max_rows:
                    return
                if self.budget is None and self.held >= self.window:
                    return
                if self.budget is not None and (running >= self.window or self.held_rows + self.cost[k] > self.budget):
                    return
            heapq.heappop(self.ready)
            self.held += 1
            self.held_rows += self.cost[k]
            running += 1
            yield k

    def captured(self, k: int) -> None:
        """Prompt k's rows are in: the prompts it is the source of may go."""
        for c in self.children.pop(k, ()):
            heapq.heappush(self.ready, c)

    def yielded(self) -> None:
        self.held -= 1
        self.held_rows -= self.cost[self.head]
        self.head += 1
