"""SGLang's own EAGLE-3 capture, set up from the drafter-config ids hsextract exports, against what hsextract stores.

For one model and a capture preset: the stored layers are hidden_states ids (hsextract.layers); the drafter-config
value for SGLang 0.5.16 is hsextract.layers.sglang_eagle3_ids(ids, architecture) (what dataset.json and every export
write). The patched server starts with HSEXTRACT_EAGLE3_IDS set to that value, so the plugin calls the model's own
`set_eagle3_layers_to_capture(ids)` as SGLang's EAGLE-3 worker does for a drafter, and dumps what it resolves
(unchecked). Its captures of N prompts (64 in flight) are compared per sample and layer with what hsextract stores
for the same prompts: the transformers engine's aux layers (token_budget 1, the numerical reference, written to a
shard and read back). Pass: every per-sample relative error within --tol (the dense bound, 2e-2), and the
one-layer shift (the same captures against hidden_states[i+1]: the layers this project stored before its ids were
hidden_states ids) above --shift-min. Results: OUT/eagle3-<name>.json and .md.

    python3 eagle3_ids.py --model DIR --name deepseek-fixed --preset eagle3 --state /tmp/s --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

import torch

from hsextract.capture import preset_layers
from hsextract.config.model_info import read_model_shape
from hsextract.engines.base import CaptureSpec
from hsextract.extract.fidelity import rel
from hsextract.layers import describe, sglang_eagle3_ids
from hsextract.sglang_plugin.settings import ENV_EAGLE3_IDS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import make_prompts  # this folder's script


def reference(model: str, prompts: list, ids: list[int], out: Path, name: str) -> list[dict[int, torch.Tensor]]:
    """The transformers engine, one prompt per forward, each id's hidden_states; written to a shard and read back."""
    from hsextract.engines.transformers_engine import TransformersEngine
    from hsextract.shard import ShardReader, ShardWriter

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from shard_meta import placeholder_metadata  # bench/shard_meta.py

    device = os.environ.get("HSX_DEVICE", "cuda")  # cpu: a dry run of the plumbing (fake server: FAIL by design)
    with TransformersEngine(model, CaptureSpec(tuple(ids), "pre_norm"), device=device, token_budget=1) as eng:
        caps = list(eng.extract(prompts))
    shard = out / f"{name}-reference.hss"
    meta = placeholder_metadata(caps[0].hidden_states[0].shape[1], ids, model=name, engine="transformers",
                                final_state="pre_norm", engine_version="reference")
    with ShardWriter(shard, metadata=meta, level=3, threads=4) as w:
        for p, c in zip(prompts, caps, strict=True):
            t = torch.tensor(p.input_ids)
            w.add(input_ids=t, hidden_states=[h.cpu() for h in c.hidden_states], loss_mask=torch.ones_like(t),
                  sample_id=p.sample_id)
    r = ShardReader(shard)
    return [dict(zip(ids, r[i]["hidden_states"][:-1], strict=True)) for i in range(len(r))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--preset", default="eagle3")
    ap.add_argument("--state", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--tol", type=float, default=2e-2)
    ap.add_argument("--shift-min", type=float, default=0.1)
    ap.add_argument("--sgl-args", default=os.environ.get("SGL_SMALL", ""))
    ap.add_argument("--port", type=int, default=30100)
    ap.add_argument("--startup-timeout", type=float, default=240)
    ap.add_argument("--server-module", default="sglang.launch_server", help="fake_sglang: the CPU dry run")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_json = json.loads((Path(a.model) / "config.json").read_text(encoding="utf-8"))
    arch = (cfg_json.get("architectures") or [None])[0]
    n_layers = read_model_shape(a.model).num_layers
    aux = preset_layers(a.preset, n_layers)
    drafter = sglang_eagle3_ids(aux, arch)
    res: dict = {"model": a.name, "architecture": arch, "preset": a.preset, "stored": describe(aux),
                 "drafter_eagle_aux_hidden_state_layer_ids": drafter, "tol": a.tol, "shift_min": a.shift_min}

    def write() -> None:
        (out / f"eagle3-{a.name}.json").write_text(json.dumps(res, indent=2), encoding="utf-8")
        ok = res.get("pass")
        lines = [f"### {a.name} ({arch}, {a.preset}): {'PASS' if ok else 'FAIL'}",
                 f"stored {res['stored']}; drafter ids {drafter} -> SGLang layers_to_capture "
                 f"{res.get('layers_to_capture')}",
                 f"worst per-sample rel vs stored: {res.get('worst')}; least vs the one-layer shift: "
                 f"{res.get('least_shifted')}"]
        if "error" in res:
            lines.append(f"error: {res['error']}")
        (out / f"eagle3-{a.name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")

    try:
        if drafter is None:
            raise RuntimeError(f"no eagle_aux_hidden_state_layer_ids makes SGLang's {arch} capture {aux}")
        prompts = make_prompts(a.n, int(cfg_json.get("vocab_size") or cfg_json["text_config"]["vocab_size"]), 0,
                               max_len=600)
        shifted = [i + 1 for i in aux]
        refs = reference(a.model, prompts, sorted(set(aux) | set(shifted)), out, a.name)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

        from hsextract.sglang.client import SGLangEngine
        from hsextract.sglang.server import ServerConfig, ensure_server, stop_servers

        spec = CaptureSpec(tuple(aux), "pre_norm")
        cfg = ServerConfig(model=a.model, aux_layers=spec.aux_layers, python=sys.executable, port=a.port,
                           capture="plugin", final_state="pre_norm", launch_args=tuple(shlex.split(a.sgl_args)),
                           run_name=a.name, startup_timeout_s=a.startup_timeout, chunked_prefill_size=128,
                           module=a.server_module,
                           env={ENV_EAGLE3_IDS: ",".join(map(str, drafter))})
        t0 = time.monotonic()
        try:
            h = ensure_server(a.state, cfg)
            res["startup_s"] = round(time.monotonic() - t0, 1)
            eng = SGLangEngine(h, spec, concurrency=64, timeout_s=60, retries=1, run_name=a.name)
            marker = eng.plugin_info()
            res["layers_to_capture"] = marker.get("layers_to_capture")
            res["eagle3_ids_marker"] = marker.get("eagle3_ids")
            got = list(eng.extract(prompts))
        finally:
            stop_servers(a.state, grace_s=10)
        worst = [0.0] * len(aux)
        least = [float("inf")] * len(aux)
        for c, r in zip(got, refs, strict=True):
            for k, i in enumerate(aux):
                worst[k] = max(worst[k], rel(c.hidden_states[k], r[i]))
                least[k] = min(least[k], rel(c.hidden_states[k], r[i + 1]))
        res["worst"] = {f"hidden_states[{i}]": round(w, 5) for i, w in zip(aux, worst, strict=True)}
        res["least_shifted"] = {f"hidden_states[{i + 1}]": round(x, 4) for i, x in zip(aux, least, strict=True)}
        res["pass"] = (res["layers_to_capture"] == aux and max(worst) <= a.tol and min(least) >= a.shift_min)
    except Exception as e:  # noqa: BLE001 - recorded, and the run fails
        res["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        res["pass"] = False
    write()
    print(json.dumps({k: res.get(k) for k in ("model", "pass", "layers_to_capture", "worst", "least_shifted")}))
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
