"""Regeneration in the workflow (regenerate.enabled) on the default config: tiny model, transformers engine.

Checked: the plan adds one regenerate job per chunk and a join; a whole run validates and prepare read the
regenerated conversations; a chunk that fails (injected through a sitecustomize on PYTHONPATH, so the
workflow code is the real one) leaves the other chunk's file in place, and the rerun redoes only it.
Slow (runs Snakemake).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_workflow import job_counts, make_workdir, smk

pytestmark = pytest.mark.slow

RUN = "regen-test"
CONFIG = f"""\
run_name: {RUN}
sources:
  - {{path: data/conversations.jsonl, format: messages, max_records: 8}}
prompts_per_chunk: 4
max_seq_len: 512
extract: {{threads: 1, mem_mb: 2000, retries: 0}}
regenerate: {{enabled: true, max_new_tokens: 6, batch_size: 4, device: cpu}}
# thinking off: the random tiny model never closes the <think> a thinking prompt opens, and a turn cut inside its
# reasoning is no answer (regenerate cuts it), which would leave prepare nothing to train
chat_template_kwargs: {{thinking: false}}
"""
FAIL_HOOK = """\
import os
if os.environ.get("HSX_FAIL_REGEN_CHUNK"):
    import hsextract.regenerate as r
    _orig = r.run_regenerate_chunk
    def run_regenerate_chunk(settings, chunk_index, out_path, **kw):
        if chunk_index == int(os.environ["HSX_FAIL_REGEN_CHUNK"]):
            raise RuntimeError(f"injected failure of chunk {chunk_index}")
        return _orig(settings, chunk_index, out_path, **kw)
    r.run_regenerate_chunk = run_regenerate_chunk
"""


def test_regeneration_runs_end_to_end_and_a_failed_chunk_reruns_alone(
    tmp_path: Path, background: ThreadPoolExecutor
) -> None:
    wd, fresh = make_workdir(tmp_path / "rg"), make_workdir(tmp_path / "plan")
    for d in (wd, fresh):
        (d / "config/regen.yaml").write_text(CONFIG)
    cfg = ("config/regen.yaml",)
    # the plan of the project before any run, in a second copy: it overlaps the failing run below
    planned = background.submit(smk, fresh, "-n", configfiles=cfg)

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAIL_HOOK)
    fail_env = {"HSX_FAIL_REGEN_CHUNK": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)}
    failed = smk(wd, "--keep-going", check=False, configfiles=cfg, env=fail_env)
    counts = job_counts(planned.result().stdout)
    assert counts["regenerate_chunk"] == 2 and counts["regenerate_concat"] == 1 and counts["extract"] == 2
    assert failed.returncode != 0
    chunks = wd / "results" / RUN / "regenerated/chunks"
    c0, c1 = chunks / "chunk-00000.jsonl", chunks / "chunk-00001.jsonl"
    assert c0.is_file() and not c1.exists() and not (chunks / "chunk-00001.stats.json").exists()
    assert "injected failure of chunk 1" in (wd / "logs" / RUN / "regenerate/chunk-00001.log").read_text()
    kept = c0.stat().st_mtime_ns

    plan = job_counts(smk(wd, "-n", configfiles=cfg).stdout)
    assert plan["regenerate_chunk"] == 1 and plan["regenerate_concat"] == 1 and "make_tiny_model" not in plan
    smk(wd, configfiles=cfg)
    assert c0.stat().st_mtime_ns == kept

    run = wd / "results" / RUN
    regen = run / "regenerated/conversations.jsonl"
    lines = [json.loads(x) for x in regen.read_text().splitlines()]
    assert len(lines) == 8  # one line per input record
    stats = json.loads((run / "regenerated/conversations.stats.json").read_text())
    assert stats["chunks"] == 2 and stats["records"] == 8
    summary = json.loads((run / "prompts/summary.json").read_text())
    assert "regenerated" in json.dumps(summary)  # prepare read the regenerated file
    assert json.loads((run / "dataset.json").read_text())["all_valid"] is True
