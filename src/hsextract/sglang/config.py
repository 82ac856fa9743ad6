"""Workflow config -> SGLang server settings and client: the glue between `sglang:` and server.py / client.py.

Three ways to reach a server, chosen by the `sglang:` section:
  - `server_url`: one server that runs elsewhere; nothing is built or started.
  - `servers`: several such servers; chunk i goes to servers[i % len(servers)].
  - neither: local replicas started on demand by the extraction jobs (`ensure_server`, start-or-reuse,
    state in results/<run>/server/), stopped by the Snakefile's onsuccess/onerror.
External servers write dump files to `dump_dir`, which must be visible on this machine.

`build_patched` is the body of rule build_patched_server: install the plugin into the server's Python,
check that Python's SGLang against everything the plugin uses, and describe the result in patched.json.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hsextract import __version__
from hsextract.engines.base import CaptureSpec
from hsextract.errors import ConfigError, EngineError

# Defaults of the `sglang:` section (the schema repeats them; scripts may get a config without it).
DEFAULTS: dict[str, Any] = {
    "python": None,
    "launch_args": [],
    "host": "127.0.0.1",
    "port": 30000,
    "tp": 1,
    "replicas": 1,
    "gpus": None,
    "chunked_prefill_size": None,
    "capture": "plugin",
    "concurrency": 32,
    "timeout_s": 600.0,
    "retries": 3,
    "backoff_s": 1.0,
    "staging_mb": 4096,
    "writer_threads": 4,
    "prefill_cuda_graph": False,
    "startup_timeout_s": 1800.0,
    "server_url": None,
    "servers": [],
    "dump_dir": None,
}

PLUGIN_FILES = ("sglang_plugin",)  # what the server process imports, under src/hsextract/


def settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The `sglang:` section with defaults filled; ConfigError for unknown keys."""
    section = config.get("sglang") or {}
    unknown = sorted(set(section) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"sglang: unknown keys {unknown}; allowed: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **section}


def external_urls(config: Mapping[str, Any]) -> list[str]:
    """URLs of servers that run elsewhere (`server_url` or `servers`); empty when servers are started here."""
    s = settings(config)
    if s["server_url"] and s["servers"]:
        raise ConfigError("sglang: set either server_url (one server) or servers (several), not both")
    urls = [s["server_url"]] if s["server_url"] else list(s["servers"] or [])
    if urls and not s["dump_dir"]:
        raise ConfigError(
            "sglang.dump_dir is required with sglang.server_url/servers: the directory the servers' "
            "HSEXTRACT_DUMP_DIR names, as seen from the machine that runs the extraction jobs"
        )
    return urls


def state_dir(config: Mapping[str, Any], root: str | Path = ".") -> Path:
    """Where local servers' pid/endpoint files, locks, logs and patched.json live."""
    return Path(root) / "results" / str(config["run_name"]) / "server"


def patched_path(config: Mapping[str, Any], root: str | Path = ".") -> Path:
    return state_dir(config, root) / "patched.json"


def server_python(config: Mapping[str, Any], root: str | Path = ".") -> str:
    """`sglang.python`, else the interpreter rule build_patched_server installed into, else this one."""
    s = settings(config)
    if s["python"]:
        return str(s["python"])
    p = patched_path(config, root)
    if p.is_file():
        py = json.loads(p.read_text()).get("python")
        if py:
            return str(py)
    return sys.executable


def build_python(python: str | None, conda_env: bool) -> str:
    """The interpreter rule build_patched_server installs hsextract into: `sglang.python`, or the job's
    own interpreter when it runs in the envs/sglang.yaml environment (--sdm conda). Never the workflow's
    own environment: an install there would replace its editable hsextract by a copy in site-packages."""
    if python:
        return str(python)
    if conda_env:
        return sys.executable
    raise ConfigError(
        "sglang.python is null and the workflow runs without --sdm conda, so rule build_patched_server has "
        f"no server environment to install the plugin into (it will not touch the workflow's own, {sys.prefix}). "
        "Set sglang.python to the Python of your SGLang installation "
        "(--config 'sglang={python: /path/to/sglang/bin/python}'), or add --sdm conda to build envs/sglang.yaml."
    )


def server_config_from(config: Mapping[str, Any], root: str | Path = ".", python: str | None = None) -> Any:
    """The ServerConfig of local replicas."""
    from hsextract.sglang.server import ServerConfig

    s = settings(config)
    return ServerConfig(
        model=str(config["model"]),
        aux_layers=tuple(int(i) for i in config["aux_layers"]),
        python=python or server_python(config, root),
        final_state=str(config.get("final_state", "post_norm")),
        host=str(s["host"]),
        port=int(s["port"]),
        tp=int(s["tp"]),
        replicas=int(s["replicas"]),
        gpus=tuple(int(g) for g in s["gpus"]) if s["gpus"] is not None else None,
        chunked_prefill_size=int(s["chunked_prefill_size"]) if s["chunked_prefill_size"] is not None else None,
        capture=str(s["capture"]),
        launch_args=tuple(str(a) for a in s["launch_args"]),
        run_name=str(config["run_name"]),
        startup_timeout_s=float(s["startup_timeout_s"]),
        staging_mb=int(s["staging_mb"]),
        writer_threads=int(s["writer_threads"]),
        prefill_cuda_graph=bool(s["prefill_cuda_graph"]),
        trust_remote_code=bool(config.get("trust_remote_code", False)),
    )


def engine_from_config(config: Mapping[str, Any], spec: CaptureSpec, chunk: int = 0, root: str | Path = ".") -> Any:
    """The sglang engine for one chunk: an external server (spread by chunk) or a local replica, started
    or reused."""
    from hsextract.sglang.client import SGLangEngine

    s = settings(config)
    urls = external_urls(config)
    if urls:
        server: Any = urls[chunk % len(urls)]
        dump_dir = s["dump_dir"]
    else:
        from hsextract.sglang.server import ensure_server, replica_for_chunk

        cfg = server_config_from(config, root)
        server = ensure_server(state_dir(config, root), cfg, replica=replica_for_chunk(chunk, cfg.replicas))
        dump_dir = None
    return SGLangEngine(
        server,
        spec,
        dump_dir,
        concurrency=int(s["concurrency"]),
        timeout_s=float(s["timeout_s"]),
        retries=int(s["retries"]),
        backoff_s=float(s["backoff_s"]),
        run_name=str(config["run_name"]),
        chunk=chunk,
    )


def stop_local_servers(config: Mapping[str, Any], root: str | Path = ".") -> list[int]:
    """Stop the local replicas of this run (onstart: stale ones; onsuccess/onerror: ours)."""
    from hsextract.sglang.server import stop_servers

    d = state_dir(config, root)
    return stop_servers(d) if d.is_dir() else []


def plugin_source_hash(package_dir: str | Path | None = None) -> str:
    """sha256 over the plugin's source files (path + bytes, sorted): what the server process runs."""
    base = Path(package_dir) if package_dir else Path(__file__).resolve().parents[1]
    files: list[Path] = []
    for name in PLUGIN_FILES:
        p = base / name
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(base).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def build_patched(
    config: Mapping[str, Any],
    out: str | Path,
    repo: str | Path,
    python: str | None = None,
    install: bool = True,
    root: str | Path = ".",
) -> dict[str, Any]:
    """Install hsextract (the plugin) into the server's Python, check its SGLang, write `out` (JSON).

    Raises EngineError when the install fails or the installed SGLang lacks something the plugin uses
    (the compatibility report's problems are in the message, with file and line)."""
    from hsextract.sglang.server import build_command
    from hsextract.sglang.compat import check_installed

    py = python or server_python(config, root)
    if install:
        cmd = [py, "-m", "pip", "install", "--no-deps", "--no-build-isolation", str(repo)]
        print("+", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", flush=True)
        if proc.returncode != 0:
            raise EngineError(f"installing {repo} into {py} failed (exit {proc.returncode}): "
                              f"{proc.stderr.strip()[-800:]}")
    report = check_installed(py).summary()
    print(json.dumps(report, indent=1), flush=True)
    cfg = server_config_from(config, root, python=py)
    if not report["ok"]:
        problems = "\n".join(p["text"] for p in report["problems"][:20])
        raise EngineError(
            f"the SGLang of {py} ({report['sglang_version']}) cannot run the hsextract plugin "
            f"(supported {'-'.join(report['supported_range'])}):\n{problems}"
        )
    if cfg.capture not in report["capture_sources"]:
        raise EngineError(
            f"sglang.capture: {cfg.capture!r} is not available in SGLang {report['sglang_version']} "
            f"(available: {report['capture_sources']}); set sglang.capture accordingly"
        )
    info = {
        "python": py,
        "sglang_version": report["sglang_version"],
        "plugin_version": __version__,
        "plugin_sha256": plugin_source_hash(),
        "capture": cfg.capture,
        "capture_sources": report["capture_sources"],
        "launch": [build_command(cfg, r) for r in range(cfg.replicas)],
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    tmp.replace(out)
    return info
