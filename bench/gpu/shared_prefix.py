"""Shared prefixes on the real SGLang server (docs/SHARED_PREFIX.md 5.7): one chunk sent with sharing off and on.

The chunk is synthetic agentic data: --convs conversations of --turns turns, each opening with one --decl-token
tool declaration; a turn is a user message, reasoning and an answer, and later turns' history drops the reasoning
(Kimi-K2.5's template), so each turn is one sample (split_turns: auto). The references are prepare's
(hsextract.prepare.prefix_share.find_parents, records = conversations). Random token ids of the model's vocabulary.

Two servers of the model, one after the other on the GPU (hsextract.sglang.server, plugin capture, final state
pre_norm): flat (--disable-radix-cache, as every run so far) and shared (radix cache on, HSEXTRACT_SHARED_PREFIX=1,
SGLangEngine(share_prefixes=True): parents' sources first, a cache key per family). Each extracts the chunk through
extract_chunk into a shard after a warm-up on other prompts; timed (wall seconds of extract_chunk). Prefill tokens
twice: rows the plugin dumped (the chunk summary's computed_tokens) and the server log's `#new-token` summed over
the run (SGLang 0.5.16 logs it per prefill batch: sglang/srt/managers/scheduler_components/metrics_reporter.py:560).
Then every assembled sample of the shared shard against the flat shard's, per sample and tensor
(hsextract.extract.fidelity rel), and with --reference (default: every sample) both against the transformers engine
on the same GPU (token_budget 1: each prompt alone).

Pass: the flat run computes the materialized tokens; the shared run's computed tokens and its server's #new-token
within 10% of the distinct tokens (sum of seq - prefix_len); the shared shard is version 2; every sample of each
run within --tol (the dense per-sample bound, 2e-2) of the other run and of the reference. Use a dense model or a
routing-fixed twin (mk_models.py deepseek-fixed, llama): the random-routing MoE's flips are not capture errors.
Results: OUT/shared-prefix-<name>.json and .md (the json is rewritten after each stage; a kill keeps what ran).

CPU dry run of the plumbing (tests/fake_sglang.py with the real plugin code; its states are no model's, so the
reference check FAILS there, as it must): SP_DRY=1 in bench/gpu/run_shared_prefix.sh, or
    HSX_DEVICE=cpu PYTHONPATH=src:tests python bench/gpu/shared_prefix.py --model DIR --name x --state /tmp/s \\
        --out /tmp/o --server-module fake_sglang --convs 4 --turns 3 --decl 80
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from hsextract.capture import preset_layers
from hsextract.config.model_info import read_model_shape
from hsextract.engines.base import CaptureSpec, Prompt
from hsextract.extract.fidelity import TOL, rel
from hsextract.extract.run import ChunkPrompts, extract_chunk
from hsextract.prepare.prefix_share import distinct_tokens, find_parents

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shard_meta import placeholder_metadata

_NEW = re.compile(r"Prefill batch.*?#new-token: (\d+), #cached-token: (\d+)")


def synthetic_chunk(a: argparse.Namespace, vocab: int) -> ChunkPrompts:
    g = torch.Generator().manual_seed(a.seed)

    def rnd(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    decl = rnd(a.decl)
    ids, masks, records = [], [], []
    for c in range(a.convs):
        hist = list(decl)
        for _ in range(a.turns):
            user, reason, answer = rnd(a.user), rnd(a.reason), rnd(a.answer)
            ids.append(hist + user + reason + answer)
            masks.append([0] * (len(hist) + len(user)) + [1] * (len(reason) + len(answer)))
            records.append(c)
            hist = hist + user + answer  # the template drops earlier turns' reasoning
    refs = find_parents(ids, records)
    return ChunkPrompts([f"c{r:03d}-t{k:02d}" for k, r in enumerate(records)], ids, masks, [p for p, _ in refs],
                        [k for _, k in refs])


def settled_size(log: Path, settle_s: float = 10.0) -> int:
    """The log's size once it stopped growing for a second (the warm-up's last lines come through a filter)."""
    last, deadline = -1, time.monotonic() + settle_s
    while True:
        size = log.stat().st_size
        if size == last or time.monotonic() > deadline:
            return size
        last = size
        time.sleep(1.0)


def server_prefill(log: Path, offset: int, settle_s: float = 10.0) -> tuple[int, int, int]:
    """(#new-token, #cached-token, prefill batches) summed over the log's lines after `offset`; read until two
    reads a second apart agree (the log reaches the file through a filter process)."""
    last = None
    deadline = time.monotonic() + settle_s
    while True:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        hits = [(int(n), int(c)) for n, c in _NEW.findall(text)]
        now = (sum(n for n, _ in hits), sum(c for _, c in hits), len(hits))
        if now == last or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(1.0)


def run_mode(a: argparse.Namespace, shared: bool, chunk: ChunkPrompts, spec: CaptureSpec, vocab: int, out: Path,
             res: dict) -> Path:
    """Start the mode's server, warm it up, extract the chunk into a shard (timed), stop it; the shard's path."""
    from hsextract.sglang.client import SGLangEngine
    from hsextract.sglang.server import ServerConfig, ensure_server, stop_servers

    mode = "shared" if shared else "flat"
    r = res.setdefault("runs", {}).setdefault(mode, {})
    state = Path(a.state) / mode
    cfg = ServerConfig(model=a.model, aux_layers=spec.aux_layers, python=sys.executable, port=a.port + int(shared),
                       chunked_prefill_size=a.chunked_prefill_size, capture="plugin", final_state=spec.final_state,
                       launch_args=tuple(shlex.split(a.sgl_args)), run_name=f"{a.name}-{mode}",
                       module=a.server_module, startup_timeout_s=a.startup_timeout, share_prefixes=shared)
    t0 = time.monotonic()
    try:
        h = ensure_server(state, cfg)
        r["startup_s"] = round(time.monotonic() - t0, 1)
        r["command"] = h.command
        print(f"[{a.name}] {mode} server up in {r['startup_s']} s", flush=True)
        eng = SGLangEngine(h, spec, concurrency=a.concurrency, timeout_s=120, retries=1, run_name=f"{a.name}-{mode}",
                           share_prefixes=shared)
        r["engine_version"] = eng.version()
        g = torch.Generator().manual_seed(a.seed + 1)
        warm = [Prompt(i, f"warm{i}", torch.randint(0, vocab, (int(n),), generator=g).tolist())
                for i, n in enumerate(torch.randint(16, 600, (2 * a.concurrency,), generator=g))]
        list(eng.extract(warm))  # kernels of the usual shapes compiled before the timed run; its own cache keys
        log = Path(h.log) if h.log else None
        mark = settled_size(log) if log is not None and log.is_file() else 0
        meta = placeholder_metadata(int(eng.plugin_info()["hidden_size"]), spec.aux_layers, model=a.name,
                                    engine="sglang", engine_version=r["engine_version"], final_state=spec.final_state)
        shard = out / f"{a.name}-{mode}.hss"
        data = chunk if shared else ChunkPrompts(chunk.sample_ids, chunk.input_ids, chunk.loss_masks)
        t1 = time.monotonic()
        summary = extract_chunk(data, shard, eng, meta, level=1, threads=a.shard_threads, progress=False)
        r["wall_s"] = round(time.monotonic() - t1, 2)
        r["summary"] = summary
        r["computed_tokens"] = summary["computed_tokens"]
        if log is not None and log.is_file():
            r["server_new_tokens"], r["server_cached_tokens"], r["prefill_batches"] = server_prefill(log, mark)
        return shard
    finally:
        logs = sorted(state.glob("replica-*.log"))
        if logs:
            (out / f"server-{a.name}-{mode}.log").write_bytes(logs[0].read_bytes()[-200_000:])
        stop_servers(state, grace_s=10)


def compare(flat: Path, shared: Path, tol: float) -> dict:
    """Every assembled sample of the shared shard against the flat one: per-sample rel of each tensor."""
    from hsextract.shard import ShardReader

    fr, sr = ShardReader(flat), ShardReader(shared)
    worst, over, bitwise = 0.0, [], 0
    for i in range(len(fr)):
        x, y = fr[i], sr[i]
        if not torch.equal(x["input_ids"], y["input_ids"]) or not torch.equal(x["loss_mask"], y["loss_mask"]):
            over.append(f"{fr.sample_ids[i]}: ids or loss mask differ")
            continue
        errs = [rel(b, a) for a, b in zip(x["hidden_states"], y["hidden_states"], strict=True)]
        worst = max(worst, *errs)
        bitwise += all(torch.equal(a, b) for a, b in zip(x["hidden_states"], y["hidden_states"], strict=True))
        if max(errs) > tol:
            over.append(f"{fr.sample_ids[i]}: {max(errs):.3g}")
    sr.verify()
    refs = [(p, k) for p, k in zip(sr.parents, sr.prefix_lens, strict=True) if p >= 0]
    return {"samples": len(fr), "max_rel": worst, "over_tol": over[:20], "n_over_tol": len(over),
            "bitwise_equal_samples": bitwise, "format_versions": [fr.metadata["format_version"],
                                                                  sr.metadata["format_version"]],
            "stored_references": len(refs), "stored_tokens": [fr.stored_tokens, sr.stored_tokens]}


def against_reference(a: argparse.Namespace, chunk: ChunkPrompts, spec: CaptureSpec, shards: dict[str, Path],
                      device: str) -> dict:
    """Both shards against the transformers engine, each prompt alone (the first --reference samples)."""
    from hsextract.engines.transformers_engine import TransformersEngine
    from hsextract.shard import ShardReader

    n = min(a.reference, len(chunk.input_ids))
    prompts = [Prompt(i, chunk.sample_ids[i], chunk.input_ids[i]) for i in range(n)]
    readers = {m: ShardReader(p) for m, p in shards.items()}
    worst = dict.fromkeys(shards, 0.0)
    over: dict[str, list[str]] = {m: [] for m in shards}
    with TransformersEngine(a.model, spec, device=device, token_budget=1, max_batch=1) as eng:
        version = eng.version()
        for c in eng.extract(prompts):
            ref = [t.cpu() for t in c.hidden_states]
            for m, r in readers.items():
                e = max(rel(x, y) for x, y in zip(r[c.index]["hidden_states"], ref, strict=True))
                worst[m] = max(worst[m], e)
                if e > a.tol:
                    over[m].append(f"{c.sample_id}: {e:.3g}")
    return {"samples": n, "engine": version + " (token_budget 1)", "max_rel": worst,
            "n_over_tol": {m: len(v) for m, v in over.items()}, "over_tol": {m: v[:20] for m, v in over.items()}}


def verdict(res: dict, tol_share: float = 0.10) -> dict:
    runs, ch = res.get("runs", {}), res["chunk"]
    flat, shared = runs.get("flat", {}), runs.get("shared", {})
    checks = {
        "flat_computes_every_token": flat.get("computed_tokens") == ch["tokens"],
        "shared_computes_the_distinct_tokens": shared.get("computed_tokens") is not None
        and abs(shared["computed_tokens"] - ch["distinct_tokens"]) <= tol_share * ch["distinct_tokens"],
    }
    if shared.get("server_new_tokens") is not None:
        checks["server_prefill_is_the_distinct_tokens"] = \
            abs(shared["server_new_tokens"] - ch["distinct_tokens"]) <= tol_share * ch["distinct_tokens"]
    cmp = res.get("shared_vs_flat")
    if cmp is not None:
        checks["shared_shard_is_version_2"] = cmp["format_versions"] == [1, 2]
        checks["shared_within_tol_of_flat"] = cmp["n_over_tol"] == 0
    ref = res.get("reference")
    if ref is not None:
        for m, n in ref["n_over_tol"].items():
            checks[f"{m}_within_tol_of_reference"] = n == 0
    return checks


def markdown(res: dict) -> str:
    ch = res["chunk"]
    lines = [f"### {res['model']}: {'PASS' if res.get('pass') else 'FAIL'}", "",
             f"{ch['samples']} samples ({ch['conversations']} conversations x {ch['turns']} turns, a "
             f"{ch['decl']}-token declaration), {ch['tokens']} materialized tokens, {ch['distinct_tokens']} distinct "
             f"({ch['tokens'] / max(1, ch['distinct_tokens']):.2f}x); aux {res['aux_layers']}, pre_norm, "
             f"concurrency {res['concurrency']}", "",
             "| run | computed tokens (dumped) | server #new-token | #cached-token | prefill batches | wall s | "
             "materialized tok/s |", "|---|---|---|---|---|---|---|"]
    for m in ("flat", "shared"):
        r = res.get("runs", {}).get(m, {})
        if "wall_s" in r:
            lines.append(f"| {m} | {r['computed_tokens']} | {r.get('server_new_tokens', '-')} | "
                         f"{r.get('server_cached_tokens', '-')} | {r.get('prefill_batches', '-')} | {r['wall_s']} | "
                         f"{ch['tokens'] / r['wall_s']:.0f} |")
    cmp = res.get("shared_vs_flat")
    if cmp:
        lines += ["", f"shared vs flat: max per-sample rel {cmp['max_rel']:.3g} (bound {res['tol']}), "
                      f"{cmp['n_over_tol']} samples over, {cmp['bitwise_equal_samples']}/{cmp['samples']} bit-equal; "
                      f"references stored {cmp['stored_references']} of {ch['proposed_references']} proposed; "
                      f"stored tokens flat/shared {cmp['stored_tokens']}"]
    ref = res.get("reference")
    if not res.get("reference_samples"):
        lines += ["against the transformers engine: not run (--reference 0)"]
    if ref:
        lines += [f"against the transformers engine ({ref['samples']} samples): max rel "
                  + ", ".join(f"{m} {v:.3g}" for m, v in ref["max_rel"].items())]
    lines += ["", "checks: " + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in res.get("checks", {}).items())]
    if res.get("error"):
        lines += ["", f"error in {res.get('stage')}: {res['error'].splitlines()[-1]}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--aux", default="eagle3", help="a capture preset, or comma-separated hidden_states ids")
    ap.add_argument("--state", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=30200)
    ap.add_argument("--convs", type=int, default=24)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--decl", type=int, default=512, help="tokens of the declaration every conversation opens with")
    ap.add_argument("--user", type=int, default=40)
    ap.add_argument("--reason", type=int, default=120)
    ap.add_argument("--answer", type=int, default=60)
    ap.add_argument("--seed", type=int, default=37)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    ap.add_argument("--shard-threads", type=int, default=4, help="the shard writer's encoder threads")
    ap.add_argument("--sgl-args", default=os.environ.get("SGL_SMALL", ""))
    ap.add_argument("--tol", type=float, default=TOL, help="per-sample bound (dense models)")
    ap.add_argument("--reference", type=int, default=1 << 30, help="samples checked against the transformers "
                                                                   "engine (0: none)")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--server-module", default="sglang.launch_server", help="fake_sglang: the CPU dry run")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = os.environ.get("HSX_DEVICE", "cuda")
    aux = (tuple(preset_layers(a.aux, read_model_shape(a.model).num_layers)) if not a.aux[0].isdigit()
           else tuple(int(x) for x in a.aux.split(",")))
    vocab = json.loads((Path(a.model) / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    chunk = synthetic_chunk(a, vocab)
    refs = list(zip(chunk.parents or [], chunk.prefix_lens or [], strict=True))
    spec = CaptureSpec(aux_layers=aux, final_state="pre_norm")
    res: dict = {"model": a.name, "aux_layers": list(aux), "tol": a.tol, "concurrency": a.concurrency,
                 "reference_samples": a.reference, "sgl_args": a.sgl_args, "shard_threads": a.shard_threads,
                 "chunk": {"samples": len(chunk.input_ids), "conversations": a.convs, "turns": a.turns, "decl": a.decl,
                           "tokens": sum(map(len, chunk.input_ids)),
                           "distinct_tokens": distinct_tokens([len(x) for x in chunk.input_ids], refs),
                           "proposed_references": sum(p >= 0 for p, _ in refs),
                           "max_len": max(map(len, chunk.input_ids))}}
    json_path, md_path = out / f"shared-prefix-{a.name}.json", out / f"shared-prefix-{a.name}.md"

    def write() -> None:
        res["checks"] = verdict(res)
        res["pass"] = "error" not in res and all(res["checks"].values()) and "shared_vs_flat" in res
        json_path.write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
        md_path.write_text(markdown(res), encoding="utf-8")

    def on_term(signum: int, frame: object) -> None:  # `timeout` on the device: still write the json
        raise RuntimeError(f"killed by signal {signum} (time budget of the device call)")

    signal.signal(signal.SIGTERM, on_term)
    res["stage"] = "flat"
    try:
        shards = {}
        for shared in (False, True):
            res["stage"] = "shared" if shared else "flat"
            shards[res["stage"]] = run_mode(a, shared, chunk, spec, vocab, out, res)
            write()
        res["stage"] = "compare"
        res["shared_vs_flat"] = compare(shards["flat"], shards["shared"], a.tol)
        write()
        if a.reference:
            res["stage"] = "reference"
            t0 = time.monotonic()
            res["reference"] = against_reference(a, chunk, spec, shards, device)
            res["reference"]["seconds"] = round(time.monotonic() - t0, 1)
        res["stage"] = "done"
    except BaseException as e:  # noqa: BLE001 - report any failure in the json, then exit non-zero
        res["error"] = "".join(traceback.format_exception(e))[-4000:]
        print(res["error"], file=sys.stderr, flush=True)
    write()
    print(md_path.read_text(encoding="utf-8"), flush=True)
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
