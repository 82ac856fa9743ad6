"""Extract settings -> SGLang server settings and client: the glue between `sglang:` (settings.extract.sglang)
and server.py / client.py.

Three ways to reach a server, chosen by the `sglang:` section:
  - `server_url`: one server that runs elsewhere; nothing is built or started.
  - `servers`: several such servers; chunk i goes to servers[i % len(servers)].
  - neither: local replicas started on demand by the extraction jobs (`ensure_server`, start-or-reuse,
    state in results/<run>/server/hosts/<host>/), stopped by the Snakefile's onsuccess/onerror.
External servers write dump files to `dump_dir`, which must be visible on this machine.

`build_patched` is the body of rule build_patched_server: install hsextract into the server's Python (the
server process imports its `sglang_plugin` package, found through the `sglang.srt.plugins` entry point,
and the few standard-library-only modules of `SERVER_MODULES` that the plugin imports), check that what
the server will import is this checkout's and that Python's SGLang has everything the plugin uses, and
describe the result in patched.json (`plugin_dir`: where the server imports the plugin from).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hsextract import __version__
from hsextract.atomic import write_json_atomic
from hsextract.config.settings import ExtractSettings
from hsextract.engines.base import CaptureSpec
from hsextract.errors import ConfigError, EngineError

PLUGIN_PACKAGE = "hsextract.sglang_plugin"  # the package the server process imports (entry point `hsextract`)
# the modules of hsextract outside the plugin package that the server process imports (beside the package's
# own __init__): tests/test_sglang_api.py checks this list against a fresh interpreter's sys.modules
SERVER_MODULES = ("atomic.py", "capture.py", "errors.py", "layers.py")


def external_urls(settings: ExtractSettings) -> list[str]:
    """URLs of servers that run elsewhere (`server_url` or `servers`); empty when servers are started here."""
    s = settings.sglang
    if s.server_url and s.servers:
        raise ConfigError("sglang: set either server_url (one server) or servers (several), not both")
    urls = [s.server_url] if s.server_url else list(s.servers)
    if urls and not s.dump_dir:
        raise ConfigError(
            "sglang.dump_dir is required with sglang.server_url/servers: the directory the servers' "
            "HSEXTRACT_DUMP_DIR names, as seen from the machine that runs the extraction jobs"
        )
    return urls


def server_dir(settings: ExtractSettings, root: str | Path = ".") -> Path:
    """The run's server folder: patched.json, and a state folder per host (state_dir)."""
    return Path(root) / "results" / settings.run_name / "server"


def state_dir(settings: ExtractSettings, root: str | Path = ".", host: str | None = None) -> Path:
    """Where this host's local servers' pid/endpoint files, locks, claims, logs and keys live. One folder per host:
    a server listens on its host's loopback and lives there; in one folder on a cluster's shared filesystem, every
    node's extract job waited on one start-up lock, and each took the others' servers for stale ones."""
    from hsextract.sglang.server import host_name

    return server_dir(settings, root) / "hosts" / (host or host_name())


def patched_path(settings: ExtractSettings, root: str | Path = ".") -> Path:
    return server_dir(settings, root) / "patched.json"


def server_python(settings: ExtractSettings, root: str | Path = ".") -> str:
    """`sglang.python`, else the interpreter rule build_patched_server installed into, else this one."""
    if settings.sglang.python:
        return settings.sglang.python
    p = patched_path(settings, root)
    if p.is_file():
        py = json.loads(p.read_text(encoding="utf-8")).get("python")
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


def no_build_python(python: str | None, conda_env: bool) -> str | None:
    """Why rule build_patched_server would stop for want of a server Python (build_python's error), for the
    Snakefile to say at parse time; None when it has one."""
    try:
        build_python(python, conda_env)
    except ConfigError as e:
        return str(e)
    return None


def configured_key(settings: ExtractSettings) -> str | None:
    """The key in the file `sglang.api_key_file` names (read each time: no copy of it is kept); None: unset."""
    from hsextract.sglang.keyfile import read_key_file

    path = settings.sglang.api_key_file
    return read_key_file(path) if path is not None else None


def server_config_from(settings: ExtractSettings, root: str | Path = ".", python: str | None = None) -> Any:
    """The ServerConfig of local replicas."""
    from hsextract.sglang.server import ServerConfig

    s = settings.sglang
    return ServerConfig(
        model=settings.model,
        aux_layers=tuple(settings.aux_layers or ()),
        python=python or server_python(settings, root),
        final_state=settings.final_state,
        host=s.host,
        api_key=configured_key(settings),
        port=s.port,
        tp=s.tp,
        replicas=s.replicas,
        gpus=s.gpus,
        chunked_prefill_size=s.chunked_prefill_size,
        capture=s.capture,
        launch_args=s.launch_args,
        run_name=settings.run_name,
        startup_timeout_s=float(s.startup_timeout_s),
        staging_mb=s.staging_mb,
        writer_threads=s.writer_threads,
        prefill_cuda_graph=s.prefill_cuda_graph,
        trust_remote_code=settings.trust_remote_code,
        share_prefixes=settings.share_prefixes,
    )


def engine_from_config(settings: ExtractSettings, spec: CaptureSpec, chunk: int = 0, root: str | Path = ".") -> Any:
    """The sglang engine for one chunk: an external server (spread by chunk) or a local replica that the job
    claims for its lifetime (released when the engine closes), started or reused."""
    from hsextract.sglang.client import SGLangEngine

    s = settings.sglang
    urls = external_urls(settings)
    claim = None
    if urls:
        server: Any = urls[chunk % len(urls)]
        dump_dir = s.dump_dir
    else:
        from hsextract.sglang.server import claim_replica, ensure_server

        cfg = server_config_from(settings, root)
        claim = claim_replica(state_dir(settings, root), cfg.replicas, chunk)
    try:
        if claim is not None:
            server = ensure_server(state_dir(settings, root), cfg, replica=claim.replica)
            dump_dir = None  # the handle's, as its key (configured or made by the launcher)
            print(f"chunk {chunk}: sglang replica {claim.replica} of {cfg.replicas} at {server.url}", flush=True)
        return SGLangEngine(
            server,
            spec,
            dump_dir,
            concurrency=s.concurrency,
            timeout_s=float(s.timeout_s),
            retries=s.retries,
            backoff_s=float(s.backoff_s),
            run_name=settings.run_name,
            chunk=chunk,
            api_key=configured_key(settings) if urls else None,
            share_prefixes=settings.share_prefixes,
            on_close=claim.release if claim is not None else None,
        )
    except BaseException:
        if claim is not None:
            claim.release()
        raise


def stop_local_servers(settings: ExtractSettings, root: str | Path = ".") -> list[int]:
    """Stop this host's local replicas of this run (onstart: stale ones; onsuccess/onerror: ours). On a cluster the
    servers that extract jobs started on other nodes end with their jobs (the scheduler stops a job's processes)."""
    from hsextract.sglang.server import stop_servers

    # and one a release before the folder per host recorded in the run's server folder itself
    return [pid for d in (state_dir(settings, root), server_dir(settings, root)) if d.is_dir()
            for pid in stop_servers(d)]


def plugin_dir() -> Path:
    """The directory of this checkout's plugin package."""
    import hsextract.sglang_plugin

    return Path(hsextract.sglang_plugin.__file__).resolve().parent


def installed_plugin_dir(python: str) -> Path:
    """The directory `python` imports the plugin package from (what the server process runs); EngineError
    when it cannot import it."""
    code = (f"import importlib.util; s = importlib.util.find_spec({PLUGIN_PACKAGE!r}); "
            "print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, encoding="utf-8", errors="replace")
    where = proc.stdout.strip()
    if proc.returncode != 0 or not where:
        raise EngineError(f"{python} cannot import {PLUGIN_PACKAGE}: install hsextract into that environment "
                          f"(rule build_patched_server does). {proc.stderr.strip()[-400:]}")
    return Path(where).resolve()


def server_source_files(package_dir: str | Path | None = None) -> list[Path]:
    """Every source file the server process imports from hsextract: the plugin package `package_dir`
    (default this checkout's), the hsextract package's `__init__.py` and `SERVER_MODULES` beside it."""
    base = Path(package_dir) if package_dir else plugin_dir()
    return [base.parent / m for m in ("__init__.py", *SERVER_MODULES)] + sorted(base.rglob("*.py"))


def plugin_source_hash(package_dir: str | Path | None = None) -> str:
    """sha256 over server_source_files (path relative to the hsextract package + bytes): what the server runs."""
    base = (Path(package_dir) if package_dir else plugin_dir()).parent
    h = hashlib.sha256()
    for f in server_source_files(package_dir):
        h.update(f.relative_to(base).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def build_patched(
    settings: ExtractSettings,
    out: str | Path,
    repo: str | Path,
    python: str | None = None,
    install: bool = True,
    root: str | Path = ".",
) -> dict[str, Any]:
    """Install hsextract (the plugin) into the server's Python, check its SGLang, write `out` (JSON).

    Raises EngineError when the install fails or the installed SGLang lacks something the plugin uses
    (the compatibility report's problems are in the message, with file and line)."""
    from hsextract.sglang.compat import check_installed
    from hsextract.sglang.keyfile import key_path
    from hsextract.sglang.server import build_command, redact

    py = python or server_python(settings, root)
    if install:
        cmd = [py, "-m", "pip", "install", "--no-deps", "--no-build-isolation", str(repo)]
        print("+", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace")
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", flush=True)
        if proc.returncode != 0:
            raise EngineError(f"installing {repo} into {py} failed (exit {proc.returncode}): "
                              f"{proc.stderr.strip()[-800:]}")
    installed = installed_plugin_dir(py)
    if plugin_source_hash(installed) != plugin_source_hash():
        raise EngineError(f"{py} imports the hsextract plugin from {installed}, which (or a module of hsextract it "
                          f"imports) differs from this checkout's {plugin_dir()}: reinstall (rule "
                          "build_patched_server with install on)")
    report = check_installed(py).summary()
    print(json.dumps(report, indent=1), flush=True)
    cfg = server_config_from(settings, root, python=py)
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
    mode = "shared" if cfg.share_prefixes else "flat"
    if mode not in report["prefix_modes"]:
        problems = "\n".join(p["text"] for p in report["problems"] if p["needed_for"] == mode)
        raise EngineError(f"share_prefixes: {str(cfg.share_prefixes).lower()} needs what the SGLang of {py} "
                          f"({report['sglang_version']}) lacks:\n{problems}")
    info = {
        "python": py,
        "sglang_version": report["sglang_version"],
        "plugin_version": __version__,
        "plugin_dir": str(installed),
        "plugin_sha256": plugin_source_hash(installed),
        "capture": cfg.capture,
        "capture_sources": report["capture_sources"],
        "share_prefixes": cfg.share_prefixes,  # the radix cache on (docs/SHARED_PREFIX.md section 5)
        # the key file each replica's command names (made when the server starts, on the host that runs it), never
        # the key
        "launch": [redact(build_command(cfg, r, key_path(state_dir(settings, root, host="<host>"), r)))
                   for r in range(cfg.replicas)],
    }
    write_json_atomic(out, info, sort_keys=True)
    return info
