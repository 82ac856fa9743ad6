"""Helpers of bench/gpu/run_production.sh (the production command on the GPU machine); each subcommand one step.

    twin SRC DST            the routing-fixed twin of a checkpoint (any packaging, safetensors): every MoE
                            router's e_score_correction_bias set to 0, 2, 4, ... (mk_models.fix_routing's
                            rule: the bias alone decides the top-k, so each token goes to the highest-numbered
                            experts and no routing near-tie can flip between kernels); every other byte kept
    refsample MODEL OUT     a speculators v1 sample of MODEL (the transformers engine on the CPU, 32 token ids,
                            the eagle3 preset's aux layers, the pre-norm final state): the `reference_sample:`
                            of a run of that model, as the README asks of a user (the shipped one is
                            Kimi-K2.5's width, 7168, and a run of another model refuses it)
    agentic MODEL OUT [--n 24]   agentic conversations (bench/shared_prefix.py's: one tool declaration and
                            system prompt open all, reasoning and tool calls every turn) as JSONL: a source
                            whose per-turn samples share prefixes (run_production.sh unless FLAT=1)
    jobs LOG                the jobs one Snakemake invocation ran (its rule blocks), as JSON on stdout
    fidelity --run DIR --model DIR [--device cuda] [--tol 0.02] --out JSON
                            every sample of the run's shards against the transformers engine on the same
                            checkpoint, each sample alone: per sample, every aux layer and the stored final
                            state within --tol (relative L2 over the sample); the neighbouring layer and the
                            other final state (the wrong-layer controls) must be over 10 x --tol
    secrets --state DIR --out JSON PATHS...
                            the live server of a run (its state directory DIR) and its key: whether any
                            file under PATHS (logs, results, the report; the key's own 0600 file left out),
                            any process's command line or environment holds the key, and what the server
                            answers a generate request without the key, with a wrong one and with it
    summary STEPS_JSON OUT_MD   production.md from the steps the script recorded

Run with the checkout's src/ on PYTHONPATH (run_production.sh does).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path


# ---- twin ------------------------------------------------------------------------------------------------
def make_twin(src: Path, dst: Path, spacing: float = 2.0) -> int:
    """Copy `src` to `dst` with every `*.mlp.gate.e_score_correction_bias` set to arange(E) * spacing."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    changed = 0
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            meta = fh.metadata()
            keys = list(fh.keys())
            if not any(k.endswith("mlp.gate.e_score_correction_bias") for k in keys):
                continue
            tensors = {k: fh.get_tensor(k) for k in keys}
        for k, t in tensors.items():
            if k.endswith("mlp.gate.e_score_correction_bias"):
                tensors[k] = (torch.arange(t.numel(), dtype=torch.float32) * spacing).to(t.dtype).reshape(t.shape)
                changed += 1
        save_file(tensors, str(f), metadata=meta)
    if not changed:
        raise SystemExit(f"{src}: no e_score_correction_bias found: not a DeepSeek-V3-style MoE checkpoint")
    info = dst / "hsextract_tiny.json"
    if info.is_file():
        d = json.loads(info.read_text(encoding="utf-8"))
        d["routing_fixed"] = f"e_score_correction_bias = arange(E) * {spacing} in {changed} routers"
        info.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return changed


# ---- reference sample -------------------------------------------------------------------------------------
def reference_sample(model: str, out: Path) -> list[int]:
    import torch

    from hsextract.capture import preset_layers
    from hsextract.config.model_info import read_model_shape
    from hsextract.engines.base import CaptureSpec, Prompt
    from hsextract.engines.transformers_engine import TransformersEngine

    aux = tuple(preset_layers("eagle3", read_model_shape(model).num_layers))
    ids = list(range(10, 42))
    with TransformersEngine(model, CaptureSpec(aux_layers=aux, final_state="pre_norm"), device="cpu") as eng:
        (c,) = list(eng.extract([Prompt(0, "ref", ids)]))
    torch.save({"input_ids": torch.tensor(ids, dtype=torch.int64), "hidden_states": c.hidden_states,
                "loss_mask": torch.ones(len(ids), dtype=torch.int64)}, out)
    return list(aux)


# ---- jobs of one invocation ------------------------------------------------------------------------------
_RULE = re.compile(r"^(?:local)?rule (\w+):\s*$")
_WILD = re.compile(r"^\s+wildcards: (.*)$")
_REASON = re.compile(r"^\s+reason: (.*)$")
_JOBID = re.compile(r"^\s+jobid: (\d+)\s*$")
_DONE = re.compile(r"^Finished jobid: (\d+)")
_ERROR = re.compile(r"^Error in rule (\w+):")


def parse_jobs(text: str) -> dict:
    """Snakemake's log of one invocation -> the jobs it started, finished and failed (rule, chunk)."""
    started: dict[str, dict] = {}
    cur: dict | None = None
    finished: set[str] = set()
    failed: list[str] = []
    in_flight = at_once = 0  # extract jobs started and not yet finished, in the log's order
    for line in text.splitlines():
        m = _RULE.match(line)
        if m:
            cur = {"rule": m[1], "chunk": None, "jobid": None}
            continue
        if cur is not None:
            w = _WILD.match(line)
            if w:
                kv = dict(p.split("=", 1) for p in w[1].split(", ") if "=" in p)
                cur["chunk"] = kv.get("chunk")
            r = _REASON.match(line)
            if r:
                cur["reason"] = r[1].split(":")[0]
            j = _JOBID.match(line)
            if j:
                cur["jobid"] = j[1]
                started[j[1]] = cur
                if cur["rule"] == "extract":
                    in_flight += 1
                    at_once = max(at_once, in_flight)
            # a rule block is its indented lines: anything else (a blank line, a time stamp, an error block
            # whose own `jobid:` names another job) ends it
            if not line.strip() or not line[0].isspace():
                cur = None
        d = _DONE.match(line)
        if d:
            finished.add(d[1])
            if d[1] in started and started[d[1]]["rule"] == "extract":
                in_flight -= 1
        e = _ERROR.match(line)
        if e:
            failed.append(e[1])
    jobs = list(started.values())
    by_rule: dict[str, int] = {}
    for j in jobs:
        by_rule[j["rule"]] = by_rule.get(j["rule"], 0) + 1
    return {
        "by_rule": by_rule,
        "extract_chunks": sorted(j["chunk"] for j in jobs if j["rule"] == "extract" and j["chunk"]),
        "finished_extract_chunks": sorted(j["chunk"] for k, j in started.items()
                                          if j["rule"] == "extract" and k in finished and j["chunk"]),
        "extract_reasons": {j["chunk"]: j.get("reason") for j in jobs if j["rule"] == "extract" and j["chunk"]},
        "extract_at_once": at_once,  # the most extract jobs running together
        "failed_rules": failed,
        "nothing_to_do": "Nothing to be done" in text,
        "lock_error": "cannot be locked" in text.lower() or "LockException" in text,
        "stale_lock_removed": "hsextract: removed Snakemake's lock" in text,
        "illegal_memory_access": "illegal memory access" in text,
    }


# ---- fidelity against the transformers engine ------------------------------------------------------------
def fidelity(run: Path, model: str, device: str, tol: float, max_samples: int | None = None) -> dict:
    import torch

    from hsextract.config.model_info import read_model_shape
    from hsextract.engines.base import CaptureSpec, Prompt
    from hsextract.engines.transformers_engine import TransformersEngine
    from hsextract.extract.fidelity import neighbours, rel
    from hsextract.shard import ShardReader

    shards = sorted((run / "shards").glob("chunk-*.hss"))
    if not shards:
        raise SystemExit(f"{run}/shards: no shard")
    meta = ShardReader(shards[0]).metadata
    aux = tuple(int(a) for a in meta["aux_layers"])
    final = meta["final_state"]
    nb = neighbours(aux, read_model_shape(model).num_layers)
    ids = tuple(sorted(set(aux) | set(nb)))
    samples = []
    for path in shards:
        r = ShardReader(path)
        for i in range(len(r)):
            s = r[i]
            samples.append((f"{path.name}:{i}", s["input_ids"].tolist(), s["hidden_states"]))
    samples = samples[:max_samples]
    prompts = [Prompt(i, name, ids_) for i, (name, ids_, _) in enumerate(samples)]
    t0 = time.monotonic()
    eng = TransformersEngine(model, CaptureSpec(aux_layers=ids, final_state="both"), device=device,
                             token_budget=1, max_batch=1)
    worst = {f"aux{a}": 0.0 for a in aux} | {f"final_{final}": 0.0}
    wrong = {f"aux{a}": float("inf") for a in aux} | {f"final_{final}": float("inf")}
    worst_sample = {}
    try:
        for c, (name, _, got) in zip(eng.extract(prompts), samples, strict=True):
            by_id = dict(zip(ids, c.hidden_states[:-2], strict=True))
            pre, post = c.hidden_states[-2], c.hidden_states[-1]
            right_final, other_final = (pre, post) if final == "pre_norm" else (post, pre)
            for k, a in enumerate(aux):
                e = rel(got[k], by_id[a])
                if e > worst[f"aux{a}"]:
                    worst[f"aux{a}"], worst_sample[f"aux{a}"] = e, name
                wrong[f"aux{a}"] = min(wrong[f"aux{a}"], rel(got[k], by_id[nb[k]]))
            n = f"final_{final}"
            e = rel(got[-1], right_final)
            if e > worst[n]:
                worst[n], worst_sample[n] = e, name
            wrong[n] = min(wrong[n], rel(got[-1], other_final))
        version = eng.version()
    finally:
        eng.close()
    far = 10 * tol
    checks = {"every_sample_within_tol": all(v <= tol for v in worst.values()),
              "wrong_layer_far_above": all(wrong[f"aux{a}"] > far for a in aux),
              "other_final_state_far_above": wrong[f"final_{final}"] > far}
    return {"run": str(run), "model": model, "engine_of_shards": meta.get("engine"),
            "engine_version_of_shards": meta.get("engine_version"), "reference": version + " (each sample alone)",
            "device": device, "aux_layers": list(aux), "layer_convention": meta.get("layer_convention"),
            "neighbours": nb, "final_state": final, "samples": len(samples), "shards": len(shards),
            "tol": tol, "far": far, "max_rel": worst, "worst_sample": worst_sample, "min_rel_wrong": wrong,
            "reference_s": round(time.monotonic() - t0, 1), "checks": checks, "pass": all(checks.values()),
            "torch": torch.__version__}


def fidelity_md(res: dict) -> list[str]:
    lines = [f"fidelity: **{'PASS' if res['pass'] else 'FAIL'}**: {res['samples']} samples of {res['shards']} "
             f"shards ({res['engine_version_of_shards']}) against {res['reference']} on {res['device']}; "
             f"aux {res['aux_layers']} ({res['layer_convention']} ids), final state {res['final_state']}, "
             f"per-sample bound {res['tol']}, controls over {res['far']:.2g}", "",
             "| tensor | worst sample | wrong control (min per sample) | control |", "|---|---|---|---|"]
    for k, v in res["max_rel"].items():
        ctrl = (f"layer {res['neighbours'][res['aux_layers'].index(int(k[3:]))]}" if k.startswith("aux")
                else "the other final state")
        lines.append(f"| {k} | {v:.2e} ({res['worst_sample'].get(k, '-')}) | {res['min_rel_wrong'][k]:.3f} | {ctrl} |")
    lines += ["", "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in res["checks"].items()), ""]
    return lines


# ---- summary ---------------------------------------------------------------------------------------------
def summary(steps_file: Path, out_md: Path) -> None:
    doc = json.loads(steps_file.read_text(encoding="utf-8"))
    lines = [f"# The production command on {doc.get('machine', '?')}", "",
             f"{doc.get('when', '')}; budget {doc.get('budget_s')} s after set-up; set-up {doc.get('setup_s')} s.",
             "", "| step | command | rc | s | jobs that ran (rule: count) | extract chunks | verdict |",
             "|---|---|---|---|---|---|---|"]
    for s in doc["steps"]:
        j = s.get("jobs") or {}
        rules = ", ".join(f"{k}: {v}" for k, v in sorted(j.get("by_rule", {}).items())) or "-"
        chunks = " ".join(c.lstrip("0") or "0" for c in j.get("extract_chunks", [])) or "-"
        lines.append(f"| {s['name']} | `{s.get('cmd', '')}` | {s.get('rc', '')} | {s.get('seconds', '')} | {rules} "
                     f"| {chunks} | {s.get('verdict', '')} |")
    lines.append("")
    for s in doc["steps"]:
        if s.get("notes"):
            lines += [f"**{s['name']}**: {s['notes']}", ""]
    fid = doc.get("fidelity")
    if fid:
        lines += fidelity_md(fid)
    out_md.write_text("\n".join(lines) + "\n", encoding="utf-8")


# ---- the key: at rest, in sight, at the door ---------------------------------------------------------------
def secrets_check(state: Path, paths: list[Path]) -> dict:
    import urllib.error
    import urllib.request

    from hsextract.sglang import keyfile

    key_file = keyfile.key_path(state, 0)
    key = keyfile.read_key(key_file)
    res: dict = {"key_file": str(key_file), "key_found": key is not None}
    if key is None:
        return {**res, "pass": False}
    needle = key.encode()
    hits, scanned = [], 0
    for root in paths:
        for f in [root] if root.is_file() else sorted(root.rglob("*")) if root.is_dir() else []:
            if f.is_symlink() or not f.is_file() or f.resolve() == key_file.resolve():
                continue
            scanned += 1
            if needle in f.read_bytes():
                hits.append(str(f))
    procs = {"cmdline": 0, "environ": 0, "read": 0}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        for what in ("cmdline", "environ"):
            try:
                procs[what] += needle in (d / what).read_bytes()
                procs["read"] += what == "cmdline"
            except OSError:
                pass
    url = json.loads((state / "replica-0.json").read_text(encoding="utf-8"))["url"]
    body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}).encode()
    http = {}
    for name, auth in (("no key", None), ("wrong key", "Bearer " + "0" * len(key)), ("the key", "Bearer " + key)):
        req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
        if auth:
            req.add_header("Authorization", auth)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                http[name] = r.status
        except urllib.error.HTTPError as e:
            http[name] = e.code
    ok = (not hits and not procs["cmdline"] and not procs["environ"] and http["no key"] == 401
          and http["wrong key"] == 401 and http["the key"] == 200)
    return {**res, "files_scanned": scanned, "files_with_key": hits, "processes_read": procs["read"],
            "cmdlines_with_key": procs["cmdline"], "environs_with_key": procs["environ"], "generate_status": http,
            "pass": ok}


def agentic(model: str, out: Path, n: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from shared_prefix import conversations

    from hsextract.prepare.run import load_tokenizer

    convs = conversations(n, 3, 8, 400, load_tokenizer(model, trust_remote_code=True))
    out.write_text("".join(json.dumps(c) + "\n" for c in convs), encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("twin")
    t.add_argument("src", type=Path)
    t.add_argument("dst", type=Path)
    r = sub.add_parser("refsample")
    r.add_argument("model")
    r.add_argument("out", type=Path)
    g = sub.add_parser("agentic")
    g.add_argument("model")
    g.add_argument("out", type=Path)
    g.add_argument("--n", type=int, default=24)
    j = sub.add_parser("jobs")
    j.add_argument("log", type=Path)
    f = sub.add_parser("fidelity")
    f.add_argument("--run", type=Path, required=True)
    f.add_argument("--model", required=True)
    f.add_argument("--device", default="cuda")
    f.add_argument("--tol", type=float, default=2e-2)
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--max-samples", type=int, default=None, help="the first N (a CPU rehearsal)")
    k = sub.add_parser("secrets")
    k.add_argument("--state", type=Path, required=True)
    k.add_argument("--out", type=Path, required=True)
    k.add_argument("paths", type=Path, nargs="+")
    s = sub.add_parser("summary")
    s.add_argument("steps", type=Path)
    s.add_argument("out", type=Path)
    a = ap.parse_args()
    if a.cmd == "twin":
        print(f"{a.dst}: {make_twin(a.src, a.dst)} routers fixed")
    elif a.cmd == "refsample":
        print(f"{a.out}: aux layers {reference_sample(a.model, a.out)} and the pre-norm final state")
    elif a.cmd == "agentic":
        agentic(a.model, a.out, a.n)
        print(f"{a.out}: {a.n} conversations")
    elif a.cmd == "jobs":
        print(json.dumps(parse_jobs(a.log.read_text(errors="replace", encoding="utf-8"))))
    elif a.cmd == "fidelity":
        res = fidelity(a.run, a.model, a.device, a.tol, a.max_samples)
        a.out.write_text(json.dumps(res, indent=1), encoding="utf-8")
        print("\n".join(fidelity_md(res)))
        return 0 if res["pass"] else 1
    elif a.cmd == "secrets":
        res = secrets_check(a.state, a.paths)
        a.out.write_text(json.dumps(res, indent=1), encoding="utf-8")
        print(f"{'PASS' if res['pass'] else 'FAIL'}: key found {res['key_found']}; files with the key "
              f"{res.get('files_with_key')} of {res.get('files_scanned')}; command lines {res.get('cmdlines_with_key')}"
              f", environments {res.get('environs_with_key')} of {res.get('processes_read')} processes; generate "
              f"answered {res.get('generate_status')}")
        return 0 if res["pass"] else 1
    else:
        summary(a.steps, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
