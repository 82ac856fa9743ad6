"""bench/sglang_throughput.py end to end against tests/fake_sglang.py: a broken GPU bench costs device time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_bench_dry_run_fills_every_part(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 1000}))
    out = tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"  # a shard-writer variant that writes its shard to another folder
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{ROOT / 'tests'}")
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sglang_throughput.py"), "--model", str(model), "--server-module",
         "fake_sglang", "--skip-hf", "--lens", "64", "--n", "24", "--aux", "0", "1", "2", "--concurrency", "4",
         "8", "--shard-threads", "2", f"1:{elsewhere}", "--repeats", "2", "--out", str(out),
         "--state", str(tmp_path / "state"),
         "--port", str(32000 + os.getpid() % 1000)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    res = json.loads((out / "throughput.json").read_text())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert res["errors"] == {} and res["skipped"] == {}
    runs = res["runs"]
    v1 = f"b_capture_with_shards/t1:{str(elsewhere).replace('/', '_')}"
    assert sorted(runs) == sorted([
        "a_plain", "a_plain#2", "a_plain@8", "b0_capture_no_shards", "b0_capture_no_shards#2",
        "b0_capture_no_shards@8", "b_capture_with_shards", f"{v1}#1", "b_capture_with_shards/t2#2", f"{v1}#2",
        "b_capture_with_shards@8", "c_return_hidden_states_json", "d_handmade_pt", "d_one_at_a_time"])
    assert runs[f"{v1}#2"]["64"]["shard_threads"] == 1 and runs[f"{v1}#2"]["64"]["shard_dir"] == str(elsewhere)
    assert runs["b_capture_with_shards/t2#2"]["64"]["shard_dir"] == str(out) and list(elsewhere.iterdir()) == []
    d = runs["d_handmade_pt"]["64"]  # one prompt at a time, a raw .pt each: 4 bf16 [64, 64] tensors and more
    assert d["n"] == 24 and d["pt_bytes"] > 24 * 4 * 64 * 64 * 2 and not (out / "handmade-64").exists()
    for part in runs.values():  # every part says what CPU it used
        cpu = part["64"]["cpu"]
        assert cpu["cpus"] == os.cpu_count() and cpu["client_cores"] >= 0 and cpu["machine_busy_cores"] >= 0
        assert cpu["top"] and all(v > 0 for v in cpu["top"].values())
    b = runs["b_capture_with_shards"]["64"]
    assert b["n"] == 24 and b["tokens"] == 24 * 64 and b["shard_threads"] == 2
    assert b["writer"]["requests_done"] >= 24 and b["writer"]["writer_threads"] == 4
    assert 0 < b["stored_over_raw"] < 1.0 and b["shard_bytes"] > 0  # the shard was really written (and compressed)
    # the per-sample timeline reaches from the client through the plugin's marker timestamps and back
    tl = b["timeline"]
    assert set(tl) >= {"slot_wait", "http", "write", "marker_after_answer", "collect_after_marker"}
    assert 0 < tl["last_answered_s"] <= tl["last_collected_s"] <= tl["last_yielded_s"] < b["wall_s"] + 1
    assert len(json.loads((out / "timelines" / "b_capture_with_shards-64.json").read_text())) == 2 * 24
    table = (out / "throughput.md").read_text()
    assert "| b_capture_with_shards@8 / a_plain@8 (target >= 0.9 at 512) |" in table
