"""sglang.api: the one HTTP client of an SGLang server (health, generate, retry policy) and the plugin's
install check in sglang.config."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hsextract.errors import ConfigError, EngineError
from hsextract.sglang import config as sconf
from hsextract.sglang.api import RequestRefused, SGLangAPI, TransientError, health, retrying


class Scripted:
    """A server answering /generate with the next (status, body) of `script`, /health with 200."""

    def __init__(self, script: list[tuple[int, bytes]]) -> None:
        self.script = list(script)
        self.bodies: list[dict] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep pytest output clean
                pass

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self):
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                status, body = outer.script.pop(0)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Scripted:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_generate_answers_json_and_sends_the_payload():
    with Scripted([(200, b'{"output_ids": [1, 2]}')]) as srv:
        assert SGLangAPI(srv.url, 5.0).generate({"rid": "r1", "input_ids": [7]}) == {"output_ids": [1, 2]}
        assert srv.bodies == [{"rid": "r1", "input_ids": [7]}]
        assert SGLangAPI(srv.url + "/").health() is None


@pytest.mark.parametrize("status,body,error,message", [
    (503, b"busy", TransientError, "POST /generate returned HTTP 503: busy"),
    (200, b"<html>", TransientError, "POST /generate returned non-JSON: <html>"),
    (200, b"[1]", TransientError, "POST /generate returned JSON that is not an object: [1]"),
    (400, b"bad rid", RequestRefused, "POST /generate was refused with HTTP 400: bad rid"),
])
def test_generate_errors(status, body, error, message):
    with Scripted([(status, body)]) as srv:
        with pytest.raises(error) as e:
            SGLangAPI(srv.url).generate({})
    assert str(e.value) == message


def test_unreachable_server_and_bad_url():
    with Scripted([]) as srv:
        url = srv.url
    with pytest.raises(TransientError, match=r"^POST /generate failed: ConnectionRefusedError"):
        SGLangAPI(url).generate({})
    assert health(url).startswith("ConnectionRefusedError")
    assert health("https://x") == "bad url 'https://x'"
    with pytest.raises(ConfigError, match=r"sglang server url 'localhost:3000': expected http://host:port"):
        SGLangAPI("localhost:3000")


def test_retrying_retries_transient_errors_with_exponential_backoff():
    waits: list[float] = []
    with Scripted([(500, b"a"), (502, b"b"), (200, b'{"ok": 1}')]) as srv:
        api = SGLangAPI(srv.url)
        for attempt in retrying(3, 0.5, max_backoff_s=0.75, sleep=waits.append):
            with attempt:
                out = api.generate({})
    assert out == {"ok": 1} and waits == [0.5, 0.75] and len(srv.bodies) == 3


def test_retrying_reraises_the_last_error_and_passes_others_through():
    waits: list[float] = []
    with Scripted([(500, b"a"), (500, b"b"), (400, b"no")]) as srv:
        api = SGLangAPI(srv.url)
        with pytest.raises(TransientError, match="HTTP 500: b$"):
            for attempt in retrying(1, 1.0, sleep=waits.append):
                with attempt:
                    api.generate({})
        assert waits == [1.0]
        with pytest.raises(RequestRefused):  # not retried although retries are left
            for attempt in retrying(5, 1.0, sleep=waits.append):
                with attempt:
                    api.generate({})
    assert waits == [1.0] and len(srv.bodies) == 3


def test_installed_plugin_dir_is_what_the_server_python_imports(tmp_path, monkeypatch):
    src = str(Path(sconf.plugin_dir()).parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    assert sconf.installed_plugin_dir(sys.executable) == sconf.plugin_dir()
    with pytest.raises(EngineError, match=r"cannot import hsextract.sglang_plugin: install hsextract into"):
        sconf.installed_plugin_dir(_isolated_python(tmp_path))


def _isolated_python(tmp_path: Path) -> str:
    """A wrapper that runs this interpreter in isolated mode (no site-packages, no PYTHONPATH)."""
    w = tmp_path / "py"
    w.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    w.chmod(0o755)
    return str(w)


def test_plugin_source_hash_covers_every_module_the_server_imports(tmp_path):
    src = sconf.plugin_dir().parent
    copy = tmp_path / "hsextract"
    shutil.copytree(sconf.plugin_dir(), copy / "sglang_plugin", ignore=shutil.ignore_patterns("__pycache__"))
    for m in ("__init__.py", *sconf.SERVER_MODULES):
        shutil.copy(src / m, copy / m)
    plugin = copy / "sglang_plugin"
    assert sconf.plugin_source_hash(plugin) == sconf.plugin_source_hash()
    for changed in (plugin / "dumpfiles.py", copy / "atomic.py", copy / "__init__.py"):
        original = changed.read_bytes()
        changed.write_bytes(original + b"\n")
        assert sconf.plugin_source_hash(plugin) != sconf.plugin_source_hash(), changed
        changed.write_bytes(original)
    assert sconf.plugin_source_hash(plugin) == sconf.plugin_source_hash()


def test_server_modules_are_what_importing_the_plugin_imports():
    """A fresh interpreter that imports the plugin's entry module (as the SGLang server does) loads exactly
    the plugin package, hsextract's __init__ and SERVER_MODULES from hsextract; none of them imports
    the settings, schema or tokenizer stack."""
    import subprocess

    code = ("import sys, hsextract.sglang_plugin.plugin; "
            "print(' '.join(sorted(getattr(m, '__file__', '') or '' for n, m in sys.modules.items() "
            "if n.split('.')[0] == 'hsextract')))")
    env = {**os.environ, "PYTHONPATH": str(sconf.plugin_dir().parents[1])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    loaded = sorted(Path(f) for f in proc.stdout.split())
    assert loaded == sorted(sconf.server_source_files())
