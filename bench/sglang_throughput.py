"""Prefill throughput of hsextract's capture path against SGLang baselines, side by side, in one GPU call.

(a) plain server, no capture, max_new_tokens 1, `--concurrency` in flight
(b) hsextract: plugin capture + sglang engine client (`--concurrency` in flight), shards written
    (b0: the same without writing shards, to separate the shard encoder's cost)
(c) SGLang's own `return_hidden_states` JSON API (final state only, as JSON), same concurrency
(d) the hand-made approach: one request at a time (client concurrency 1)
(e) the transformers engine's way on the same GPU: HF forward with output_hidden_states, batch 8

Server A (no plugin, --enable-return-hidden-states) serves (a), (c), (d); server B (hsextract plugin)
serves (b). Weights: `--load-format dummy` from a config-only model dir (Llama-3-8B shape by default).
Writes OUT/throughput.json and OUT/throughput.md (table of prompt tokens/s and the ratios the issue targets:
b/a >= 0.90, b/c >= 10, b/d >= 3 at 512 tokens). Run on the GPU through bench/gpu/run_throughput.sh.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hsextract.engines.base import CaptureSpec, Prompt
from hsextract.engines.sglang_engine import SGLangEngine
from hsextract.server import ServerConfig, ensure_server, health, stop_servers


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    return [Prompt(i, f"{length}-{i}", torch.randint(0, vocab, (length,), generator=g).tolist()) for i in range(n)]


def http_run(port: int, prompts: list[Prompt], concurrency: int, extra: dict | None = None) -> dict:
    """POST every prompt to /generate with `concurrency` in flight; wall time first send -> last reply."""
    local = threading.local()
    nbytes, lat = [0], []
    lock = threading.Lock()

    def one(p: Prompt) -> None:
        c = getattr(local, "c", None) or http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        local.c = c
        body = {"input_ids": p.input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        body.update(extra or {})
        t = time.monotonic()
        c.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
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


def start_plain(python: str, model: str, port: int, args: list[str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSEXTRACT_") and k != "SGLANG_PLUGINS"}
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1", "--port", str(port),
           "--disable-radix-cache", "--skip-tokenizer-init", "--enable-return-hidden-states", *args]
    p = subprocess.Popen(cmd, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 420
    while health(f"http://127.0.0.1:{port}", 2.0) is not None:
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"plain server did not start (exit {p.poll()}); see {log}")
        time.sleep(1)
    return p


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
            keep = [out.hidden_states[a + 1].cpu() for a in aux] + [out.hidden_states[-1].cpu()]
        torch.cuda.synchronize()
        wall = time.monotonic() - t0
    del m, out, keep
    torch.cuda.empty_cache()
    return {"n": batches * batch, "tokens": batches * batch * length, "wall_s": wall,
            "tok_s": batches * batch * length / wall, "note": "includes the copy of the 4 tensors to the CPU"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="config-only model dir (SGLang --load-format dummy)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--aux", type=int, nargs="+", default=[1, 15, 28])
    ap.add_argument("--lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--sgl-args", default="--attention-backend triton --sampling-backend pytorch "
                    "--mem-fraction-static 0.6 --disable-decode-cuda-graph --load-format dummy --dtype bfloat16 "
                    "--cuda-graph-bs-prefill 512 1024 2048 4096 8192")
    ap.add_argument("--staging-mb", type=int, default=8192)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--budget-s", type=float, default=520, help="skip later parts past this wall time")
    a = ap.parse_args()
    t_start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    sgl = shlex.split(a.sgl_args)
    aux = tuple(a.aux)
    res: dict = {"model": a.model, "aux_layers": list(aux), "concurrency": a.concurrency, "sgl_args": a.sgl_args,
                 "runs": {}}
    n_of = {512: 256, 2048: 96}
    sets = {L: prompts_of(n_of.get(L, 64), L, vocab, seed=L) for L in a.lens}

    def record(key: str, L: int, r: dict) -> None:
        res["runs"].setdefault(key, {})[str(L)] = r
        print(key, L, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
        (out / "throughput.json").write_text(json.dumps(res, indent=1))

    # ---- server A: plain (a), JSON hidden states (c), one at a time (d)
    t = time.monotonic()
    pa = start_plain(sys.executable, a.model, 30000, sgl, out / "server-plain.log")
    res["startup_plain_s"] = round(time.monotonic() - t, 1)
    try:
        for L, ps in sets.items():
            http_run(30000, ps[: a.concurrency], a.concurrency)  # warm-up
            record("a_plain", L, http_run(30000, ps, a.concurrency))
            record("c_return_hidden_states_json", L,
                   http_run(30000, ps[: 16 if L <= 512 else 8], a.concurrency, {"return_hidden_states": True}))
            record("d_one_at_a_time", L, http_run(30000, ps[: 50 if L <= 512 else 30], 1))
    finally:
        os.killpg(pa.pid, signal.SIGTERM)
        pa.wait(60)
    # ---- server B: hsextract capture (b), with and without shards
    state = Path("/tmp/hsx-bench-state")
    cfg = ServerConfig(model=a.model, aux_layers=aux, python=sys.executable, port=30001, capture="plugin",
                       launch_args=tuple(sgl), run_name="bench", startup_timeout_s=420, staging_mb=a.staging_mb)
    t = time.monotonic()
    try:
        h = ensure_server(state, cfg)
        res["startup_capture_s"] = round(time.monotonic() - t, 1)
        spec = CaptureSpec(aux_layers=aux)
        from hsextract.shard import ShardWriter

        for L, ps in sets.items():
            eng = SGLangEngine(h, spec, concurrency=a.concurrency, timeout_s=300, retries=1, run_name=f"w{L}")
            list(eng.extract(ps[: a.concurrency]))  # warm-up
            t0 = time.monotonic()
            nbytes = sum(sum(x.numel() * 2 for x in c.hidden_states) for c in eng.extract(ps))
            wall = time.monotonic() - t0
            toks = sum(len(p.input_ids) for p in ps)
            record("b0_capture_no_shards", L, {"n": len(ps), "tokens": toks, "wall_s": wall, "tok_s": toks / wall,
                                                "dump_bytes_per_s": nbytes / wall})
            shard = out / f"bench-{L}.hss"
            meta = {"model": "llama8b-dummy", "engine": "sglang", "engine_version": eng.version(),
                    "aux_layers": list(aux), "final_state": "post_norm", "hidden_size": 0, "dtype": "bfloat16",
                    "config_hash": "-", "tokenizer_hash": "-", "chat_template_hash": "-"}
            t0 = time.monotonic()
            w = None
            for c in SGLangEngine(h, spec, concurrency=a.concurrency, timeout_s=300, retries=1,
                                  run_name=f"s{L}").extract(ps):
                if w is None:
                    meta["hidden_size"] = int(c.hidden_states[0].shape[1])
                    w = ShardWriter(shard, metadata=meta, level=1, threads=8)
                ids = torch.tensor(ps[c.index].input_ids)
                w.add(input_ids=ids, hidden_states=c.hidden_states, loss_mask=torch.ones_like(ids), sample_id=c.sample_id)
            w.close()
            wall = time.monotonic() - t0
            stats = sorted(h.dump_dir.glob("stats-*.json"))
            record("b_capture_with_shards", L, {
                "n": len(ps), "tokens": toks, "wall_s": wall, "tok_s": toks / wall,
                "shard_bytes": shard.stat().st_size, "shard_bytes_per_s": shard.stat().st_size / wall,
                "writer": json.loads(stats[0].read_text()) if stats else None})
            shard.unlink()
    finally:
        stop_servers(state)
    # ---- (e) transformers on the same GPU
    if not a.skip_hf and time.monotonic() - t_start < a.budget_s - 90:
        for L in a.lens:
            record("e_transformers", L, hf_run(a.model, L, batches=6 if L <= 512 else 3, batch=8, aux=aux))
    # ---- table
    R = res["runs"]
    lines = ["| run | " + " | ".join(f"{L} tok/s" for L in a.lens) + " |", "|---|" + "---|" * len(a.lens)]
    for key in R:
        lines.append(f"| {key} | " + " | ".join(f"{R[key].get(str(L), {}).get('tok_s', float('nan')):,.0f}"
                                                for L in a.lens) + " |")
    for num, den, target in (("b_capture_with_shards", "a_plain", 0.90),
                             ("b_capture_with_shards", "c_return_hidden_states_json", 10),
                             ("b_capture_with_shards", "d_one_at_a_time", 3)):
        vals = []
        for L in a.lens:
            try:
                vals.append(f"{R[num][str(L)]['tok_s'] / R[den][str(L)]['tok_s']:.2f}")
            except KeyError:
                vals.append("-")
        lines.append(f"| {num} / {den} (target >= {target} at 512) | " + " | ".join(vals) + " |")
    res["table"] = lines
    (out / "throughput.json").write_text(json.dumps(res, indent=1))
    (out / "throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
