"""Why does the workflow's tiny DeepseekV3 crash SGLang 0.5.16 at start-up (bench/README.md runs 12, 14)?

One server per variant, one after another, on the same model: does it start (SGLang's own warmup is its
first prefill), and does it answer 8 concurrent 200-token prompts? Variants separate this project's plugin
from SGLang's eager path: plain server, plain server with `--enable-return-hidden-states` and requests
asking for hidden states (SGLang's own FULL capture mode), the plugin with CUDA_LAUNCH_BLOCKING=1 (the
faulting kernel in the traceback), the plugin on prefill graphs (as on 2026-12-02), the plugin without the
side copy stream, plain and plugin without the overlap scheduler. Writes $OUT/diag-eager.json and one
server log per variant. Run by bench/gpu/run_diag_eager.sh; results in bench/README.md run 14.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hsextract.sglang.api import health
from hsextract.sglang.server import ServerConfig, build_command, build_env, make_dump_dir

VARIANTS = {
    # name: (plugin on, prefill graphs, --enable-return-hidden-states, request hidden states, extra env;
    # env ARGS: extra server flags)
    "plugin-eager-blocking": (True, False, True, False, {"CUDA_LAUNCH_BLOCKING": "1"}),
    "plain-eager": (False, False, False, False, {}),
    "plain-eager-rhs": (False, False, True, True, {}),
    "plugin-graph": (True, True, True, False, {}),
    "plugin-eager-no-copy-stream": (True, False, True, False, {"HSEXTRACT_COPY_STREAM": "0"}),
    "plain-eager-no-overlap": (False, False, False, False, {"ARGS": "--disable-overlap-schedule"}),
    "plugin-eager-no-overlap": (True, False, True, False, {"ARGS": "--disable-overlap-schedule"}),
}


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def run_variant(name: str, a: argparse.Namespace, vocab: int, out: Path) -> dict:
    plugin, graphs, rhs, ask_hs, extra = VARIANTS[name]
    dump = make_dump_dir(f"diag-{name}")
    cfg = ServerConfig(model=a.model, aux_layers=tuple(a.aux), python=sys.executable, port=a.port,
                       chunked_prefill_size=a.chunked_prefill_size, prefill_cuda_graph=graphs,
                       launch_args=tuple(a.sgl_args.split()), module=a.module)
    cmd = build_command(cfg) + extra.get("ARGS", "").split()
    if not rhs:
        cmd.remove("--enable-return-hidden-states")
    env = build_env(cfg, dump) if plugin else dict(os.environ)
    env.update({k: v for k, v in extra.items() if k != "ARGS"})
    log = out / f"server-{name}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{a.port}"
    res: dict = {"variant": name, "cmd": " ".join(cmd), "env": extra, "plugin": plugin}
    try:
        while time.monotonic() - t0 < a.start_timeout and p.poll() is None and health(url, 2.0) is not None:
            time.sleep(1)
        res["start_s"] = round(time.monotonic() - t0, 1)
        res["started"] = p.poll() is None and health(url, 2.0) is None
        res["exit_code"] = p.poll()
        if res["started"]:
            rng = random.Random(0)
            prompts = [[rng.randrange(vocab) for _ in range(200)] for _ in range(8)]

            def one(i: int) -> str:
                body = {"input_ids": prompts[i], "rid": f"hsx-diag-{name}-{i}",
                        "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
                if ask_hs:
                    body["return_hidden_states"] = True
                try:
                    post(url + "/generate", body, 60)
                    return "ok"
                except Exception as e:  # noqa: BLE001 - recorded, the next variant still runs
                    return repr(e)[:200]

            with ThreadPoolExecutor(8) as ex:
                answers = list(ex.map(one, range(8)))
            res["answers_ok"] = answers.count("ok")
            res["answer_errors"] = sorted({x for x in answers if x != "ok"})
            time.sleep(1)
            res["alive_after"] = p.poll() is None
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(dump, ignore_errors=True)
    lines = log.read_text(errors="replace").splitlines()
    tb = [i for i, ln in enumerate(lines) if "Traceback" in ln]
    res["traceback"] = lines[tb[0]:tb[0] + 60] if tb else None
    res["illegal_access"] = any("illegal memory access" in ln for ln in lines)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--aux", type=int, nargs="+", required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sgl-args", default="")
    ap.add_argument("--module", default="sglang.launch_server")
    ap.add_argument("--chunked-prefill-size", type=int, default=128)
    ap.add_argument("--port", type=int, default=30100)
    ap.add_argument("--start-timeout", type=float, default=150)
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    end = time.monotonic() + a.budget_s
    results = []
    for name in a.variants.split(","):
        if end - time.monotonic() < a.start_timeout / 2:
            results.append({"variant": name, "skipped": "budget"})
            continue
        r = run_variant(name, a, vocab, a.out)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("traceback", "cmd")}), flush=True)
        (a.out / "diag-eager.json").write_text(json.dumps(results, indent=1))
        time.sleep(3)  # let the GPU memory go before the next server
    (a.out / "diag-eager.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
