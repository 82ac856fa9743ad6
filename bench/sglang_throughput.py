"""Prefill throughput of hsextract's capture path against SGLang baselines, side by side, in one GPU call.

(b) hsextract: plugin capture + sglang engine client (`--concurrency` in flight), shards written
    (b0: the same without writing shards, to separate the shard encoder's cost)
(a) plain server, no capture, max_new_tokens 1, `--concurrency` in flight
(c) SGLang's own `return_hidden_states` JSON API (final state only, as JSON), same concurrency
(d) the hand-made approach's bound: one request at a time (client concurrency 1) to the plain server, no
    capture, nothing saved: what any one-prompt-at-a-time loop can reach at best
(d') the hand-made approach itself (`d_handmade_pt`): one prompt at a time through the capturing server,
    each sample saved as its own raw .pt (a speculators v1 dict, torch.save), as users write it today
(e) the transformers engine's way on the same GPU: HF forward with output_hidden_states, batch 8

Length: every part and the server set-ups they share in one script, so that one device call runs them
side by side (the comparison is the figure, and parts alternate with --repeats).

Server B (hsextract plugin) serves (b), (b0), (d') and runs first: it is the part not measured yet. Server A
(no plugin, --enable-return-hidden-states) serves (a), (c), (d). Every part also records the CPU it used (the
whole machine's busy cores and the client's own); --profile samples GIL holders with py-spy. Weights:
`--load-format dummy` from a config-only model dir (Llama-3-8B shape by default).

Every part runs under a wall-clock budget (`--budget-s`) and in its own try block: a failure or a skipped
part is recorded and the rest goes on. OUT/throughput.json is rewritten after every part (partial results
survive a kill); OUT/throughput.md holds the table of prompt tokens/s and the ratios the issue targets
(b/a >= 0.90, b/c >= 10, b/d >= 3 at 512 tokens). For diagnosis, OUT/capture-dump/ receives the plugin's
`plugin-*.json` and `stats-*.json` and a listing of the dump dir, and OUT/error-<part>-<len>.txt the
client's error with its traceback. Run on the GPU through bench/gpu/run_throughput.sh.

CPU dry run of the whole script against tests/fake_sglang.py (no GPU, no SGLang):
    PYTHONPATH=src:tests python bench/sglang_throughput.py --model DIR_WITH_CONFIG_JSON \\
        --server-module fake_sglang --skip-hf --lens 64 --n 48 --out /tmp/tp
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from hsextract.atomic import write_bytes_atomic
from hsextract.engines.base import Captured, CaptureSpec, Prompt
from hsextract.sglang.api import health
from hsextract.sglang.client import SGLangEngine
from hsextract.sglang.server import ServerConfig, ensure_server, stop_servers
from hsextract.sglang_plugin import dumpfiles

DEFAULT_SGL_ARGS = ("--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.6 "
                    "--disable-decode-cuda-graph --load-format dummy --dtype bfloat16 "
                    "--cuda-graph-bs-prefill 512 1024 2048 4096 8192")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    return [Prompt(i, f"{length}-{i}", torch.randint(0, vocab, (length,), generator=g).tolist()) for i in range(n)]


def http_run(port: int, prompts: list[Prompt], concurrency: int, extra: dict | None = None,
             timeout_s: float = 120) -> dict:
    """POST every prompt to /generate with `concurrency` in flight; wall time first send -> last reply.

    A fresh connection per request, as the sglang engine does (a kept-alive one can go stale)."""
    nbytes, lat = [0], []
    lock = threading.Lock()

    def one(p: Prompt) -> None:
        body = {"input_ids": p.input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        body.update(extra or {})
        t = time.monotonic()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        try:
            c.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
        finally:
            c.close()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
        with lock:
            nbytes[0] += len(data)
            lat.append(time.monotonic() - t)

    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, prompts))
    wall = time.monotonic() - t0
    toks = sum(len(p.input_ids) for p in prompts)
    return {"n": len(prompts), "tokens": toks, "wall_s": wall, "tok_s": toks / wall,
            "latency_ms": 1000 * sum(lat) / len(lat), "bytes_per_response": nbytes[0] / len(prompts)}


def start_plain(python: str, module: str, model: str, port: int, args: list[str], log_path: Path,
                timeout_s: float) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSEXTRACT_") and k != "SGLANG_PLUGINS"}
    cmd = [python, "-m", module, "--model-path", model, "--host", "127.0.0.1", "--port", str(port),
           "--disable-radix-cache", "--skip-tokenizer-init", "--enable-return-hidden-states", *args]
    p = subprocess.Popen(cmd, env=env, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while health(f"http://127.0.0.1:{port}", 2.0) is not None:
        if p.poll() is not None or time.monotonic() > deadline:
            _kill(p)
            raise RuntimeError(f"plain server did not start in {timeout_s:.0f} s (exit {p.poll()}); see {log_path}")
        time.sleep(1)
    return p


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def cpu_snapshot() -> tuple[float, float, float, float]:
    """(machine busy jiffies, machine total jiffies, this process's CPU seconds, monotonic time)."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy, total = float(sum(v) - v[3] - v[4]), float(sum(v))  # idle and iowait are not busy
    except (OSError, ValueError, IndexError):
        busy = total = 0.0
    t = os.times()
    return busy, total, t.user + t.system, time.monotonic()


def proc_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (name, user+system clock ticks) of every process (SGLang names its own: sglang::scheduler...)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text(encoding="utf-8")
            name = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").rsplit("/", 1)[-1][:40]
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(d.name)] = (name or stat[stat.index("(") + 1 : stat.rindex(")")], int(fields[11]) + int(fields[12]))
    return out


def cpu_use(before: tuple[float, float, float, float], procs: dict[int, tuple[str, int]]) -> dict:
    """CPU used since `before`, in cores: the whole machine (server, client, all), this client process, and
    the processes that used the most (which of the server's processes pays for the capture)."""
    after = cpu_snapshot()
    wall = max(after[3] - before[3], 1e-9)
    total = after[1] - before[1]
    machine = (after[0] - before[0]) / total * (os.cpu_count() or 1) if total > 0 else None
    hz = os.sysconf("SC_CLK_TCK")
    top = sorted(((t - procs[pid][1] if pid in procs else t, f"{name}[{pid}]")
                  for pid, (name, t) in proc_ticks().items()), reverse=True)[:8]
    cores = {name: round(d / hz / wall, 2) for d, name in top}
    return {"machine_busy_cores": None if machine is None else round(machine, 2),
            "client_cores": round((after[2] - before[2]) / wall, 2), "cpus": os.cpu_count(),
            "top": {name: c for name, c in cores.items() if c > 0}}


class Profile:
    """`py-spy record --gil` of a process for a while (HSX_PYSPY names the binary): which code holds the
    GIL, as collapsed stacks; samples / (rate x seconds) is the share of time the GIL was held at all."""

    RATE = 100

    def __init__(self, out: Path, name: str, pid: int, seconds: float, enabled: bool = True) -> None:
        self.path, self.proc, self.seconds = out / "profiles" / f"{name}.txt", None, seconds
        exe = os.environ.get("HSX_PYSPY")
        if not enabled or not exe:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [exe, "record", "--pid", str(pid), "--rate", str(self.RATE), "--duration", str(int(seconds)),
               "--gil", "--nonblocking", "--format", "raw", "-o", str(self.path)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                     stderr=open(self.path.with_suffix(".log"), "w", encoding="utf-8"))

    def result(self) -> dict | None:
        if self.proc is None:
            return None
        try:
            self.proc.wait(self.seconds + 20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        try:
            samples = sum(int(line.rsplit(" ", 1)[1]) for line in self.path.read_text(encoding="utf-8").splitlines()
                          if line.strip())
        except (OSError, ValueError, IndexError):
            return {"file": self.path.name, "error": self.path.with_suffix(".log").read_text(encoding="utf-8",
                                                                                          errors="replace")[-300:]}
        return {"file": self.path.name, "gil_samples": samples,
                "gil_held_share": round(samples / (self.RATE * self.seconds), 3)}


def hf_run(model_dir: str, length: int, batches: int, batch: int, aux: tuple[int, ...]) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg).eval()
    torch.set_default_dtype(torch.float32)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, length), device="cuda", generator=g)
    with torch.no_grad():
        m(x[:1, :64], output_hidden_states=True)  # warm-up
        torch.cuda.synchronize()
        t0 = time.monotonic()
        for _ in range(batches):
            out = m(x, output_hidden_states=True, logits_to_keep=1)
            keep = [out.hidden_states[a].cpu() for a in aux] + [out.hidden_states[-1].cpu()]
        torch.cuda.synchronize()
        wall = time.monotonic() - t0
    del m, out, keep
    torch.cuda.empty_cache()
    return {"n": batches * batch, "tokens": batches * batch * length, "wall_s": wall,
            "tok_s": batches * batch * length / wall, "note": "includes the copy of the 4 tensors to the CPU"}


class Bench:
    """Results, budget and failure bookkeeping; throughput.json is rewritten after every part."""

    def __init__(self, out: Path, budget_s: float, res: dict) -> None:
        self.out, self.res = out, res
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        res.setdefault("runs", {})
        res.setdefault("errors", {})
        res.setdefault("skipped", {})

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.res["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        write_bytes_atomic(self.out / "throughput.json", json.dumps(self.res, indent=1, default=str).encode())

    def part(self, key: str, L: int | str, fn: Callable[[], dict], need_s: float) -> dict | None:
        """Run one measurement if `need_s` seconds of budget are left; record its result or its error."""
        if self.left() < need_s:
            why = f"budget: {self.left():.0f} s left, part needs ~{need_s:.0f} s"
            self.res["skipped"].setdefault(key, {})[str(L)] = why
            log(f"SKIP {key} {L}: {why}")
            self.save()
            return None
        log(f"start {key} {L} ({self.left():.0f} s of budget left)")
        t = time.monotonic()
        procs, cpu0 = proc_ticks(), cpu_snapshot()
        try:
            r = fn()
            r["cpu"] = cpu_use(cpu0, procs)
        except Exception as e:  # noqa: BLE001 - recorded; the other parts still run
            tb = traceback.format_exc()
            self.res["errors"].setdefault(key, {})[str(L)] = f"{type(e).__name__}: {e}"
            (self.out / f"error-{key}-{L}.txt").write_text(tb, encoding="utf-8")
            log(f"FAIL {key} {L} after {time.monotonic() - t:.1f} s: {type(e).__name__}: {str(e)[:600]}")
            self.save()
            return None
        self.res["runs"].setdefault(key, {})[str(L)] = r
        log(f"done {key} {L}: " + ", ".join(f"{k}={round(v, 1) if isinstance(v, float) else v}"
                                          for k, v in r.items() if not isinstance(v, dict)))
        self.save()
        return r


def progress_printer(label: str, total: int, every: int = 64) -> Callable[[int], None]:
    n, t0 = [0], time.monotonic()

    def tick(k: int) -> None:
        n[0] += k
        if n[0] % every == 0 or n[0] == total:
            log(f"  {label}: {n[0]}/{total} samples, {time.monotonic() - t0:.1f} s")

    return tick


class TimedEngine(SGLangEngine):
    """SGLangEngine that records, per sample, when (wall clock) it was queued, sent, answered, dumped by
    the plugin (the `.done` marker's `staged_at` / `written_at`), collected and yielded, while `timeline`
    is a list: where a slow run loses its time. Each sample's steps run on one worker thread."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.timeline: list[dict] | None = None
        self._current = threading.local()

    def _one(self, p: Prompt, stop: threading.Event, base: str,
             cache_key: str | None = None) -> tuple[Captured, str | None]:
        row = {"index": p.index, "tokens": len(p.input_ids), "queued": time.time()}
        self._current.row = row
        res = super()._one(p, stop, base, cache_key)
        if self.timeline is not None:
            self.timeline.append(row)
        return res

    def _generate(self, rid: str, ids: list[int], cache_key: str | None = None) -> dict:
        row = self._current.row
        row["sent"] = time.time()
        out = super()._generate(rid, ids, cache_key)
        row["answered"] = time.time()
        return out

    def _collect(self, rid: str, ids: list[int], stop: threading.Event) -> dumpfiles.Collected:
        col = super()._collect(rid, ids, stop)
        self._current.row.update(staged=col.marker.get("staged_at"), written=col.marker.get("written_at"),
                                 lane=col.marker.get("lane"), collected=time.time())
        return col

    def extract(self, prompts: Iterable[Prompt]) -> Iterator[Captured]:
        for res in super().extract(prompts):
            if self.timeline is not None:
                self.timeline.append({"index": res.index, "yielded": time.time()})
            yield res


def timeline_summary(events: list[dict], dest: Path) -> dict:
    """Where the samples' time went (TimedEngine.timeline): writes the raw events to `dest`, returns
    medians/max of each step and when (s after the first request was queued) the last sample reached it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(events), encoding="utf-8")
    by: dict[int, dict] = {}
    for e in events:
        by.setdefault(e["index"], {}).update(e)
    rows = [r for r in by.values() if "collected" in r and "yielded" in r]
    if not rows:
        return {}
    t0 = min(r["queued"] for r in rows)
    steps = {"slot_wait": ("queued", "sent"), "http": ("sent", "answered"), "write": ("staged", "written"),
             "marker_after_answer": ("answered", "written"), "collect_after_marker": ("written", "collected"),
             "yield_after_collect": ("collected", "yielded")}
    out: dict = {}
    for name, (a, b) in steps.items():
        d = sorted(r[b] - r[a] for r in rows if r.get(a) is not None and r.get(b) is not None)
        if d:
            out[name] = {"median": round(d[len(d) // 2], 4), "p90": round(d[int(len(d) * 0.9)], 4),
                         "max": round(d[-1], 4)}
    for k in ("answered", "written", "collected", "yielded"):
        v = [r[k] for r in rows if r.get(k) is not None]
        if v:
            out[f"last_{k}_s"] = round(max(v) - t0, 3)
    return out


def save_dump_diagnostics(dump_dir: Path, dest: Path, label: str) -> None:
    """The plugin's marker and stats files and a listing of the dump dir (what was left, how big)."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        entries = sorted(dump_dir.iterdir())
    except OSError as e:
        (dest / f"listing-{label}.txt").write_text(f"cannot list {dump_dir}: {e}\n", encoding="utf-8")
        return
    for p in entries:
        if p.name.startswith(("plugin-", "stats-")) and p.suffix == ".json":
            shutil.copyfile(p, dest / f"{label}-{p.name}")
    lines = [f"{dump_dir}: {len(entries)} entries"]
    for p in entries[:200]:
        try:
            lines.append(f"{p.stat().st_size:>12} {p.name}")
        except OSError:
            lines.append(f"{'?':>12} {p.name}")
    try:
        du = shutil.disk_usage(dump_dir)
        lines.append(f"filesystem: total {du.total >> 20} MiB, free {du.free >> 20} MiB")
    except OSError:
        pass
    (dest / f"listing-{label}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def capture_parts(a: argparse.Namespace, bench: Bench, sets: dict[int, list[Prompt]], aux: tuple[int, ...],
                  sgl: list[str]) -> None:
    """(b0), (b) and (d') on server B (the hsextract plugin); (b) again at the other --shard-threads."""
    from shard_meta import placeholder_metadata  # bench/ is the script's folder

    from hsextract.extract.run import ChunkPrompts, extract_chunk

    state = Path(a.state)
    cfg = ServerConfig(model=a.model, aux_layers=aux, python=sys.executable, port=a.port + 1, capture="plugin",
                       launch_args=tuple(sgl), run_name="bench", module=a.server_module,
                       startup_timeout_s=max(180.0, min(300.0, bench.left() - 60)), staging_mb=a.staging_mb,
                       writer_threads=a.writer_threads, prefill_cuda_graph=a.prefill_cuda_graph,
                       final_state=a.final_state)
    spec = CaptureSpec(aux_layers=aux, final_state=a.final_state)
    dump = bench.out / "capture-dump"
    t = time.monotonic()
    h = None
    try:
        h = ensure_server(state, cfg)
        bench.res["startup_capture_s"] = round(time.monotonic() - t, 1)
        log(f"capture server up in {bench.res['startup_capture_s']} s, dump dir {h.dump_dir}")
        save_dump_diagnostics(h.dump_dir, dump, "start")

        def timeout() -> float:  # per request: fail fast, and never past the budget
            return max(10.0, min(a.request_timeout_s, bench.left() - 30))

        first = (a.concurrency[0], a.lens[0])

        def b0(L: int, ps: list[Prompt], cc: int, name: str) -> dict:
            eng = TimedEngine(h, spec, concurrency=cc, timeout_s=timeout(), retries=0, run_name=f"w{L}")
            list(eng.extract(ps[:cc]))  # warm-up; the same engine again below (fresh rids)
            eng.progress = progress_printer(f"{name} {L}", len(ps))
            eng.timeline = []
            # the scheduler process (its pid is in the plugin's marker): what holds its GIL while capturing
            prof = Profile(bench.out, f"scheduler-{name}-{L}", eng.plugin_info()["pid"], a.profile_s, a.profile) \
                if (cc, L) == first else None
            t0 = time.monotonic()
            nbytes = sum(sum(x.numel() * x.element_size() for x in c.hidden_states) for c in eng.extract(ps))
            wall = time.monotonic() - t0
            toks = sum(len(p.input_ids) for p in ps)
            tl = timeline_summary(eng.timeline, bench.out / "timelines" / f"{name}-{L}.json")
            log(f"  timeline: {json.dumps(tl)}")
            return {"n": len(ps), "tokens": toks, "wall_s": wall, "tok_s": toks / wall,
                    "dump_bytes_per_s": nbytes / wall, "timeline": tl, "writer": writer_stats(h.dump_dir),
                    "profile": prof.result() if prof else None}

        def b(L: int, ps: list[Prompt], cc: int, variant: str, name: str) -> dict:
            # the workflow's own extract path (extract_chunk: order and shape checks, ShardWriter, timing)
            threads, _, where = variant.partition(":")
            threads = int(threads)
            e2 = TimedEngine(h, spec, concurrency=cc, timeout_s=timeout(), retries=0,
                             run_name=f"s{L}-{threads}", progress=progress_printer(f"{name} {L}", len(ps)))
            shard = Path(where or bench.out) / f"bench-{L}.hss"
            meta = placeholder_metadata(e2.plugin_info()["hidden_size"], aux, model="llama8b-dummy",
                                        engine="sglang", engine_version=e2.version(), final_state=a.final_state)
            chunk = ChunkPrompts([p.sample_id for p in ps], [p.input_ids for p in ps],
                                 [[1] * len(p.input_ids) for p in ps])
            e2.timeline = []
            prof = Profile(bench.out, f"client-{name}-{L}", os.getpid(), a.profile_s, a.profile) \
                if (cc, L) == first and variant == a.shard_threads[0] else None
            t0 = time.monotonic()
            try:
                r = extract_chunk(chunk, shard, e2, meta, level=a.shard_level, threads=threads, progress=False)
                wall = time.monotonic() - t0
            finally:
                shard.unlink(missing_ok=True)
            size, raw = r["bytes"], r["raw_bytes"]
            tl = timeline_summary(e2.timeline, bench.out / "timelines" / f"{name}-{L}.json")
            log(f"  timeline: {json.dumps(tl)}")
            # add_s: time the consumer spent in ShardWriter.add (encoding backlog); close_s: the last
            # records, the index and the fsync. Both small against wall_s = the shard writer kept up.
            return {"n": len(ps), "tokens": r["tokens"], "wall_s": wall, "tok_s": r["tokens"] / wall,
                    "shard_bytes": size, "shard_bytes_per_s": size / wall, "raw_bytes_per_s": raw / wall,
                    "stored_over_raw": size / raw, "add_s": r["shard_add_s"], "close_s": r["shard_close_s"],
                    "encode_wait_s": r["shard_encode_wait_s"], "write_s": r["shard_write_s"],
                    "disk_s": r["shard_disk_s"],
                    "shard_threads": threads, "shard_dir": str(shard.parent), "shard_level": a.shard_level,
                    "timeline": tl,
                    "writer": writer_stats(h.dump_dir), "profile": prof.result() if prof else None}

        def handmade(L: int, ps: list[Prompt]) -> dict:
            """(d'): what users write by hand, as fast as it goes: one prompt at a time through the capturing
            server (a patched model's dump), each sample saved as its own raw .pt (speculators v1 dict)."""
            e1 = SGLangEngine(h, spec, concurrency=1, timeout_s=timeout(), retries=0, run_name=f"d{L}")
            folder = bench.out / f"handmade-{L}"
            folder.mkdir(exist_ok=True)
            nbytes, t0 = 0, time.monotonic()
            try:
                for p in ps:
                    (c,) = e1.extract([p])
                    f = folder / f"data_{p.index}.pt"
                    torch.save({"input_ids": torch.tensor(p.input_ids), "hidden_states": c.hidden_states,
                                "loss_mask": torch.ones(len(p.input_ids), dtype=torch.long)}, f)
                    nbytes += f.stat().st_size
                wall = time.monotonic() - t0
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            toks = sum(len(p.input_ids) for p in ps)
            return {"n": len(ps), "tokens": toks, "wall_s": wall, "tok_s": toks / wall, "pt_bytes": nbytes}

        for cc, (L, ps) in itertools.product(a.concurrency, sets.items()):
            b0_key, b_key = key("b0_capture_no_shards", cc, a), key("b_capture_with_shards", cc, a)
            ok = bench.part(b0_key, L, partial(b0, L, ps, cc, b0_key), need_s=40) is not None
            save_dump_diagnostics(h.dump_dir, dump, f"b0-{cc}-{L}")
            if not ok:
                continue
            bench.part(b_key, L, partial(b, L, ps, cc, a.shard_threads[0], b_key), need_s=60)
            save_dump_diagnostics(h.dump_dir, dump, f"b-{cc}-{L}")
            if "d" in a.parts and cc == a.concurrency[0]:
                bench.part("d_handmade_pt", L, partial(handmade, L, ps[: 50 if L <= 512 else 30]), need_s=30)
        # shard writer variants at every length, first concurrency, alternated --repeats times (the GPU
        # host's speed drifts between parts); the first variant's first run is the main (b) above
        cc = first[0]
        for rep in range(a.repeats):
            for L in sets:
                for i, variant in enumerate(a.shard_threads):
                    if rep == 0 and i == 0:
                        continue
                    name = f"{key('b_capture_with_shards', cc, a)}/t{variant.replace('/', '_')}#{rep + 1}"
                    bench.part(name, L, partial(b, L, sets[L], cc, variant, name), need_s=60)
        if a.repeats > 1:
            name = f"{key('b0_capture_no_shards', cc, a)}#2"
            for L in sets:
                bench.part(name, L, partial(b0, L, sets[L], cc, name), need_s=40)
    except Exception as e:  # noqa: BLE001 - the capture server did not start: recorded, the rest runs
        bench.res["errors"].setdefault("capture_server", {})["-"] = f"{type(e).__name__}: {e}"
        (bench.out / "error-capture_server.txt").write_text(traceback.format_exc(), encoding="utf-8")
        log(f"FAIL capture server: {type(e).__name__}: {str(e)[:800]}")
        bench.save()
    finally:
        if h is not None:
            save_dump_diagnostics(h.dump_dir, dump, "end")
        stop_servers(state, grace_s=10)


def key(name: str, cc: int, a: argparse.Namespace) -> str:
    """Result key: the first --concurrency keeps the plain name (the issue's ratios), others get @cc."""
    return name if cc == a.concurrency[0] else f"{name}@{cc}"


def writer_stats(dump_dir: Path, wait_s: float = 3.0) -> dict:
    """The plugin writers' counters (summed over scheduler processes): did the dump keep up?

    The writers refresh `stats-*.json` once idle for 2 s; wait (up to `wait_s`) for a file written after
    this call, so the counters include the part just measured."""
    t0, deadline = time.time(), time.monotonic() + wait_s
    while True:
        stats = dumpfiles.read_writer_stats(dump_dir)
        fresh = bool(stats) and all(st.get("time", 0) > t0 for st in stats.values())
        if fresh or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    out: dict = {"fresh": fresh}
    for st in stats.values():
        for k, v in st.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "time":
                out[k] = out.get(k, 0) + v
    return out


def plain_parts(a: argparse.Namespace, bench: Bench, sets: dict[int, list[Prompt]], sgl: list[str]) -> None:
    """(a), (c), (d) on server A (no plugin)."""
    if bench.left() < 120:
        bench.res["skipped"]["plain_server"] = {"-": f"budget: {bench.left():.0f} s left"}
        log("SKIP plain server: budget")
        bench.save()
        return
    t = time.monotonic()
    try:
        pa = start_plain(sys.executable, a.server_module, a.model, a.port, sgl, bench.out / "server-plain.log",
                         timeout_s=max(30.0, min(300.0, bench.left() - 60)))
    except Exception as e:  # noqa: BLE001 - the plain server did not start: recorded, saved
        bench.res["errors"].setdefault("plain_server", {})["-"] = f"{type(e).__name__}: {e}"
        log(f"FAIL plain server: {e}")
        bench.save()
        return
    bench.res["startup_plain_s"] = round(time.monotonic() - t, 1)
    log(f"plain server up in {bench.res['startup_plain_s']} s")
    try:
        for L, ps in sets.items():
            for cc in a.concurrency if "a" in a.parts else ():
                def run_a(ps: list[Prompt] = ps, cc: int = cc) -> dict:  # bound now: called in this iteration
                    http_run(a.port, ps[:cc], cc)  # warm-up
                    return http_run(a.port, ps, cc)

                bench.part(key("a_plain", cc, a), L, run_a, need_s=30)
            if "c" in a.parts:
                bench.part("c_return_hidden_states_json", L, partial(
                    http_run, a.port, ps[: 16 if L <= 512 else 8], a.concurrency[0], {"return_hidden_states": True}),
                    need_s=40)
            if "d" in a.parts:
                bench.part("d_one_at_a_time", L, partial(http_run, a.port, ps[: 50 if L <= 512 else 30], 1), need_s=20)
        if a.repeats > 1 and "a" in a.parts:  # the plain server again, last: how far the host drifted
            for L, ps in sets.items():
                bench.part(f"{key('a_plain', a.concurrency[0], a)}#2", L,
                           partial(http_run, a.port, ps, a.concurrency[0]), need_s=30)
    finally:
        _kill(pa)


def table(res: dict, lens: list[int], concurrency: list[int]) -> list[str]:
    R = res["runs"]
    lines = ["| run | " + " | ".join(f"{L} tok/s" for L in lens) + " |", "|---|" + "---|" * len(lens)]
    for key in R:
        lines.append(f"| {key} | " + " | ".join(f"{R[key].get(str(L), {}).get('tok_s', float('nan')):,.0f}"
                                                for L in lens) + " |")
    more = [(f"{n}@{cc}", f"a_plain@{cc}", 0.90) for cc in concurrency[1:]
            for n in ("b_capture_with_shards", "b0_capture_no_shards")]
    for num, den, target in (("b_capture_with_shards", "a_plain", 0.90),
                             ("b0_capture_no_shards", "a_plain", 0.90),
                             *more,
                             ("b_capture_with_shards", "c_return_hidden_states_json", 10),
                             ("b_capture_with_shards", "d_one_at_a_time", 3),
                             ("b_capture_with_shards", "d_handmade_pt", 3)):
        vals = []
        for L in lens:
            try:
                vals.append(f"{R[num][str(L)]['tok_s'] / R[den][str(L)]['tok_s']:.2f}")
            except KeyError:
                vals.append("-")
        lines.append(f"| {num} / {den} (target >= {target} at 512) | " + " | ".join(vals) + " |")
    # every repeat: (b) at the first --shard-threads variant and (a), first concurrency, as mean and range
    first = res["shard_threads"][0].replace("/", "_")
    runs_of = {"b": [k for k in R if k == "b_capture_with_shards" or k.startswith(f"b_capture_with_shards/t{first}#")],
               "b0": [k for k in R if k.split("#")[0] == "b0_capture_no_shards"],
               "a": [k for k in R if k.split("#")[0] == "a_plain"]}
    for num in ("b", "b0"):
        vals = []
        for L in lens:
            xs = {n: [R[k][str(L)]["tok_s"] for k in runs_of[n] if str(L) in R[k]] for n in (num, "a")}
            if not (xs[num] and xs["a"]):
                vals.append("-")
                continue
            mean = sum(xs[num]) / len(xs[num]) / (sum(xs["a"]) / len(xs["a"]))
            vals.append(f"{mean:.3f} ({min(xs[num]) / max(xs['a']):.2f}-{max(xs[num]) / min(xs['a']):.2f}; "
                        f"{len(xs[num])} x {len(xs['a'])} runs)")
        lines.append(f"| ({num})/(a), every repeat: mean over mean (range) | " + " | ".join(vals) + " |")
    for kind in ("errors", "skipped"):
        for key, per in res.get(kind, {}).items():
            for L, msg in per.items():
                lines.append(f"| {kind[:-1] if kind == 'errors' else 'skipped'}: {key} {L} | {str(msg)[:200]} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="config-only model dir (SGLang --load-format dummy)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--aux", type=int, nargs="+", default=[2, 16, 29])  # eagle3 of 32 layers (hidden_states ids)
    ap.add_argument("--lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--n", type=int, nargs="+", default=None,
                    help="prompts per length (default 1024 / 256: steady state, the start and the tail of a run "
                         "weigh as little as in a production chunk of 2048 prompts)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 64],
                    help="requests in flight; (a), (b0), (b) run at each, the first is the issue's table")
    ap.add_argument("--shard-threads", nargs="+", default=["8"],
                    help="ShardWriter threads (config shard.threads), THREADS or THREADS:DIR (where the shard goes; "
                         "default --out); (b) runs again at the first length for each further value")
    ap.add_argument("--repeats", type=int, default=1,
                    help="alternate the --shard-threads variants this many times; (b0) and (a) run again at the end")
    ap.add_argument("--shard-level", type=int, default=3, help="zstd level (config shard.compression_level)")
    ap.add_argument("--final-state", choices=["pre_norm", "post_norm"], default="pre_norm",
                    help="the captured final state (config final_state; default the workflow's, pre_norm)")
    ap.add_argument("--writer-threads", type=int, default=4, help="plugin dump writer threads (sglang.writer_threads)")
    ap.add_argument("--prefill-cuda-graph", action="store_true",
                    help="capture server on SGLang's prefill CUDA graphs (sglang.prefill_cuda_graph; default eager)")
    ap.add_argument("--sgl-args", default=DEFAULT_SGL_ARGS)
    ap.add_argument("--staging-mb", type=int, default=8192)
    ap.add_argument("--parts", default="b,a,c,d,e", help="comma-separated subset of b,a,c,d,e (b0 runs with b)")
    ap.add_argument("--skip-hf", action="store_true", help="same as leaving e out of --parts")
    ap.add_argument("--budget-s", type=float, default=440, help="wall-clock budget; later parts are skipped")
    ap.add_argument("--request-timeout-s", type=float, default=60, help="per request dump wait (client)")
    ap.add_argument("--server-module", default="sglang.launch_server", help="fake_sglang for a CPU dry run")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy (HSX_PYSPY) samples GIL holders: the scheduler during (b0), the client during (b)")
    ap.add_argument("--profile-s", type=float, default=8.0)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--state", default="/tmp/hsx-bench-state")
    a = ap.parse_args()
    a.parts = set(a.parts.split(","))
    if a.skip_hf:
        a.parts.discard("e")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((Path(a.model) / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    sgl = shlex.split(a.sgl_args)
    aux = tuple(a.aux)
    res: dict = {"model": a.model, "aux_layers": list(aux), "concurrency": a.concurrency, "sgl_args": a.sgl_args,
                 "shard_threads": a.shard_threads, "shard_level": a.shard_level, "writer_threads": a.writer_threads,
                 "prefill_cuda_graph": a.prefill_cuda_graph,
                 "staging_mb": a.staging_mb, "budget_s": a.budget_s, "parts": sorted(a.parts)}
    bench = Bench(out, a.budget_s, res)
    n_of = dict(zip(a.lens, a.n, strict=False)) if a.n else {512: 1024, 2048: 256}
    sets = {L: prompts_of(n_of.get(L, 64), L, vocab, seed=L) for L in a.lens}
    log(f"throughput bench: lens {a.lens}, prompts {[len(s) for s in sets.values()]}, parts {sorted(a.parts)}, "
        f"budget {a.budget_s:.0f} s")
    bench.save()

    def on_term(signum: int, frame: object) -> None:  # `timeout` on the device: still write table + json
        raise SystemExit(f"killed by signal {signum} after {time.monotonic() - bench.t0:.0f} s")

    signal.signal(signal.SIGTERM, on_term)
    try:
        if "b" in a.parts:
            capture_parts(a, bench, sets, aux, sgl)
        if a.parts & {"a", "c", "d"}:
            plain_parts(a, bench, sets, sgl)
        if "e" in a.parts:
            for L in a.lens:
                bench.part("e_transformers", L, partial(hf_run, a.model, L, batches=6 if L <= 512 else 3, batch=8,
                                                                aux=aux), need_s=90)
    except SystemExit as e:
        res["errors"].setdefault("script", {})["-"] = str(e)
        log(str(e))
    finally:
        lines = table(res, a.lens, a.concurrency)
        res["table"] = lines
        bench.save()
        (out / "throughput.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        print("\n".join(lines), flush=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
