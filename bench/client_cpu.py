"""CPU the sglang client spends per GB of hidden states, this code against an earlier commit, in one run.

On the H200 the capture path's client (HTTP requests, dump collection, shard encoding, all in the extract
process) did not keep the server fed (bench/README.md). This measures what that client costs, without a
GPU: tests/fake_sglang.py (with the plugin code of the same commit: the dump layout changed too) serves as
a separate process, and the client process's own CPU time (user + sys, all threads) is counted while it
extracts N prompts and writes them to a shard, as bench/sglang_throughput.py's part (b) does.

    PYTHONPATH=src python bench/client_cpu.py [--before d662219] [--n 96] [--tokens 512] [--hidden 4096]

Each variant runs in its own child process with its own PYTHONPATH (`--before`'s `src/` and fake server
come from `git archive`). Wall times on a 2-core VM are dominated by the fake server; compare CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(a: argparse.Namespace) -> None:
    import torch

    from hsextract.engines.base import CaptureSpec, Prompt
    from hsextract.sglang.client import SGLangEngine
    from hsextract.shard import ShardWriter

    aux = (1, 15, 28)
    work = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    dump, model = work / "dump", work / "model"
    dump.mkdir(mode=0o700)
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": a.hidden}))
    env = dict(os.environ, HSEXTRACT_DUMP_DIR=str(dump), HSEXTRACT_AUX_LAYERS=",".join(map(str, aux)),
               HSEXTRACT_STAGING_MB="2048")
    port = 31000 + os.getpid() % 1000
    srv = subprocess.Popen([sys.executable, a.fake, "--model-path", str(model), "--port", str(port),
                            "--chunked-prefill-size", "8192"], env=env, stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            if list(dump.glob("plugin-*.json")):
                break
            time.sleep(0.1)
        g = torch.Generator().manual_seed(a.tokens)
        ps = [Prompt(i, f"p{i}", torch.randint(0, 128000, (a.tokens,), generator=g).tolist()) for i in range(a.n)]
        spec = CaptureSpec(aux_layers=aux)
        list(SGLangEngine(url, spec, dump, concurrency=32, timeout_s=120, retries=0).extract(ps[:32]))  # warm-up
        meta = {"model": "bench", "engine": "sglang", "engine_version": "fake", "aux_layers": list(aux),
                "final_state": "post_norm", "hidden_size": a.hidden, "dtype": "bfloat16", "config_hash": "-",
                "tokenizer_hash": "-", "chat_template_hash": "-"}
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        with ShardWriter(work / "s.hss", meta, level=3, threads=a.shard_threads) as w:
            for c in SGLangEngine(url, spec, dump, concurrency=32, timeout_s=120, retries=0).extract(ps):
                ids = torch.tensor(ps[c.index].input_ids)
                w.add(ids, c.hidden_states, torch.ones_like(ids), sample_id=c.sample_id)
        r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t0
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        raw = a.n * a.tokens * len(aux + (0,)) * a.hidden * 2
        print(json.dumps({"cpu_s": cpu, "wall_s": wall, "raw_gb": raw / 1e9, "cpu_s_per_gb": cpu / (raw / 1e9),
                          "shard_bytes": (work / "s.hss").stat().st_size}))
    finally:
        srv.terminate()
        srv.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def run_variant(label: str, src: Path, fake: Path, a: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{src}:{fake.parent}")
    out = subprocess.run([sys.executable, __file__, "--child", "--fake", str(fake), "--n", str(a.n),
                          "--tokens", str(a.tokens), "--hidden", str(a.hidden), "--shard-threads",
                          str(a.shard_threads)], env=env, capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{label}: child failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="d662219", help="git ref of the earlier client (default: session start)")
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--shard-threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fake", default=str(ROOT / "tests" / "fake_sglang.py"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        old.mkdir()
        arc = subprocess.run(["git", "-C", str(ROOT), "archive", a.before, "src", "tests/fake_sglang.py"],
                             capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=arc, check=True)
        res = {f"before ({a.before})": run_variant("before", old / "src", old / "tests" / "fake_sglang.py", a),
               "now": run_variant("now", ROOT / "src", ROOT / "tests" / "fake_sglang.py", a)}
    print(f"{a.n} prompts x {a.tokens} tokens, hidden {a.hidden}, 4 tensors, 32 in flight, shard level 3 with "
          f"{a.shard_threads} encoder threads; client process CPU (user + sys, all threads)\n")
    print("| client | CPU s | raw GB | CPU s per GB | cores for 1.4 GB/s |")
    print("|---|---|---|---|---|")
    for k, r in res.items():
        print(f"| {k} | {r['cpu_s']:.2f} | {r['raw_gb']:.2f} | {r['cpu_s_per_gb']:.2f} | {1.4 * r['cpu_s_per_gb']:.1f} |")


if __name__ == "__main__":
    main()
