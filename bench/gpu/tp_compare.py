"""Capture under tensor parallelism: TP=2 (and DP attention) against TP=1 of the same weights and ids (issue 9).

Two subcommands; the comparison itself is hsextract.extract.fidelity's (CPU-tested in tests/test_fidelity.py):

  capture  start the patched server (hsextract.sglang.server, plugin capture) with --tp/--dp on the given GPUs,
           extract the prompts of fidelity.make_prompts (long ones chunked by --chunked-prefill-size)
           through SGLangEngine (retries 0: each prompt is sent exactly once), optionally the first K again
           one at a time, wait until the writer's stats file is current, read the plugin markers and
           stats files of the dump dir, stop the server. Writes RUN.safetensors (key "<sample>/<t>",
           t = tensor index, last = final post-norm state) and RUN.json (timings, writer check, error).
  compare  each candidate run against the reference run (TP=1) with hsextract.extract.fidelity.compare_runs: per
           sample (dense models) or per token (MoE), tol 2e-2, the wrong layer far off, the same samples; a
           failing tensor whose norm ratio |got|/|ref| lies in [1/tp, 1/sqrt(tp)] is flagged as a PARTIAL SUM
           (the sglang#28343 failure: per-rank partial sums instead of the all-reduced activation). The
           writer checks of both runs (from their RUN.json) are part of the verdict.
Results: OUT/tp-<model>.json and .md; exit status 1 when anything fails.

CPU dry run of `capture` against tests/fake_sglang.py (real plugin code, fake model):
    PYTHONPATH=src:tests:bench/gpu python bench/gpu/tp_compare.py capture --module fake_sglang \\
        --model DIR_WITH_CONFIG_JSON --name x-tp1 --aux 2 4 6 --state /tmp/s --runs /tmp/r --n 8
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path

from fidelity import make_prompts  # bench/gpu/fidelity.py: the same prompts

from hsextract.extract.fidelity import FLIP_BOUND, TOL, check_writers, compare_model, is_moe, save_run, verdict_markdown
from hsextract.sglang_plugin import dumpfiles


def read_dump_dir(dump_dir: Path) -> tuple[list[dict], dict[int, dict]]:
    """The plugin's markers (one plugin-<pid>.json per scheduler process) and writer stats, by pid."""
    markers = [json.loads(f.read_text(encoding="utf-8")) for f in sorted(Path(dump_dir).glob("plugin-*.json"))]
    return markers, dumpfiles.read_writer_stats(dump_dir)


# ---- capture (on the device) --------------------------------------------------------------------------
def wait_stats(dump_dir: Path, expected: int, timeout_s: float) -> None:
    """The writer rewrites stats-<pid>.json when idle (every 2 s): wait until it counts every request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, stats = read_dump_dir(dump_dir)
        if sum(int(s.get("requests_done", 0)) + int(s.get("requests_failed", 0)) for s in stats.values()) >= expected:
            time.sleep(2.5)  # one more period: a duplicate write by a second rank would show up too
            return
        time.sleep(0.5)


def capture(a: argparse.Namespace) -> int:
    from hsextract.engines.base import CaptureSpec
    from hsextract.sglang.client import SGLangEngine
    from hsextract.sglang.server import ServerConfig, ensure_server, stop_servers

    runs = Path(a.runs)
    runs.mkdir(parents=True, exist_ok=True)
    res: dict = {"name": a.name, "model": a.model, "tp": a.tp, "dp": a.dp, "gpus": a.gpus, "aux": a.aux,
                 "n": a.n, "again": a.again, "chunked_prefill_size": a.chunked_prefill_size}
    vocab = json.loads((Path(a.model) / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    prompts = make_prompts(a.n, vocab, seed=7)
    spec = CaptureSpec(aux_layers=tuple(a.aux), final_state="post_norm")  # the figures in bench/README.md
    extra = ["--enable-dp-attention", "--dp", str(a.dp)] if a.dp > 1 else []
    cfg = ServerConfig(model=a.model, aux_layers=spec.aux_layers, python=sys.executable, port=a.port, tp=a.tp,
                       final_state=spec.final_state, gpus=tuple(a.gpus), chunked_prefill_size=a.chunked_prefill_size,
                       module=a.module,
                       launch_args=tuple(shlex.split(a.sgl_args)) + tuple(extra), run_name=a.name,
                       startup_timeout_s=a.startup_timeout, stop_grace_s=10)

    def on_term(signum: int, frame: object) -> None:  # `timeout` on the device: still write the json
        raise RuntimeError(f"killed by signal {signum} (time budget of the device call)")

    signal.signal(signal.SIGTERM, on_term)
    stage, h = "start", None
    t0 = time.monotonic()
    try:
        h = ensure_server(a.state, cfg)
        res["startup_s"] = round(time.monotonic() - t0, 1)
        res["command"] = h.command
        print(f"[{a.name}] server up in {res['startup_s']} s", flush=True)
        stage = "extract"
        eng = SGLangEngine(h, spec, concurrency=a.concurrency, timeout_s=60, retries=0, run_name=a.name)
        res["engine_version"] = eng.version()
        t1 = time.monotonic()
        caps = {c.sample_id: c.hidden_states for c in eng.extract(prompts)}
        res["extract_s"] = round(time.monotonic() - t1, 2)
        if a.again:
            alone = SGLangEngine(h, spec, concurrency=1, timeout_s=60, retries=0, run_name=a.name + "-alone")
            save_run(runs / f"{a.name}-alone.safetensors",
                     {c.sample_id: c.hidden_states for c in alone.extract(prompts[: a.again])})
        save_run(runs / f"{a.name}.safetensors", caps)
        stage = "writers"
        expected = a.n + a.again
        wait_stats(h.dump_dir, expected, timeout_s=15)
        markers, stats = read_dump_dir(h.dump_dir)
        res["markers"], res["stats"] = markers, {str(k): v for k, v in stats.items()}
        res["writers"] = check_writers(markers, stats, expected_requests=expected, ranks=a.tp, dp_groups=a.dp)
        res["pass"] = res["writers"]["pass"]
    except Exception as e:  # noqa: BLE001 - any failure is the result, written with its stage
        res["error"] = f"{stage}: {type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        res["pass"] = False
        print(res["traceback"], file=sys.stderr, flush=True)
    finally:
        if h is not None and "markers" not in res:  # what the dump dir held when it failed
            try:
                res["markers"], st = read_dump_dir(h.dump_dir)
                res["stats"] = {str(k): v for k, v in st.items()}
            except Exception:  # noqa: BLE001 - best effort: the error above is the result
                pass
        stop_servers(a.state, grace_s=10)
    (runs / f"{a.name}.json").write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    print(f"[{a.name}] {'PASS' if res['pass'] else 'FAIL'} "
          f"writers {json.dumps((res.get('writers') or {}).get('checks'))}"
          f"{' error ' + res['error'] if 'error' in res else ''}", flush=True)
    return 0 if res["pass"] else 1


# ---- compare (CPU or device) --------------------------------------------------------------------------
def compare(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    mode = a.mode if a.mode != "auto" else ("token" if is_moe(a.model) else "sample")
    results = compare_model(Path(a.runs), a.name, a.ref, a.cands, a.aux, mode=mode, tp=a.tp, tol=a.tol,
                            flip_bound=a.flip_bound)
    (out / f"tp-{a.name}.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    lines = verdict_markdown(a.name, results)
    (out / f"tp-{a.name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines), flush=True)
    return 0 if results["pass"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--model", required=True)
    c.add_argument("--name", required=True)
    c.add_argument("--aux", type=int, nargs="+", required=True)
    c.add_argument("--tp", type=int, default=1)
    c.add_argument("--dp", type=int, default=1, help=">1: --enable-dp-attention --dp N")
    c.add_argument("--gpus", type=int, nargs="+", default=[0])
    c.add_argument("--state", required=True)
    c.add_argument("--runs", required=True, help="directory for RUN.safetensors and RUN.json")
    c.add_argument("--port", type=int, default=30000)
    c.add_argument("--n", type=int, default=32)
    c.add_argument("--again", type=int, default=0, help="extract the first K prompts again, one at a time")
    c.add_argument("--concurrency", type=int, default=32)
    c.add_argument("--chunked-prefill-size", type=int, default=128)
    c.add_argument("--sgl-args", default="")
    c.add_argument("--module", default="sglang.launch_server")
    c.add_argument("--startup-timeout", type=float, default=300)
    m = sub.add_parser("compare")
    m.add_argument("--model", required=True, help="model dir (config.json: MoE or dense)")
    m.add_argument("--name", required=True)
    m.add_argument("--aux", type=int, nargs="+", required=True)
    m.add_argument("--runs", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--ref", required=True)
    m.add_argument("--cands", nargs="+", required=True)
    m.add_argument("--mode", choices=["auto", "sample", "token"], default="auto")
    m.add_argument("--tp", type=int, default=0, help="tp of the candidates when their json lacks it")
    m.add_argument("--tol", type=float, default=TOL)
    m.add_argument("--flip-bound", default=FLIP_BOUND, help="decimal fraction, compared exactly")
    a = ap.parse_args(argv)
    return capture(a) if a.cmd == "capture" else compare(a)


if __name__ == "__main__":
    sys.exit(main())
