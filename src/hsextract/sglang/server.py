"""Lifecycle of the patched SGLang server(s): start-or-reuse from extraction jobs, stop from onsuccess/onerror.

Length: the command and environment a server is launched with, and the start, reuse and stop that read
them back (the state file, the process group, the dump directory, the lock), are one module because reuse
is decided by comparing what runs with what would be launched; the key file and log scrubbing, which stand
alone, are keyfile.py and logscrub.py.

Start-or-reuse, not a Snakemake service job: each extraction job calls `ensure_server(state_dir, cfg, replica)`,
which takes a file lock (filelock) on `state_dir/replica-<r>.lock`, reuses the server named by
`replica-<r>.json` if its process is alive, answers GET /health and its plugin marker is in place, and
otherwise kills what is left (its whole process group) and starts a fresh one in its own process group. The
Snakefile's `onsuccess:`/`onerror:` call `stop_servers(state_dir)` (and `onstart:` too, which kills a
server orphaned by a `kill -9` of Snakemake). The server is not a DAG input.

Each server gets a private dump directory (mode 0700, unpredictable name, under /dev/shm when it
exists), removed when the server is stopped. Replicas: replica r listens on port+r and sees the GPUs
gpus[r*tp:(r+1)*tp] through CUDA_VISIBLE_DEVICES; an extract job claims the lowest-numbered replica no running
job holds (claim_replica: extract jobs ask for tp GPUs each, so a pool of tp x replicas runs them side by side,
one per replica). With
`server_url` nothing is started (hsextract.sglang.config `external_urls`: servers that run elsewhere, whose
dump directory must be visible here).

The door: each server started here requires an API key (the one in the file `sglang.api_key_file` names,
else a random one), which reaches it through a 0600 file named by SGLang's `--config` (hsextract.sglang.keyfile
says why not a flag or the environment); its output reaches its log through hsextract.sglang.logscrub, which
hides the key. The launcher owns the flags that decide where the server listens and what it captures:
`sglang.launch_args` may not set them (LAUNCHER_FLAGS), and a non-loopback host without a key file is refused
(build_command).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import filelock
import psutil

from hsextract.atomic import write_bytes_atomic
from hsextract.config.guard import is_loopback
from hsextract.config.redaction import flag_meant, redact_command, redact_text
from hsextract.config.stale_lock import process_start
from hsextract.errors import ConfigError, EngineError
from hsextract.sglang import keyfile
from hsextract.sglang.api import health, split_url
from hsextract.sglang_plugin import dumpfiles
from hsextract.sglang_plugin import settings as ps
from hsextract.sglang_plugin.dumpcheck import DumpDirError, private_dir, verify_dir

DUMP_DIR_PREFIX = "hsx-"
# the longest a started server's port goes unchecked while its key is sent (ServerHandle.gone)
PORT_CHECK_S = 1.0


@dataclass(frozen=True)
class ServerConfig:
    model: str
    aux_layers: tuple[int, ...]
    python: str = sys.executable  # the server environment's interpreter
    final_state: str = field(kw_only=True)  # no default, as CaptureSpec's: the server's and the client's must agree
    host: str = "127.0.0.1"
    # the key the server requires (read from the file config sglang.api_key_file names); None: ensure_server makes
    # a random one. It reaches the server in a 0600 file (hsextract.sglang.keyfile), never on the command line, in
    # a log or a state file
    api_key: str | None = field(default=None, repr=False)
    port: int = 30000
    tp: int = 1
    replicas: int = 1
    gpus: tuple[int, ...] | None = None  # devices split among replicas; default 0..replicas*tp-1
    chunked_prefill_size: int | None = None
    capture: str = "plugin"  # "plugin" (0.5.16+) or "builtin" (--enable-return-aux-hidden-states, 0.5.2x)
    launch_args: tuple[str, ...] = ()
    module: str = "sglang.launch_server"
    run_name: str = "run"
    startup_timeout_s: float = 1800.0
    stop_grace_s: float = 30.0
    staging_mb: int = 4096
    writer_threads: int = 4  # plugin threads writing piece files (HSEXTRACT_WRITER_THREADS)
    # SGLang's (breakable) prefill CUDA graphs, captured in FULL mode for the capture. Off: every prefill runs
    # eagerly, which is faster with capture (bench/README.md, SGLang throughput)
    prefill_cuda_graph: bool = False
    # config `trust_remote_code`: the checkpoint's own code may run (Kimi-K2.5's config, model and tokenizer)
    trust_remote_code: bool = False
    # config `share_prefixes` (docs/SHARED_PREFIX.md): the radix cache stays on and the plugin dumps each request
    # from its cache hit (HSEXTRACT_SHARED_PREFIX=1); off: --disable-radix-cache, every row computed
    share_prefixes: bool = False
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capture not in ("plugin", "builtin"):
            raise ConfigError(f"sglang.capture: {self.capture!r}; use plugin or builtin")
        if self.final_state not in ("pre_norm", "post_norm", "both"):
            raise ConfigError(f"final_state: {self.final_state!r}; use pre_norm or post_norm")
        if self.capture == "builtin" and (self.final_state == "both" or not self.aux_layers):
            what = "final_state both" if self.final_state == "both" else "capture: mtp (no aux layers)"
            raise ConfigError(f"{what} needs sglang.capture: plugin; SGLang's builtin capture "
                              "(--enable-return-aux-hidden-states) needs aux layers and stores one final state")
        check_prefill_graph(self.prefill_cuda_graph, self.final_state)
        if self.writer_threads < 1:
            raise ConfigError(f"sglang.writer_threads: {self.writer_threads}; must be >= 1")
        check_gpus(self.tp, self.replicas, self.gpus)
        check_ports(self.port, self.replicas)
        check_launch_args(self.launch_args)
        check_server_env(self.env)


@dataclass
class ServerHandle:
    url: str
    dump_dir: Path
    pid: int | None = None  # None for an external server
    replica: int = 0
    config_hash: str = ""
    command: list[str] = field(default_factory=list)
    log: str | None = None
    # the dump dir as created (lstat st_dev, st_ino): stop removes it only if that very directory is there
    dump_dir_dev: int | None = None
    dump_dir_ino: int | None = None
    # the server process's start (stale_lock.process_start; "" without /proc): a pid another process reuses is not
    # the server
    started: str | None = None
    # the key the server requires (read from its key file; never written into the state file)
    api_key: str | None = field(default=None, repr=False, compare=False)
    # when gone() last found the port the server's alone (time.monotonic; this process's, not the state file's)
    _port_seen: float = field(default=-math.inf, repr=False, compare=False)

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("api_key")
        d.pop("_port_seen")
        d["dump_dir"] = str(self.dump_dir)
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> ServerHandle:
        d = json.loads(text)
        d.pop("api_key", None)
        d["dump_dir"] = Path(d["dump_dir"])
        return cls(**d)

    def gone(self, thorough: bool = False) -> str | None:
        """Why the key may no longer go to this server's port, else None. Once a server started here stops, anyone
        may bind its port, answer /health and read the key from the next request. Before every keyed request: its
        process (pid and, on Linux, start time) must live (50 us), and its process group must be the port's only
        listener (8 ms: at most every PORT_CHECK_S, and always when `thorough`, after a failed request). An external
        server (pid None) is its owner's to guard."""
        if self.pid is None:
            return None
        if not _alive(self.pid, self.started):
            return f"its process {self.pid} has exited"
        now = time.monotonic()
        if thorough or now - self._port_seen > PORT_CHECK_S:
            port = split_url(self.url)[1]
            if (other := _listener_owner(port, self.pid)) is not None:
                return f"port {port} is no longer its own alone ({other})"
            self._port_seen = now
        return None


def gpu_set(cfg: ServerConfig, replica: int) -> list[int]:
    gpus = list(cfg.gpus) if cfg.gpus is not None else list(range(cfg.tp * cfg.replicas))
    return gpus[replica * cfg.tp : (replica + 1) * cfg.tp]


@dataclass
class ReplicaClaim:
    """One extract job's hold on a replica: a lock on `state_dir/replica-<r>.claim` for the job's lifetime (the
    kernel drops it when the process ends, kill -9 included)."""

    replica: int
    lock: filelock.FileLock | None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def claim_replica(state_dir: str | Path, replicas: int, chunk: int, say: Callable[[str], object] = print,
                  poll_s: float = 1.0) -> ReplicaClaim:
    """The replica a chunk's extract job uses, exclusively while it runs, so that extract jobs running at once
    (a GPU pool of tp x replicas: up to `replicas` jobs) each drive a server of their own: the lowest-numbered
    one no running job holds (so a pool of k x tp starts replicas 0 .. k-1 only, on GPUs the pool counts), else
    the first to come free (polled every `poll_s`). One replica needs no claim: jobs that share its server wait
    for nothing (the cluster case, where every job is a node of its own)."""
    if replicas == 1:
        return ReplicaClaim(0, None)
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    locks = [filelock.FileLock(state_dir / f"replica-{r}.claim", thread_local=False) for r in range(replicas)]
    waiting = False
    while True:
        for r, lock in enumerate(locks):
            try:
                lock.acquire(timeout=0)
            except filelock.Timeout:
                continue
            return ReplicaClaim(r, lock)
        if not waiting:
            say(f"chunk {chunk}: all {replicas} replicas are in use by other extract jobs; waiting for one")
            waiting = True
        time.sleep(poll_s)


_GRPC = ("it starts a gRPC server on sglang.host beside HTTP, which does not check the API key; the workflow "
         "speaks HTTP: remove it")
# Flags the launcher sets itself, and what sets them: `sglang.launch_args` may not name them (nor abbreviate
# them: SGLang's argparse takes any unambiguous prefix, `--hos` for `--host`), since the last value wins and
# the launcher's own would be overridden (`--host 0.0.0.0` after `--host 127.0.0.1`).
LAUNCHER_FLAGS: dict[str, str] = {
    "--model-path": "set `model`",
    "--model": "set `model`",
    "--host": "set `sglang.host`",
    "--port": "set `sglang.port`",
    "--tp": "set `sglang.tp`",
    "--tp-size": "set `sglang.tp`",
    "--tensor-parallel-size": "set `sglang.tp`",
    "--chunked-prefill-size": "set `sglang.chunked_prefill_size`",
    "--trust-remote-code": "set `trust_remote_code: true`",
    "--api-key": "set `sglang.api_key_file` (or nothing: each server gets a random key)",
    "--config": "it passes the API key file; give the file's options as launch_args",
    "--enable-return-hidden-states": "set `sglang.capture`",
    "--enable-return-aux-hidden-states": "set `sglang.capture`",
    "--speculative-algorithm": "set `sglang.capture`",
    "--return-aux-hidden-state-layer-ids": "set `aux_layers`",
    "--disable-prefill-cuda-graph": "set `sglang.prefill_cuda_graph`",
    "--disable-radix-cache": "the launcher passes it unless share_prefixes is on (which needs the radix cache); "
                             "remove it",
    "--skip-tokenizer-init": "the client sends token ids; remove it",
}
# Flags that open another door or write a secret down (SGLang 0.5.16 server_args.py): refused too
CLOSED_FLAGS: dict[str, str] = {
    # a command line is readable by every local user
    "--admin-api-key": "a key on the command line is visible to every local user (ps); remove it",
    "--ssl-keyfile-password": "a password on the command line is visible to every local user (ps); remove it",
    "--grpc-port": _GRPC,
    "--grpc-mode": _GRPC,
    "--smg-grpc-mode": _GRPC,
    "--sidecar": _GRPC,
    "--crash-dump-folder": "SGLang pickles its arguments, the API key among them, and the last requests into "
                           "that folder on a crash or a stop; remove it",
}
# Flags that make a server of more GPUs than the replica is given (sglang.tp), or of several nodes
_GPUS = ("runs {what} x tp GPUs, but each replica is given sglang.tp of them (CUDA_VISIBLE_DEVICES); the capture "
         "was never run under it: for more servers use sglang.replicas")
_NODES = ("a server over several nodes is not one the launcher can start: start it yourself with the plugin and "
          "give its address as sglang.server_url (config/README.md)")
PARALLEL_FLAGS: dict[str, str] = {
    "--pp-size": _GPUS.format(what="pipeline parallelism: pp"),
    "--pipeline-parallel-size": _GPUS.format(what="pipeline parallelism: pp"),
    # with --enable-dp-attention, dp splits attention within the tp GPUs (allowed: check_launch_args)
    "--dp-size": _GPUS.format(what="data parallelism without --enable-dp-attention: dp"),
    "--data-parallel-size": _GPUS.format(what="data parallelism without --enable-dp-attention: dp"),
    "--nnodes": _NODES,
    "--node-rank": _NODES,
    "--dist-init-addr": _NODES,
    "--nccl-init-addr": _NODES,
}
_DP = ("--dp-size", "--data-parallel-size")
# Flags under which SGLang 0.5.16 runs rows where the capture does not see them (never run here with it), with their
# other spellings there (server_args.py: an alias, and deprecated flags that set enable_prefill_cp)
_PREFILL_CP = ("prefill context parallelism splits a request's rows over the ranks and gathers them after the final "
               "norm; the capture was never run under it: remove it")
_ATTN_CP = ("attention context parallelism splits a request's rows over the ranks; the capture was never run under "
            "it: remove it")
CAPTURE_FLAGS: dict[str, str] = {
    "--enable-two-batch-overlap": "two-batch overlap runs DeepSeek's layers after the dense ones outside the loop "
                                  "that captures the aux layers (deepseek_v2.py, can_run_tbo); remove it",
    "--enable-pdmux": "PD multiplexing prefills through forward_batch_split_prefill, which the capture does not "
                      "hook; remove it",
    "--enable-prefill-cp": _PREFILL_CP,
    "--enable-prefill-context-parallel": _PREFILL_CP,
    "--enable-nsa-prefill-context-parallel": _PREFILL_CP,
    "--enable-dsa-prefill-context-parallel": _PREFILL_CP,
    "--attn-cp-size": _ATTN_CP,
    "--attention-context-parallel-size": _ATTN_CP,
}
# Flags that turn SGLang's prefill CUDA graphs back on over the launcher's --disable-prefill-cuda-graph (0.5.16
# server_args.py, _parse_cuda_graph_config: the per-phase backend and an explicit config win; the deprecated flags set
# that backend)
_PREFILL_GRAPHS = ("it turns on SGLang's prefill CUDA graphs, which `sglang.prefill_cuda_graph` decides (the "
                   "launcher passes --disable-prefill-cuda-graph unless it is true)")
GRAPH_FLAGS: dict[str, str] = {
    "--cuda-graph-backend-prefill": _PREFILL_GRAPHS,
    "--enable-breakable-cuda-graph": _PREFILL_GRAPHS,
    "--enforce-piecewise-cuda-graph": _PREFILL_GRAPHS,
    "--cuda-graph-config": f"{_PREFILL_GRAPHS}; give the decode graphs' settings with their own flags "
                           "(--cuda-graph-max-bs-decode, ...)",
}
# environment variables that open the same doors (SGLang reads SGLANG_GRPC_PORT as --grpc-port)
LAUNCHER_ENV: dict[str, str] = {"SGLANG_GRPC_PORT": _GRPC}


def check_gpus(tp: int, replicas: int, gpus: Sequence[int] | None) -> None:
    """ConfigError when the replicas' GPUs do not add up (also at parse time: config.checks)."""
    if tp < 1 or replicas < 1:
        raise ConfigError("sglang.tp and sglang.replicas must be >= 1")
    if gpus is not None and len(gpus) != tp * replicas:
        raise ConfigError(f"sglang.gpus lists {len(gpus)} devices; {replicas} replicas x tp {tp} use "
                          f"{tp * replicas}: list exactly those")


def check_prefill_graph(prefill_cuda_graph: bool, final_state: str) -> None:
    """ConfigError for prefill CUDA graphs with a pre-norm final state (also at parse time). The plugin takes that
    state with a hook on the final norm, inside the graphed decoder; SGLang 0.5.16's breakable prefill graphs
    replay the decoder without running it, so every graphed batch would fail."""
    if prefill_cuda_graph and final_state != "post_norm":
        raise ConfigError(f"sglang.prefill_cuda_graph: true with final_state {final_state}: SGLang replays its "
                          "prefill CUDA graphs without the final norm's hook that takes the pre-norm state (never "
                          "run here); set sglang.prefill_cuda_graph: false (the default) or final_state: post_norm")


def check_ports(port: int, replicas: int) -> None:
    """ConfigError when the replicas' ports (port + r) run past the last one (also at parse time)."""
    if port + replicas - 1 > 65535:
        raise ConfigError(f"sglang.port: replica r listens on port + r, so {replicas} replicas from port {port} "
                          f"reach {port + replicas - 1}, past the last port (65535); choose sglang.port <= "
                          f"{65536 - replicas}")


def check_launch_args(launch_args: Sequence[str]) -> None:
    """ConfigError naming the first item of `sglang.launch_args` that sets (or abbreviates) a LAUNCHER_FLAGS,
    CLOSED_FLAGS, CAPTURE_FLAGS, GRAPH_FLAGS or PARALLEL_FLAGS flag."""
    dp_attention = any(flag_meant(a, ["--enable-dp-attention"]) for a in launch_args)
    flags = {**LAUNCHER_FLAGS, **CLOSED_FLAGS, **CAPTURE_FLAGS, **GRAPH_FLAGS,
             **{f: m for f, m in PARALLEL_FLAGS.items() if not (dp_attention and f in _DP)}}
    for i, arg in enumerate(launch_args):  # the value is never shown (it may be a key)
        name = arg.split("=", 1)[0]
        if arg.startswith("-") and len(words := name.split()) > 1:  # "--tp 4": one argument to SGLang's parser
            first = words[0]
            raise ConfigError(f"sglang.launch_args[{i}]: {first} and its value are one item, which SGLang's parser "
                              f"reads as one unknown argument; give them as two items ({first}, then the value) "
                              f"or as {first}=<value>")
        flag = flag_meant(arg, flags)
        if flag is not None:
            what = (name if flag == name else f"{name} (a spelling of {flag})"
                    if flag == name.replace("_", "-") else f"{name} (an abbreviation of {flag})")
            how = "is set by the launcher itself" if flag in LAUNCHER_FLAGS else "may not be given"
            raise ConfigError(f"sglang.launch_args[{i}]: {what} {how}; {flags[flag]}")


def check_server_env(env: Mapping[str, str]) -> None:
    """ConfigError naming the first `sglang.env` variable that opens a door the launcher keeps shut."""
    for name in env:
        if name in LAUNCHER_ENV:
            raise ConfigError(f"sglang.env: {name}: {LAUNCHER_ENV[name]}")


def build_command(cfg: ServerConfig, replica: int = 0, key_file: str | os.PathLike[str] | None = None) -> list[str]:
    """The server's command line. `key_file`: the server's API key file (keyfile.write_key), passed with
    SGLang's --config; the key itself is never on the command line. Without one the server has no key, which
    only a loopback host may do."""
    if key_file is None and (cfg.api_key or not is_loopback(cfg.host)):
        raise ConfigError(
            f"sglang.host: {cfg.host} is not a loopback address: a server there needs an API key file"
            if not is_loopback(cfg.host) else
            "the API key reaches the server in a key file (build_command(cfg, replica, key_file)), never on "
            "its command line"
        )
    cmd = [cfg.python, "-m", cfg.module, "--model-path", cfg.model, "--host", cfg.host,
           "--port", str(cfg.port + replica), "--tp", str(cfg.tp)]
    if not cfg.share_prefixes:  # a prefix-cache hit would skip rows the flat layout stores
        cmd += ["--disable-radix-cache"]
    cmd += ["--skip-tokenizer-init"]
    if cfg.chunked_prefill_size is not None:
        cmd += ["--chunked-prefill-size", str(cfg.chunked_prefill_size)]
    if cfg.capture == "builtin":
        # DFLASH names layers by their output (+1 to a capture index; EAGLE3 takes DeepSeek ids raw), so the
        # hidden_states ids go minus one; no draft model is loaded
        cmd += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "DFLASH",
                "--return-aux-hidden-state-layer-ids", *(str(i - 1) for i in cfg.aux_layers)]
    else:
        cmd += ["--enable-return-hidden-states"]  # prefill CUDA graphs, if on, captured in FULL mode
    if not cfg.prefill_cuda_graph:
        cmd += ["--disable-prefill-cuda-graph"]
    if cfg.trust_remote_code:
        cmd += ["--trust-remote-code"]
    if key_file is not None:
        cmd += ["--config", str(key_file)]
    return cmd + list(cfg.launch_args)


def build_env(cfg: ServerConfig, dump_dir: Path, replica: int = 0,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.pop(ps.ENV_EAGLE3_IDS, None)  # the plugin's unchecked diagnostic: only from cfg.env, never inherited
    plugins = [p for p in env.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    env["SGLANG_PLUGINS"] = ",".join(dict.fromkeys([*plugins, "hsextract"]))
    env[ps.ENV_DUMP_DIR] = str(dump_dir)
    env[ps.ENV_AUX_LAYERS] = ",".join(map(str, cfg.aux_layers))
    env[ps.ENV_FINAL_STATE] = cfg.final_state
    env[ps.ENV_STAGING_MB] = str(cfg.staging_mb)
    env[ps.ENV_WRITER_THREADS] = str(cfg.writer_threads)
    env[ps.ENV_SHARED_PREFIX] = "1" if cfg.share_prefixes else "0"
    for name in LAUNCHER_ENV:  # inherited from the job's shell; set in cfg.env it is refused (ServerConfig)
        env.pop(name, None)
    if cfg.gpus is not None or cfg.replicas > 1:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_set(cfg, replica)))
    env.update(cfg.env)
    return env


def config_hash(cfg: ServerConfig, replica: int) -> str:
    """What a running server must match to be reused; the key is not in it (the state file holds this hash):
    ensure_server compares it with the server's key file instead."""
    d = asdict(cfg)
    for k in ("startup_timeout_s", "stop_grace_s", "api_key"):
        d.pop(k)
    d["replica"] = replica
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def make_dump_dir(run_name: str) -> Path:
    """Private (0700), unpredictable, in /dev/shm when possible; verified (ours, not a symlink) once made."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_name)[:40]
    return private_dir(base, f"{DUMP_DIR_PREFIX}{safe}-")[0]


def redact(cmd: list[str]) -> list[str]:
    """The command with the value of every secret flag hidden (hsextract.config.redaction; for logs, errors and the
    state file)."""
    return redact_command(cmd)


def _has_marker(dump_dir: Path) -> bool:
    return any(dump_dir.glob(f"{dumpfiles.PLUGIN_MARKER_PREFIX}*.json"))


def _alive(pid: int | None, started: str | None = None) -> bool:
    """pid names a process that is not a zombie (one we may not inspect counts as alive) and, given `started` (its
    process_start), was started then: not another process that reuses the pid."""
    if not pid:
        return False
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except (psutil.NoSuchProcess, ValueError):  # ValueError: a negative pid
        return False
    except psutil.AccessDenied:
        return True
    return not started or process_start(pid) == started  # None: gone since the status was read


def _is_ours(pid: int, dump_dir: Path) -> bool:
    """Guard against pid reuse: our server's environment names its dump directory. A process whose
    environment we may not read, or that is gone, is not ours; where the platform has no way to read it,
    trust the pidfile."""
    try:
        env = psutil.Process(pid).environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    except (AttributeError, NotImplementedError):
        return True
    return env.get("HSEXTRACT_DUMP_DIR") == str(dump_dir)


def _kill_group(pid: int, grace_s: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # reap when it is our child
            if not _group_alive(pid):
                return
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """Some process of group pgid is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess):  # exited meanwhile
            continue
        except psutil.AccessDenied:
            return True
    return False


def _remove_dump_dir(h: ServerHandle) -> None:
    """Remove h's dump dir only if it is the directory the launcher created: same device and inode, still a
    private directory of ours (a handle file names any path; an old handle without the inode removes nothing)."""
    if h.dump_dir_ino is None or not h.dump_dir.name.startswith(DUMP_DIR_PREFIX):
        return
    try:
        st = verify_dir(h.dump_dir)
    except DumpDirError:
        return
    if (st.st_dev, st.st_ino) == (h.dump_dir_dev, h.dump_dir_ino):
        shutil.rmtree(h.dump_dir, ignore_errors=True)


def _endpoint(state_dir: Path, replica: int) -> Path:
    return state_dir / f"replica-{replica}.json"


def _locked(path: Path) -> filelock.FileLock:
    """Exclusive lock on `path` across processes (blocks until free)."""
    return filelock.FileLock(path)


def _listener_owner(port: int, pgid: int) -> str | None:
    """None when every socket listening on TCP `port` belongs to process group `pgid` (the server's, which
    the launcher made its own), else who holds it. A server's key goes only to a port its own process
    holds: the port is free while a model loads (minutes), and anyone may bind it then."""
    try:
        conns = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr
                 and c.laddr.port == port]
    except psutil.AccessDenied:
        return "a process this platform does not let hsextract identify"
    if not conns:
        return "no listening socket of this machine"
    for c in conns:
        if c.pid is None:
            return "a process of another user"
        try:
            if os.getpgid(c.pid) != pgid:
                return f"process {c.pid} ({psutil.Process(c.pid).name()})"
        except (ProcessLookupError, psutil.NoSuchProcess):
            return f"process {c.pid}, which has since exited"
    return None


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def _stop_handle(h: ServerHandle, grace_s: float, started_here: bool = False) -> bool:
    """Kill h's process group. A pid read from a file must prove it is ours (pid reuse); one this process
    started itself need not (its environment may not name the dump dir, e.g. HSEXTRACT_DUMP_DIR overridden)."""
    killed = False
    if h.pid and _alive(h.pid) and (started_here or _is_ours(h.pid, h.dump_dir)):
        _kill_group(h.pid, grace_s)
        killed = True
    _remove_dump_dir(h)
    return killed


def _launch(cmd: list[str], env: Mapping[str, str], log_path: Path, key_file: Path) -> tuple[subprocess.Popen,
                                                                                             subprocess.Popen]:
    """Start the server in a process group of its own (no terminal signal reaches it), its stdout and stderr
    going through hsextract.sglang.logscrub (same group: stopping the server stops it) into `log_path`, which
    so never holds the key. A new process group rather than a new session: the filter may join only a group
    of its own session."""
    r, w = os.pipe()
    try:
        with open(log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%F %T')} starting: {' '.join(redact(cmd))}\n".encode())
            log.flush()
            proc = subprocess.Popen(cmd, env=env, stdout=w, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    process_group=0)
            try:
                scrub = subprocess.Popen([sys.executable, "-m", "hsextract.sglang.logscrub", str(key_file)],
                                         stdin=r, stdout=log, stderr=subprocess.STDOUT, process_group=proc.pid)
            except BaseException:
                _kill_group(proc.pid, 1.0)
                raise
    finally:
        os.close(r)
        os.close(w)
    return proc, scrub


def _drain_log(scrub: subprocess.Popen, pgid: int) -> None:
    """Wait until the log filter has copied the server's last output (it ends when the group has no writer
    left); a group member still holding the pipe is killed."""
    try:
        scrub.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)  # the filter is alive: pgid is still our group
        scrub.wait()


def ensure_server(state_dir: str | Path, cfg: ServerConfig, replica: int = 0) -> ServerHandle:
    """Return a healthy server for `replica`, reusing a running one or starting it (minutes for SGLang).

    A server started here requires an API key: `cfg.api_key`, else a fresh random one; it is kept in
    `state_dir/private/replica-<r>.yaml` (mode 0600, hsextract.sglang.keyfile) for the jobs that reuse the
    server, and the handle carries it for the client (`SGLangEngine` sends it)."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    h_cfg = config_hash(cfg, replica)
    ep = _endpoint(state_dir, replica)
    key_file = keyfile.key_path(state_dir, replica)
    with _locked(state_dir / f"replica-{replica}.lock"):
        if ep.exists():
            old = ServerHandle.from_json(ep.read_text(encoding="utf-8"))
            old.api_key = keyfile.read_key(key_file)
            if (old.config_hash == h_cfg and old.api_key is not None and cfg.api_key in (None, old.api_key)
                    and old.gone(thorough=True) is None and health(old.url) is None and _has_marker(old.dump_dir)):
                return old
            _stop_handle(old, cfg.stop_grace_s)  # stale, dead, another configuration or another key
            ep.unlink()
        keyfile.remove_key(key_file)
        port = cfg.port + replica
        deadline = time.monotonic() + 10.0  # a just-killed server closes its socket after it turns zombie
        while _port_in_use(cfg.host, port) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _port_in_use(cfg.host, port):
            raise EngineError(f"port {port} on {cfg.host} is already in use by another process; stop it or set "
                              f"sglang.port (replica {replica} uses port + {replica})")
        key = cfg.api_key or keyfile.new_key()
        keyfile.write_key(key_file, key)
        dump_dir = make_dump_dir(cfg.run_name)
        cmd = build_command(cfg, replica, key_file)
        log_path = state_dir / f"replica-{replica}.log"
        try:
            proc, scrub = _launch(cmd, build_env(cfg, dump_dir, replica), log_path, key_file)
        except BaseException:
            keyfile.remove_key(key_file)
            shutil.rmtree(dump_dir, ignore_errors=True)
            raise
        st = os.lstat(dump_dir)
        h = ServerHandle(url=f"http://{cfg.host}:{port}", dump_dir=dump_dir, pid=proc.pid, replica=replica,
                         config_hash=h_cfg, command=redact(cmd), log=str(log_path), dump_dir_dev=st.st_dev,
                         dump_dir_ino=st.st_ino, started=process_start(proc.pid), api_key=key)
        write_bytes_atomic(ep, h.to_json().encode())  # written before waiting: a stop during start-up finds the pid

        def failed(why: str, grace_s: float, tail: bool = True) -> EngineError:
            _stop_handle(h, grace_s, started_here=True)
            _drain_log(scrub, proc.pid)
            ep.unlink(missing_ok=True)
            keyfile.remove_key(key_file)
            if tail:
                why += f"; last lines of {log_path}:\n{_tail(log_path)}"
            # the log went through the filter; the key is hidden here too, whatever else wrote there
            return EngineError(redact_text(why, [key]))

        deadline = time.monotonic() + cfg.startup_timeout_s
        while True:
            rc = proc.poll()
            if rc is not None:
                raise failed(f"the SGLang server (replica {replica}) exited with code {rc} during start-up; "
                             f"command: {' '.join(h.command)}", 1.0)
            if health(h.url, 2.0) is None:
                if (other := _listener_owner(port, proc.pid)) is not None:
                    raise failed(f"port {port} on {cfg.host} answers, but {other}, not the server started here "
                                 f"(pid {proc.pid}): another local user may have taken the port while the model "
                                 "loaded, to read the API key; the key was not sent. Set sglang.port to a port "
                                 "of a range no one else uses", 1.0)
                if _has_marker(dump_dir):
                    return h
                raise failed(f"the SGLang server at {h.url} is healthy but the hsextract plugin is not active "
                             f"(no {dumpfiles.PLUGIN_MARKER_PREFIX}*.json in its dump dir): install hsextract "
                             f"into {cfg.python}'s environment (rule build_patched_server); log: {log_path}",
                             cfg.stop_grace_s, tail=False)
            if time.monotonic() > deadline:
                raise failed(f"the SGLang server (replica {replica}) was not healthy after "
                             f"{cfg.startup_timeout_s:g} s", cfg.stop_grace_s)
            time.sleep(0.5)


def stop_servers(state_dir: str | Path, grace_s: float = 30.0) -> list[int]:
    """Stop every server recorded in `state_dir` (process group), remove its dump dir; returns killed pids.

    Call from Snakemake's onsuccess/onerror, and from onstart to clear a server orphaned by a crash.
    """
    state_dir = Path(state_dir)
    killed: list[int] = []
    for ep in sorted(state_dir.glob("replica-*.json")):
        replica = int(ep.stem.split("-")[1])
        with _locked(state_dir / f"replica-{replica}.lock"):
            try:
                h = ServerHandle.from_json(ep.read_text(encoding="utf-8"))
            except (OSError, ValueError, TypeError):
                ep.unlink(missing_ok=True)
                keyfile.remove_key(keyfile.key_path(state_dir, replica))
                continue
            if _stop_handle(h, grace_s) and h.pid:
                killed.append(h.pid)
            ep.unlink(missing_ok=True)
            keyfile.remove_key(keyfile.key_path(state_dir, replica))
    return killed


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace", encoding="utf-8").splitlines()[-n:])
    except OSError:
        return "(no log)"


def host_name() -> str:
    """This host's name in a run's server folder (hsextract.sglang.config.state_dir; bench/gpu/run_production.sh
    asks for it here): one name for the folder a job writes and the folder stop and status read."""
    return socket.gethostname() or "localhost"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hsextract SGLang server state")
    ap.add_argument("action", choices=["stop", "status"])
    ap.add_argument("state_dir")
    a = ap.parse_args(argv)
    # a run's server folder (results/<run>/server): its servers of this host, and any recorded there by a release
    # before the folder per host
    dirs = [d for d in (Path(a.state_dir), Path(a.state_dir) / "hosts" / host_name()) if d.is_dir()]
    if a.action == "stop":
        print(json.dumps({"killed": [pid for d in dirs for pid in stop_servers(d)]}))
        return 0
    out = []
    for ep in sorted(ep for d in dirs for ep in d.glob("replica-*.json")):
        h = ServerHandle.from_json(ep.read_text(encoding="utf-8"))
        out.append({"replica": h.replica, "url": h.url, "pid": h.pid, "alive": _alive(h.pid),
                    "health": health(h.url) or "ok", "dump_dir": str(h.dump_dir)})
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
