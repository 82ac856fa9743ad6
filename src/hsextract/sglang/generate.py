"""The SGLang generator: normal generation through a server's `/generate` with `input_ids`, for regenerate.

One request per prompt, `batch_size` in flight, through the same HTTP client and retry policy as the
capture engine (`sglang.api`). Request ids start with `RID_PREFIX`, which is not the plugin's dump prefix:
a patched server (one that also serves extraction) must not dump hidden states for these requests.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from hsextract.engines.base import SamplingSettings, cut_at_stop
from hsextract.errors import EngineError
from hsextract.sglang.api import RequestRefused, SGLangAPI, TransientError, retrying

RID_PREFIX = "regen-"  # not the plugin's DEFAULT_RID_PREFIX (tests/test_regenerate.py checks it is not dumped)
MAX_BACKOFF_S = 10.0


class SGLangGenerateSettings(SamplingSettings, Protocol):
    request_timeout_s: float
    retries: int
    send_seed: bool  # send `sampling_seed` (SGLang versions without it reject the request)


# SGLang (0.5.16: sampling/sampling_batch_info.py, from_schedule_batch) uses a request's `sampling_seed` only when
# the server runs with --enable-deterministic-inference (which also makes it sample with its pytorch backend);
# otherwise it drops the seed without a word and what is sampled depends on how requests were batched.
DETERMINISTIC_ARG = "enable_deterministic_inference"


def request_id(prompt: Sequence[int], seed: int | None, k: int) -> str:
    """A rid for prompt k of a call: stable for a (prompt, seed), never one the plugin dumps."""
    return f"{RID_PREFIX}{hashlib.sha256(repr((list(prompt), seed)).encode()).hexdigest()[:16]}-{k}"


class SGLangGenerator:
    """Token ids in, generated ids out (see engines.base.Generator) from the server at `url`."""

    def __init__(self, url: str, settings: SGLangGenerateSettings, stop_token_ids: Sequence[int],
                 api_key: str | None = None) -> None:
        self.api = SGLangAPI(url, settings.request_timeout_s, api_key=api_key)
        self.url = self.api.url + "/generate"  # for messages
        self.settings = settings
        self.stop_ids = list(stop_token_ids)
        self._seeding_checked = False
        self._nonce = secrets.token_hex(4)

    def sampling_params(self, seed: int | None) -> dict[str, Any]:
        s = self.settings
        params: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                                  "top_p": s.top_p, "top_k": s.top_k if s.top_k > 0 else -1,
                                  "stop_token_ids": self.stop_ids, "skip_special_tokens": False}
        if s.send_seed and seed is not None and s.temperature > 0:
            params["sampling_seed"] = seed
        return params

    def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        rid = payload.get("rid")
        try:
            for attempt in retrying(self.settings.retries, 0.5, max_backoff_s=MAX_BACKOFF_S):
                with attempt:
                    # a rid of its own per attempt and generator (a rerun's job): SGLang (0.5.16:
                    # tokenizer_manager.py) answers 400 "Duplicate request ID", which is not retried, while a
                    # timed-out request of that rid lives on in the server
                    n = attempt.retry_state.attempt_number - 1
                    return self.api.generate({**payload, "rid": f"{rid}-{self._nonce}-a{n}"})
        except RequestRefused as e:  # the request itself is wrong: it was not retried
            raise EngineError(f"regenerate: {self.url} answered {e.status} for request {rid}: {e.detail}") from None
        except TransientError as e:
            raise EngineError(f"regenerate: {self.url} failed for request {rid} after {self.settings.retries + 1} "
                              f"attempts: {e}. Is the server up?") from e
        raise AssertionError("unreachable: retrying() returns or raises")

    def _one(self, prompt: list[int], seed: int | None, rid: str) -> list[int]:
        out = self._post({"rid": rid, "input_ids": prompt, "sampling_params": self.sampling_params(seed)})
        ids = out.get("output_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise EngineError(f"regenerate: {self.url} gave no `output_ids` list for request {rid}: "
                              f"{json.dumps(out)[:300]}")
        ids = cut_at_stop(ids, self.stop_ids)
        finish = (out.get("meta_info") or {}).get("finish_reason") or {}
        matched = finish.get("matched") if isinstance(finish, Mapping) else None
        # Versions that trim the matched stop token from output_ids: put it back, it marks a finished turn.
        if isinstance(matched, int) and matched in self.stop_ids and (not ids or ids[-1] not in self.stop_ids):
            ids.append(matched)
        return ids

    def check_seeding(self) -> None:
        """EngineError when seeds would be sent to a server that ignores them (see DETERMINISTIC_ARG); a server
        that does not say (no /server_info, or no such argument) gets them, with a warning."""
        s = self.settings
        if self._seeding_checked or not (s.send_seed and s.temperature > 0):
            return
        try:
            args = self.api.server_args([DETERMINISTIC_ARG])
        except (TransientError, RequestRefused) as e:
            args = {}
            why = str(e)
        else:
            why = f"its /server_info has no {DETERMINISTIC_ARG}"
        if DETERMINISTIC_ARG not in args:
            print(f"WARNING: regenerate: cannot tell whether {self.api.url} uses the per-request sampling_seed "
                  f"({why}); SGLang uses it only when started with --enable-deterministic-inference",
                  file=sys.stderr, flush=True)
        elif not args[DETERMINISTIC_ARG]:
            raise EngineError(
                f"regenerate: the server at {self.api.url} ignores the per-request sampling_seed: SGLang uses it "
                "only when started with --enable-deterministic-inference (it then samples with its pytorch "
                "backend), so regenerate.seed would not decide what is sampled (temperature "
                f"{s.temperature:g}), how the server batches would. Restart the server with that flag, or set "
                "regenerate.send_seed: false to sample without seeds")
        self._seeding_checked = True

    def generate(self, prompts: list[list[int]], seeds: list[int] | None = None) -> list[list[int]]:
        self.check_seeding()
        seeds_ = seeds if seeds is not None else [None] * len(prompts)
        rids = [request_id(p, s, k) for k, (p, s) in enumerate(zip(prompts, seeds_, strict=True))]
        with ThreadPoolExecutor(max_workers=min(self.settings.batch_size, max(1, len(prompts)))) as pool:
            return list(pool.map(self._one, prompts, seeds_, rids))
