"""Response regeneration: every assistant turn rewritten by the target model itself.

Drafters accept more when they are trained on what the target would say. This stage reads the input
conversations exactly as `prepare` does (same sources, same mixture order, same chunking over input
records: record k belongs to chunk k // prompts_per_chunk) and, turn by turn, replaces each assistant
message with the target's own generation:

  context of turn j = the conversation up to j, with the REGENERATED earlier assistant turns, rendered by
                      the same chat template with the same `chat_template_kwargs` as extraction
                      (add_generation_prompt=True) and tokenized without added special tokens, exactly as
                      `ChatMasker` tokenizes the full rendering later;
  generation        = sampled with the `regenerate` settings until the template's end-of-turn token (or
                      max_new_tokens); the end-of-turn token itself is not part of the message, the
                      template writes it back.

The generated ids are decoded and turned back into a message ({content} or {reasoning_content, content}
when the text holds a `</think>`). The split that the template renders back to exactly the prompt text +
the generated text is chosen; `stats.roundtrip` counts turns whose re-tokenized rendering holds exactly the
generated ids ("tokens"), only the same text ("text"), or neither ("none": e.g. a template that trims
content).

One output line per input record, so the regenerated file holds as many records as the input mixture and
`prepare` on it has the chunk count computed from the original sources:
  - regenerated conversation: {"id", "source", "messages", "tools"?}
  - a turn that produced no text (or hit max_new_tokens with `drop_truncated`): the conversation is cut
    before that turn; prepare then drops it if nothing is left to train (no_trained_tokens);
  - a malformed input record (lenient mode only; strict mode raises): {"id", "source", "messages": [],
    "malformed": reason}, which prepare counts as malformed (missing_messages) in lenient mode.
Assistant turns with tool calls: `tool_turns: keep` leaves them as in the source (the target's own tool
calls would not match the recorded tool results), `truncate` ends the conversation before the first one.
A conversation that ends with a user or tool message gets a generated final assistant turn when
`complete_last_turn` is true (prompt-only datasets).

Sampling is deterministic: each (sample_id, turn) gets its own seed derived from `seed`, used by a
torch.Generator per sample (transformers) or sent as `sampling_seed` (sglang), so the same config gives the
same file whatever the batch composition.

Files: `run_regenerate_chunk` writes chunk-NNNNN.jsonl and chunk-NNNNN.stats.json (stats first, then the
JSONL, each to a temporary name + rename): a failed chunk leaves no JSONL and reruns alone.
`concat_chunks` joins the chunk files, in chunk order, into the conversation file `prepare` reads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import torch

from hsextract.conversations import Conversation, MalformedRecordError, mixture, open_sources
from hsextract.atomic import write_atomic
from hsextract.errors import ConfigError, EngineError
from hsextract.loss_mask import ChatMasker

TOOL_TURNS = ("keep", "truncate")
ENGINES = ("transformers", "sglang")

# Outcomes counted in the stats.
EMPTY_GENERATION = "empty_generation"
TRUNCATED = "max_new_tokens"
NO_ASSISTANT_TURN = "no_assistant_turn"


@dataclass(frozen=True)
class RegenSettings:
    """The `regenerate:` config section (defaults here; documented in config/README.md)."""

    enabled: bool = False
    engine: str | None = None  # None: the run's `engine`
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 1024
    seed: int = 0
    batch_size: int = 8  # transformers: prompts per generate call; sglang: requests in flight
    tool_turns: str = "keep"
    complete_last_turn: bool = True
    drop_truncated: bool = False  # a turn that hit max_new_tokens cuts the conversation there
    stop_token_ids: tuple[int, ...] | None = None  # None: the template's end-of-turn token + eos
    think_start: str = "<think>"
    think_end: str = "</think>"
    # transformers engine
    device: str = "auto"  # auto: cuda if available
    dtype: str = "auto"  # auto: the checkpoint's dtype (float32 on the CPU)
    # sglang engine
    server_url: str | None = None
    request_timeout_s: float = 600.0
    retries: int = 3
    send_seed: bool = True  # send `sampling_seed` (SGLang versions without it reject the request)


def parse_settings(section: Any) -> RegenSettings:
    """Validate the `regenerate:` mapping; ConfigError names the key."""
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ConfigError("config key `regenerate` must be a mapping")
    allowed = {f.name for f in fields(RegenSettings)}
    unknown = set(section) - allowed
    if unknown:
        raise ConfigError(f"config key `regenerate` has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    s = dict(section)

    def num(key: str, lo: float, hi: float = math.inf, integer: bool = False) -> None:
        v = s.get(key, getattr(RegenSettings, key))
        ok = not isinstance(v, bool) and isinstance(v, int if integer else (int, float)) and lo <= v <= hi
        if not ok:
            raise ConfigError(f"config key `regenerate.{key}` must be {'an integer' if integer else 'a number'} in "
                              f"[{lo}, {hi}], got {v!r}")

    num("temperature", 0.0, 100.0)
    num("top_p", 1e-9, 1.0)
    num("top_k", 0, 2**31, integer=True)
    num("max_new_tokens", 1, 2**31, integer=True)
    num("seed", 0, 2**63 - 1, integer=True)
    num("batch_size", 1, 2**20, integer=True)
    num("request_timeout_s", 1e-3)
    num("retries", 0, 100, integer=True)
    for key in ("enabled", "complete_last_turn", "drop_truncated", "send_seed"):
        if key in s and not isinstance(s[key], bool):
            raise ConfigError(f"config key `regenerate.{key}` must be true or false, got {s[key]!r}")
    if s.get("engine") is not None and s["engine"] not in ENGINES:
        raise ConfigError(f"config key `regenerate.engine` is {s['engine']!r}; allowed: {', '.join(ENGINES)} or null")
    if s.get("tool_turns", "keep") not in TOOL_TURNS:
        raise ConfigError(f"config key `regenerate.tool_turns` is {s['tool_turns']!r}; allowed: keep, truncate")
    stops = s.get("stop_token_ids")
    if stops is not None:
        if not isinstance(stops, Sequence) or not stops or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stops):
            raise ConfigError(f"config key `regenerate.stop_token_ids` must be a non-empty list of token ids or "
                              f"null, got {stops!r}")
        s["stop_token_ids"] = tuple(stops)
    for key in ("think_start", "think_end"):
        if key in s and (not isinstance(s[key], str) or not s[key]):
            raise ConfigError(f"config key `regenerate.{key}` must be a non-empty string")
    return RegenSettings(**s)


# ------------------------------------------------------------------------------------------- generators


class Generator(Protocol):
    """Token ids in, generated token ids out, in order. An output ends with a stop token when the
    generation stopped on one (nothing after it), otherwise it hit max_new_tokens. `seeds`, one per
    prompt, make sampling reproducible whatever the batching."""

    def generate(self, prompts: list[list[int]], seeds: list[int] | None = None) -> list[list[int]]: ...


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """Ids up to and including the first stop id (all of them when none occurs)."""
    stops = set(stop_ids)
    for k, t in enumerate(ids):
        if t in stops:
            return list(ids[:k + 1])
    return list(ids)


def sample_seed(seed: int, sample_id: str, turn: int) -> int:
    """A 63-bit seed per (sample, turn): independent of chunking, batching and order."""
    digest = hashlib.sha256(f"{seed}\x00{sample_id}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, top-k, top-p (nucleus: the smallest set whose probability reaches top_p) on one row."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token already enough
        logits = logits.clone()
        logits[order[drop]] = -math.inf
    return logits


class _SeededSampler:
    """A logits processor that samples each row with its own torch.Generator and leaves only the drawn token:
    `generate` in greedy mode then picks exactly that token. Rows draw independently of each other."""

    def __init__(self, seeds: list[int], temperature: float, top_k: int, top_p: float) -> None:
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, -math.inf)
        for b, gen in enumerate(self.gens):
            logits = _filter_logits(scores[b].detach().cpu(), self.temperature, self.top_k, self.top_p)
            tok = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
            out[b, int(tok)] = 0.0
        return out


class TransformersGenerator:
    """`model.generate` in-process, batched with left padding; greedy when temperature is 0."""

    def __init__(self, model: Any, settings: RegenSettings, stop_token_ids: Sequence[int],
                 pad_token_id: int | None = None) -> None:
        self.model = model
        self.settings = settings
        self.stop_ids = list(stop_token_ids)
        self.pad_id = self.stop_ids[0] if pad_token_id is None else pad_token_id

    def _generation_config(self) -> Any:
        from transformers import GenerationConfig

        # A fresh config, also set on the model: generate() fills unset fields from model.generation_config,
        # and a checkpoint's generation_config.json (do_sample, temperature, repetition_penalty...) must not
        # change what the `regenerate` settings ask for.
        gc = GenerationConfig(max_new_tokens=self.settings.max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=self.stop_ids, pad_token_id=self.pad_id, use_cache=True)
        self.model.generation_config = gc
        return gc

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], seeds: list[int] | None = None) -> list[list[int]]:
        out: list[list[int]] = []
        bs = self.settings.batch_size
        for i in range(0, len(prompts), bs):
            out.extend(self._batch(prompts[i:i + bs], None if seeds is None else seeds[i:i + bs]))
        return out

    def _batch(self, prompts: list[list[int]], seeds: list[int] | None) -> list[list[int]]:
        if any(not p for p in prompts):
            raise EngineError("regenerate: an empty prompt cannot be generated from")
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, width - len(p):] = 1
        kwargs: dict[str, Any] = {}
        if self.settings.temperature > 0:
            from transformers import LogitsProcessorList

            row_seeds = seeds if seeds is not None else [self.settings.seed] * len(prompts)
            kwargs["logits_processor"] = LogitsProcessorList([_SeededSampler(
                row_seeds, self.settings.temperature, self.settings.top_k, self.settings.top_p)])
        try:
            gen = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      generation_config=self._generation_config(), **kwargs)
        except Exception as e:
            raise EngineError(f"regenerate: transformers generate failed on a batch of {len(prompts)} prompts "
                              f"(longest {width} tokens): {e}") from e
        gen = gen[:, width:].cpu().tolist()
        return [cut_at_stop(g, self.stop_ids) for g in gen]


class SGLangGenerator:
    """Normal generation through an SGLang server's `/generate` with `input_ids` (one request per prompt,
    `batch_size` in flight). stdlib HTTP: no client dependency."""

    def __init__(self, url: str, settings: RegenSettings, stop_token_ids: Sequence[int]) -> None:
        self.url = url.rstrip("/") + "/generate"
        self.settings = settings
        self.stop_ids = list(stop_token_ids)

    def sampling_params(self, seed: int | None) -> dict[str, Any]:
        s = self.settings
        params: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                                  "top_p": s.top_p, "top_k": s.top_k if s.top_k > 0 else -1,
                                  "stop_token_ids": self.stop_ids, "skip_special_tokens": False}
        if s.send_seed and seed is not None and s.temperature > 0:
            params["sampling_seed"] = seed
        return params

    def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps(payload).encode()
        last: Exception | None = None
        for attempt in range(self.settings.retries + 1):
            req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.settings.request_timeout_s) as resp:
                    return json.loads(resp.read().decode("utf-8"))
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode("utf-8", "replace")
                if 400 <= e.code < 500:  # the request itself is wrong: retrying does not help
                    raise EngineError(f"regenerate: {self.url} answered {e.code} for request {payload.get('rid')}: "
                                      f"{detail}") from None
                last = EngineError(f"{e.code}: {detail}")
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as e:
                last = e
            if attempt < self.settings.retries:
                time.sleep(min(2.0 ** attempt * 0.5, 10.0))
        raise EngineError(f"regenerate: {self.url} failed for request {payload.get('rid')} after "
                          f"{self.settings.retries + 1} attempts: {last}. Is the server up?")

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
        if (isinstance(matched, int) and matched in self.stop_ids and (not ids or ids[-1] not in self.stop_ids)):
            ids.append(matched)
        return ids

    def generate(self, prompts: list[list[int]], seeds: list[int] | None = None) -> list[list[int]]:
        seeds_ = seeds if seeds is not None else [None] * len(prompts)
        rids = [f"hsx-regen-{hashlib.sha256(repr((p, s)).encode()).hexdigest()[:16]}-{k}"
                for k, (p, s) in enumerate(zip(prompts, seeds_))]
        with ThreadPoolExecutor(max_workers=min(self.settings.batch_size, max(1, len(prompts)))) as pool:
            return list(pool.map(self._one, prompts, seeds_, rids))


# ------------------------------------------------------------------------------------------- template


def end_of_turn_ids(tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Stop tokens: the first token of the text the template writes after an assistant message (when it is
    a special/added token: <|eot_id|>, <|im_end|>, <｜end▁of▁sentence｜>), then eos."""
    masker = ChatMasker(tokenizer, chat_template_kwargs=dict(chat_template_kwargs or {}))
    sent = "\ue000"
    text = masker.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": sent}])
    tail = text[text.rfind(sent) + 1:]
    out: list[int] = []
    if tail:
        first = tokenizer(tail, add_special_tokens=False)["input_ids"][:1]
        special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        if first and first[0] in special:
            out.append(first[0])
    eos = tokenizer.eos_token_id
    for t in eos if isinstance(eos, list) else [eos]:
        if t is not None and t not in out:
            out.append(t)
    if not out:
        raise ConfigError("regenerate: the chat template writes no special end-of-turn token and the tokenizer has "
                          "no eos_token: set `regenerate.stop_token_ids`")
    return out


@dataclass
class _Turn:
    conv: int  # index in the chunk
    j: int  # message index
    prompt_text: str
    prompt_ids: list[int]
    seed: int
    append: bool  # a new final turn (the conversation ended with a user/tool message)


@dataclass
class RegenStats:
    conversations: int = 0
    malformed: Counter = field(default_factory=Counter)
    turns_regenerated: int = 0
    turns_appended: int = 0
    turns_kept_tool_calls: int = 0
    turns_hit_max_new_tokens: int = 0
    conversations_cut: Counter = field(default_factory=Counter)  # reason -> conversations cut short
    generated_tokens: int = 0
    roundtrip: Counter = field(default_factory=Counter)  # tokens | text | none

    def as_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting the pairs.
        return {f.name: dict(sorted(v.items())) if isinstance(v := getattr(self, f.name), Counter) else v
                for f in fields(self)}


def _split_candidates(text: str, s: RegenSettings) -> list[dict[str, str]]:
    """Messages the generated text may be rendered from, most faithful first."""
    cands: list[dict[str, str]] = []
    if s.think_end in text:
        reasoning, content = text.split(s.think_end, 1)
        r = reasoning.lstrip()
        if r.startswith(s.think_start):
            reasoning = r[len(s.think_start):]
        # Stripped first (clean messages; templates such as Qwen3 strip these newlines themselves), then raw.
        cands.append({"reasoning_content": reasoning.strip("\n"), "content": content.lstrip("\n")})
        cands.append({"reasoning_content": reasoning, "content": content})
    cands.append({"content": text})
    return cands


class Regenerator:
    """Regenerates the assistant turns of conversations with one tokenizer/template and one generator."""

    def __init__(self, tokenizer: Any, generator: Generator, settings: RegenSettings,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.masker = ChatMasker(tokenizer, chat_template_kwargs=dict(chat_template_kwargs or {}))
        self.tokenizer = tokenizer
        self.generator = generator
        self.settings = settings
        self.stop_ids = list(settings.stop_token_ids or end_of_turn_ids(tokenizer, chat_template_kwargs))

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _next_turn(self, msgs: list[dict[str, Any]], start: int, stats: RegenStats) -> tuple[int, bool] | None:
        """(message index, append) of the next turn to generate at or after `start`, or None when done.
        Cuts the conversation in place under tool_turns=truncate."""
        j = start
        while j < len(msgs):
            m = msgs[j]
            if m["role"] == "assistant":
                if not m.get("tool_calls"):
                    return j, False
                if self.settings.tool_turns == "truncate":
                    del msgs[j:]
                    break
                stats.turns_kept_tool_calls += 1
            j += 1
        if self.settings.complete_last_turn and msgs and msgs[-1]["role"] in ("user", "tool"):
            return len(msgs), True
        return None

    def _message(self, head: list[dict[str, Any]], tools: Any, prompt: _Turn, body: list[int],
                 stats: RegenStats) -> dict[str, Any]:
        text = self.tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        cands = _split_candidates(text, self.settings)
        want_text = prompt.prompt_text + text
        for cand in cands:
            msg = {"role": "assistant", **{k: v for k, v in cand.items() if v or k == "content"}}
            try:
                rendered = self.masker.render(head + [msg], tools)
            except Exception:  # noqa: BLE001 - a candidate the template refuses is just not the one
                continue
            if rendered.startswith(want_text):
                ids = self._ids(rendered)
                exact = ids[:len(prompt.prompt_ids) + len(body)] == prompt.prompt_ids + body
                stats.roundtrip["tokens" if exact else "text"] += 1
                return msg
        stats.roundtrip["none"] += 1
        c = cands[0]
        return {"role": "assistant", **{k: v for k, v in c.items() if v or k == "content"}}

    def regenerate(self, conversations: Sequence[Conversation | None], sample_ids: Sequence[str] | None = None,
                   stats: RegenStats | None = None) -> list[Conversation | None]:
        """Each conversation with its assistant turns regenerated (None stays None). Turns are generated in
        rounds: round r generates the next turn of every conversation, so a batch holds many samples."""
        stats = stats if stats is not None else RegenStats()
        ids = list(sample_ids) if sample_ids is not None else [str(k) for k in range(len(conversations))]
        work: list[list[dict[str, Any]] | None] = [
            None if c is None else [dict(m) for m in c.messages] for c in conversations]
        tools = [None if c is None else c.tools for c in conversations]
        pos: dict[int, int] = {k: 0 for k, w in enumerate(work) if w is not None}
        stats.conversations += len(pos)
        while pos:
            turns: list[_Turn] = []
            for k in sorted(pos):
                msgs = work[k]
                assert msgs is not None
                nxt = self._next_turn(msgs, pos[k], stats)
                if nxt is None:
                    del pos[k]
                    continue
                j, append = nxt
                text = self.masker.render(msgs[:j], tools[k], add_generation_prompt=True)
                turns.append(_Turn(k, j, text, self._ids(text), sample_seed(self.settings.seed, ids[k], j), append))
            if not turns:
                break
            outs = self.generator.generate([t.prompt_ids for t in turns], [t.seed for t in turns])
            if len(outs) != len(turns):
                raise EngineError(f"regenerate: the generator returned {len(outs)} outputs for {len(turns)} prompts")
            for t, out in zip(turns, outs):
                msgs = work[t.conv]
                assert msgs is not None
                stopped = bool(out) and out[-1] in self.stop_ids
                body = out[:-1] if stopped else list(out)
                stats.generated_tokens += len(out)
                if not stopped:
                    stats.turns_hit_max_new_tokens += 1
                reason = None
                if not stopped and self.settings.drop_truncated:
                    reason = TRUNCATED
                msg = self._message(msgs[:t.j], tools[t.conv], t, body, stats) if reason is None else None
                if msg is not None and not msg["content"].strip() and not msg.get("reasoning_content"):
                    reason = EMPTY_GENERATION
                if reason is not None:
                    stats.conversations_cut[reason] += 1
                    del msgs[t.j:]
                    del pos[t.conv]
                    continue
                assert msg is not None
                if t.append:
                    msgs.append(msg)
                    stats.turns_appended += 1
                else:
                    msgs[t.j] = msg
                    stats.turns_regenerated += 1
                pos[t.conv] = t.j + 1
        out: list[Conversation | None] = []
        for k, w in enumerate(work):
            if w is None:
                out.append(None)
                continue
            if not any(m["role"] == "assistant" for m in w):
                stats.conversations_cut[NO_ASSISTANT_TURN] += 1
            out.append(Conversation(messages=w, tools=tools[k]))
        return out


def regenerate_chunk(conversations: Sequence[Conversation | None], generator: Generator, settings: RegenSettings,
                     *, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None,
                     sample_ids: Sequence[str] | None = None, stats: RegenStats | None = None
                     ) -> list[Conversation | None]:
    """Conversations with every assistant turn regenerated by `generator` (see the module docstring)."""
    return Regenerator(tokenizer, generator, settings, chat_template_kwargs).regenerate(
        conversations, sample_ids, stats)


# ------------------------------------------------------------------------------------------- chunk files


def chunk_name(chunk: int) -> str:
    return f"chunk-{chunk:05d}.jsonl"


def stats_path(out_path: str | os.PathLike[str]) -> Path:
    p = Path(out_path)
    return p.with_name(p.name.removesuffix(".jsonl") + ".stats.json")


def _record(sample_id: str, source: str, conv: Conversation) -> dict[str, Any]:
    rec: dict[str, Any] = {"id": sample_id, "source": source, "messages": conv.messages}
    if conv.tools:
        rec["tools"] = conv.tools
    return rec


def _model_settings(config: Mapping[str, Any]) -> tuple[list[Any], int, int, bool]:
    sources = config.get("sources")
    ppc = config.get("prompts_per_chunk")
    if isinstance(ppc, bool) or not isinstance(ppc, int) or ppc <= 0:
        raise ConfigError(f"config key `prompts_per_chunk` must be a positive integer, got {ppc!r}")
    seed = config.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"config key `seed` must be an integer, got {seed!r}")
    strict = config.get("strict", True)
    if not isinstance(strict, bool):
        raise ConfigError(f"config key `strict` must be true or false, got {strict!r}")
    return sources, ppc, seed, strict


def make_generator(config: Mapping[str, Any], settings: RegenSettings, tokenizer: Any,
                   stop_ids: Sequence[int]) -> Generator:
    """The generator the config asks for: `regenerate.engine` or else the run's `engine`."""
    engine = settings.engine or config.get("engine", "transformers")
    if engine == "sglang":
        if not settings.server_url:
            raise ConfigError("config key `regenerate.server_url` must be set (http://host:port of the SGLang "
                              "server) when regeneration runs on the sglang engine")
        return SGLangGenerator(settings.server_url, settings, stop_ids)
    if engine != "transformers":
        raise ConfigError(f"config key `engine` is {engine!r}; regeneration supports {', '.join(ENGINES)}")
    from transformers import AutoModelForCausalLM

    model_path = config.get("model")
    if not model_path:
        raise ConfigError("config key `model` must name a model directory for regeneration")
    device = settings.device if settings.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype: Any = "auto" if settings.dtype == "auto" else getattr(torch, settings.dtype, None)
    if dtype is None:
        raise ConfigError(f"config key `regenerate.dtype` is {settings.dtype!r}: not a torch dtype")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(device).eval()
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key `model`: cannot load {model_path} for regeneration: {e}") from e
    return TransformersGenerator(model, settings, stop_ids, pad_token_id=tokenizer.pad_token_id)


def num_chunks(config: Mapping[str, Any]) -> int:
    """Same count as prepare's: ceil(input records / prompts_per_chunk)."""
    from hsextract.conversations import count_records

    sources, ppc, _, _ = _model_settings(config)
    return math.ceil(count_records(sources) / ppc)


def run_regenerate_chunk(config: Mapping[str, Any], chunk_index: int, out_path: str | os.PathLike[str], *,
                         tokenizer: Any = None, generator: Generator | None = None) -> dict[str, Any]:
    """Regenerate the input records of chunk `chunk_index` and write `out_path` (JSONL) and its stats JSON.

    `tokenizer` defaults to config `tokenizer` or `model` (with config `chat_template` applied); `generator`
    defaults to `make_generator`. Returns the stats dict."""
    from hsextract.tokenizer_loading import load_tokenizer

    settings = parse_settings(config.get("regenerate"))
    sources_cfg, ppc, seed, strict = _model_settings(config)
    kwargs = config.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise ConfigError("config key `chat_template_kwargs` must be a mapping")
    sources = open_sources(sources_cfg)
    order = mixture(sources, seed)
    total = math.ceil(len(order) / ppc)
    if not 0 <= chunk_index < total:
        raise ConfigError(f"regenerate: chunk {chunk_index} does not exist: the sources hold {len(order)} records "
                          f"= {total} chunks of {ppc}")
    tok = load_tokenizer(tokenizer if tokenizer is not None else (config.get("tokenizer") or config.get("model")),
                         config.get("chat_template"), trust_remote_code=bool(config.get("trust_remote_code")))
    stop_ids = list(settings.stop_token_ids or end_of_turn_ids(tok, kwargs))
    settings = RegenSettings(**{**asdict(settings), "stop_token_ids": tuple(stop_ids)})
    gen = generator if generator is not None else make_generator(config, settings, tok, stop_ids)

    entries = order[chunk_index * ppc:(chunk_index + 1) * ppc]
    stats = RegenStats()
    convs: list[Conversation | None] = []
    bad: dict[int, str] = {}
    for k, entry in enumerate(entries):
        try:
            _, conv = sources[entry.source].read(entry.index)
        except MalformedRecordError as e:
            if strict:
                raise
            stats.malformed[e.reason] += 1
            bad[k] = e.reason
            conv = None
        convs.append(conv)
    regen = regenerate_chunk(convs, gen, settings, tokenizer=tok, chat_template_kwargs=kwargs,
                             sample_ids=[e.sample_id for e in entries], stats=stats)

    lines = []
    for k, (entry, conv) in enumerate(zip(entries, regen)):
        name = sources[entry.source].spec.name
        if conv is None:
            rec = {"id": entry.sample_id, "source": name, "messages": [], "malformed": bad[k]}
        else:
            rec = _record(entry.sample_id, name, conv)
        lines.append(json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n")
    out = Path(out_path)
    summary = {"chunk": chunk_index, "records": len(entries), **stats.as_dict(),
               "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()
                            if k != "enabled"} | {"seed_mixture": seed}}
    # Stats first: the JSONL (what Snakemake tracks) exists only once everything is written.
    write_atomic(stats_path(out), lambda f: f.write((json.dumps(summary, indent=2, sort_keys=True) + "\n").encode()))
    write_atomic(out, lambda f: f.writelines(line.encode() for line in lines))
    return summary


def concat_chunks(chunk_paths: Sequence[str | os.PathLike[str]], out_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Join chunk JSONL files (in the given order) into one conversation file; also sums their stats into
    `<out>.stats.json` when every chunk has one. Returns the summed stats."""
    out = Path(out_path)
    paths = [Path(p) for p in chunk_paths]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ConfigError(f"regenerate: chunk files missing: {missing[:5]} (rerun their chunks)")

    def write(f: Any) -> None:
        for p in paths:
            with open(p, "rb") as src:
                data = src.read()
            if data and not data.endswith(b"\n"):
                raise ConfigError(f"{p}: the chunk file does not end with a newline: truncated? delete it and "
                                  f"rerun its chunk")
            f.write(data)

    write_atomic(out, write)
    summed: dict[str, Any] = {"chunks": len(paths)}
    for p in paths:
        sp = stats_path(p)
        if not sp.is_file():
            continue
        st = json.loads(sp.read_text())
        summed.setdefault("settings", st.get("settings"))
        for k, v in st.items():
            if k in ("chunk", "settings"):
                continue
            if isinstance(v, dict):
                acc = summed.setdefault(k, {})
                for kk, vv in v.items():
                    acc[kk] = acc.get(kk, 0) + vv
            elif isinstance(v, int):
                summed[k] = summed.get(k, 0) + v
    write_atomic(stats_path(out), lambda f: f.write((json.dumps(summed, indent=2, sort_keys=True) + "\n").encode()))
    return summed


__all__ = [
    "Generator", "RegenSettings", "RegenStats", "Regenerator", "SGLangGenerator", "TransformersGenerator",
    "chunk_name", "concat_chunks", "cut_at_stop", "end_of_turn_ids", "make_generator", "num_chunks",
    "parse_settings", "regenerate_chunk", "run_regenerate_chunk", "sample_seed", "stats_path",
]
