"""Helpers of bench/gpu/run_regenerate.sh (regeneration through SGLang on the GPU machine).

    compare A B --model DIR --out JSON
                            two regenerated conversations.jsonl of the same input: per record, whether every
                            assistant turn's text is the same, and for each record's first assistant turn (the
                            one whose context is the input's alone, so the engines' numerics are the only
                            difference) whether it is identical and how many leading tokens of its text
                            (re-tokenized: a random model's ids need not come back) agree
    same A B                exit 0 when the two files are byte-identical, 1 otherwise (prints which lines differ)
    serve MODEL --port N [--deterministic]
                            rehearsal only (REGEN_DRY=1, a CPU): a stand-in for a plain SGLang server, GET
                            /health and /server_info (enable_deterministic_inference as --deterministic says),
                            POST /generate with input_ids and sampling_params, answered by this project's
                            transformers generator (sampling_seed honoured only with --deterministic, as SGLang)
    summary STEPS_JSONL OUT_MD  regenerate.md from the steps the script recorded

Run with the checkout's src/ on PYTHONPATH (run_regenerate.sh does).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _assistant_texts(rec: dict[str, Any]) -> list[str]:
    msgs = rec.get("messages") or rec.get("conversations") or []
    return [(m.get("reasoning_content") or "") + "\x00" + (m.get("content") or "")
            for m in msgs if m.get("role") == "assistant"]


def compare(a: Path, b: Path, model: str) -> dict[str, Any]:
    from hsextract.prepare.tokenizer_loading import load_tokenizer

    tok = load_tokenizer(model, trust_remote_code=True)
    ra, rb = _records(a), _records(b)
    if len(ra) != len(rb):
        raise SystemExit(f"{a}: {len(ra)} records, {b}: {len(rb)}")
    whole = first_same = 0
    agree: list[int] = []
    lengths: list[int] = []
    for x, y in zip(ra, rb, strict=True):
        ta, tb = _assistant_texts(x), _assistant_texts(y)
        whole += ta == tb
        if not ta or not tb:
            continue
        first_same += ta[0] == tb[0]
        ia, ib = tok.encode(ta[0].replace("\x00", ""), add_special_tokens=False), \
            tok.encode(tb[0].replace("\x00", ""), add_special_tokens=False)
        n = next((k for k, (p, q) in enumerate(zip(ia, ib, strict=False)) if p != q), min(len(ia), len(ib)))
        agree.append(n)
        lengths.append(max(len(ia), len(ib)))
    return {"records": len(ra), "records_all_turns_same": whole, "first_turns": len(agree),
            "first_turns_identical": first_same,
            "first_turn_tokens_agreeing_mean": round(sum(agree) / len(agree), 2) if agree else None,
            "first_turn_tokens_mean": round(sum(lengths) / len(lengths), 2) if lengths else None}


def same(a: Path, b: Path) -> int:
    if not (a.is_file() and b.is_file()):
        print(f"missing: {' '.join(str(x) for x in (a, b) if not x.is_file())}")
        return 1
    la, lb = a.read_bytes().splitlines(), b.read_bytes().splitlines()
    diff = [i for i, (p, q) in enumerate(zip(la, lb, strict=False)) if p != q]
    if la == lb:
        print(f"identical: {len(la)} lines")
        return 0
    # where each differing record parts: its first assistant turn whose text differs (0: one whose context is the
    # input's alone, so the engine's numerics, not an earlier sampled turn, made the difference)
    first = {}
    for i in diff[:20]:
        ta, tb = _assistant_texts(json.loads(la[i])), _assistant_texts(json.loads(lb[i]))
        first[i] = next((k for k, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
    print(f"differ: {len(la)} vs {len(lb)} lines; lines {diff[:20]} differ; first differing assistant turn {first}")
    return 1


def serve(model: str, port: int, deterministic: bool) -> None:
    """The rehearsal's stand-in server (see the module's docstring)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from hsextract.engines.transformers_generate import TransformersGenerator
    from hsextract.extract.text_model import load_causal_lm

    lm = load_causal_lm(model, "auto").eval()
    lock = threading.Lock()

    class H(BaseHTTPRequestHandler):
        def _send(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                return self._send(200, {})
            if self.path == "/server_info":
                return self._send(200, {"enable_deterministic_inference": deterministic, "version": "stand-in"})
            return self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            sp = req["sampling_params"]
            s = SimpleNamespace(temperature=sp["temperature"], top_p=sp["top_p"], top_k=max(sp["top_k"], 0),
                                max_new_tokens=sp["max_new_tokens"], seed=0, batch_size=1)
            seed = sp.get("sampling_seed") if deterministic else None
            gen = TransformersGenerator(lm, s, sp["stop_token_ids"])
            with lock:
                out = gen.generate([req["input_ids"]], None if seed is None and s.temperature == 0 else [seed or 0])
            self._send(200, {"output_ids": out[0], "meta_info": {"id": req.get("rid")}})

        def log_message(self, *a: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 128  # the default 5 reset connections when two chunks' 32 requests came at once

    Server(("127.0.0.1", port), H).serve_forever()


def summary(steps: Path, out: Path) -> None:
    rows = [json.loads(line) for line in steps.read_text(encoding="utf-8").splitlines() if line.strip()]
    lines = ["# Regeneration through SGLang (bench/gpu/run_regenerate.sh)", "",
             "| step | rc | seconds | verdict |", "|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['rc']} | {r['seconds']} | {r['verdict']} |" for r in rows]
    for r in rows:
        if r.get("detail"):
            lines += ["", f"## {r['name']}", "", "```", json.dumps(r["detail"], indent=1)[:4000], "```"]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--model", required=True)
    c.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("same")
    s.add_argument("a", type=Path)
    s.add_argument("b", type=Path)
    v = sub.add_parser("serve")
    v.add_argument("model")
    v.add_argument("--port", type=int, required=True)
    v.add_argument("--deterministic", action="store_true")
    m = sub.add_parser("summary")
    m.add_argument("steps", type=Path)
    m.add_argument("out", type=Path)
    a = ap.parse_args()
    if a.cmd == "compare":
        res = compare(a.a, a.b, a.model)
        a.out.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        print(json.dumps(res))
        return 0
    if a.cmd == "same":
        return same(a.a, a.b)
    if a.cmd == "serve":
        serve(a.model, a.port, a.deterministic)
        return 0
    summary(a.steps, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
