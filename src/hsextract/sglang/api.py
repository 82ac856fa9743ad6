"""The one HTTP client of an SGLang server: `GET /health` and `POST /generate`, plus the retry policy.

Used by the capture engine (`sglang.client`), the server lifecycle (`sglang.server`, health only) and the
regenerate generator (`sglang.generate`). stdlib `http.client`, one fresh connection per request: a
kept-alive connection goes stale while its thread waits for dump files (the server closes idle connections
after a few seconds) and the next POST on it fails with BrokenPipe; on loopback a connect costs ~0.1 ms.

Errors: `TransientError` (connection error, timeout, HTTP 5xx, a body that is not JSON) is worth retrying;
`RequestRefused` (HTTP 4xx) and `ServerGone` (the key's server has died: nothing is sent) are not. `retrying`
builds the tenacity policy both callers use.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import tenacity

from hsextract.errors import ConfigError, EngineError


class TransientError(EngineError):
    """A request failure worth retrying (connection error, timeout, HTTP 5xx, non-JSON answer)."""


class ServerGone(EngineError):
    """The server a key was made for is gone (`SGLangAPI`'s `gone`): the key is not sent to its port."""


class RequestRefused(EngineError):
    """The server refused the request (HTTP 4xx): sending it again does not help."""

    def __init__(self, message: str, status: int, detail: str) -> None:
        super().__init__(message)
        self.status, self.detail = status, detail


def split_url(url: str) -> tuple[str, int, str]:
    """(host, port, path prefix) of an `http://host[:port][/prefix]` URL; ConfigError otherwise."""
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ConfigError(f"sglang server url {url!r}: expected http://host:port")
    return u.hostname, u.port or 80, u.path.rstrip("/")


class SGLangAPI:
    """`/health` and `/generate` of one server at `url` (http://host:port, optionally with a path prefix)."""

    def __init__(self, url: str, timeout_s: float = 600.0, api_key: str | None = None,
                 gone: Callable[[], str | None] | None = None) -> None:
        self.url = url.rstrip("/")
        self.host, self.port, self.prefix = split_url(self.url)
        self.timeout_s = timeout_s
        # sglang.api_key: the server was started with --api-key and refuses requests without the token
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._gone = gone  # why the key's server no longer holds the port (ServerHandle.gone), asked before each send

    def health(self, timeout_s: float = 5.0) -> str | None:
        """None when GET /health answers 200, else why not. Without the key: SGLang lets /health through
        unauthenticated (utils/auth.py), and whoever holds the port while a server loads would read it."""
        try:
            c = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
            try:
                c.request("GET", f"{self.prefix}/health")
                r = c.getresponse()
                r.read()
            finally:
                c.close()
        except (OSError, http.client.HTTPException) as e:
            return f"{type(e).__name__}: {e}"
        return None if r.status == 200 else f"HTTP {r.status}"

    def _json(self, method: str, path: str, body: str | None = None, echo: bool = True) -> tuple[Any, str]:
        """The decoded JSON answer of one request, and its first 300 characters. TransientError (no connection,
        5xx, not JSON) or RequestRefused (any other status). `echo`: quote the answer in errors (not one that may
        hold the key)."""
        what = f"{method} {path}"
        if self._auth and self._gone is not None and (why := self._gone()) is not None:
            raise ServerGone(f"{what} not sent: the server at {self.url} is gone ({why}), and whatever takes its "
                             "port could read the key")
        headers = {**({"Content-Type": "application/json"} if body is not None else {}), **self._auth}
        c = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            c.request(method, f"{self.prefix}{path}", body=body, headers=headers)
            r = c.getresponse()
            data = r.read()
        except (OSError, http.client.HTTPException) as e:
            raise TransientError(f"{what} failed: {type(e).__name__}: {e}") from e
        finally:
            c.close()
        text = data[:300].decode(errors="replace") if echo else ""
        said = f": {text}" if echo else ""
        if r.status >= 500:
            raise TransientError(f"{what} returned HTTP {r.status}{said}")
        if r.status != 200:
            raise RequestRefused(f"{what} was refused with HTTP {r.status}{said}", r.status, text)
        try:
            return json.loads(data), text
        except ValueError as e:
            raise TransientError(f"{what} returned non-JSON{said}") from e

    def server_args(self, names: Sequence[str]) -> dict[str, Any]:
        """The values of the server arguments `names` (absent ones left out) from GET /server_info, which holds
        all of them, the API key included: only the names asked for are kept, and no error quotes it."""
        out, _ = self._json("GET", "/server_info", echo=False)
        return {k: out[k] for k in names if isinstance(out, dict) and k in out}

    def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /generate with `payload`; the decoded JSON answer. TransientError or RequestRefused."""
        out, text = self._json("POST", "/generate", json.dumps(payload))
        if not isinstance(out, dict):
            raise TransientError(f"POST /generate returned JSON that is not an object: {text}")
        return out


def health(url: str, timeout_s: float = 5.0) -> str | None:
    """None when GET {url}/health answers 200, else why not (a malformed url included); never sends a key."""
    try:
        api = SGLangAPI(url)
    except ConfigError:
        return f"bad url {url!r}"
    return api.health(timeout_s)


def retrying(
    retries: int,
    backoff_s: float,
    *,
    max_backoff_s: float | None = None,
    retry_on: tuple[type[BaseException], ...] = (TransientError,),
    sleep: Callable[[float], Any] = time.sleep,
) -> tenacity.Retrying:
    """Up to `retries` retries of the exceptions `retry_on`, waiting backoff_s * 2**k (at most max_backoff_s)
    before retry k+1. Other exceptions pass through at once; when the retries are spent the last error is
    raised as is (reraise), so callers see the request's own error, not a tenacity wrapper."""
    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(retries + 1),
        wait=tenacity.wait_exponential(multiplier=backoff_s, min=0,
                                       max=max_backoff_s if max_backoff_s is not None else float("inf")),
        retry=tenacity.retry_if_exception_type(retry_on),
        sleep=sleep,
        reraise=True,
    )
