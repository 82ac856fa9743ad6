"""The Snakemake workflow end to end, in temporary copies of the project (slow: runs the real pieces).

A small config (3 chunks of 8 records, samples up to 512 tokens) keeps each run short. Checked:
the dry run plans one extract job per chunk; a full run validates; the shards' hidden states equal
an independent transformers forward of each sample alone; a failed chunk reruns alone; the same
config twice gives identical samples; bad configs stop before any job and name the key.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pyarrow
import pyarrow.parquet as pq
import pytest
import torch

from hsextract.dataset import find_shards
from hsextract.provenance import sha256_file
from hsextract.shard import SHARD_SUFFIX, ShardReader

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("Snakefile", "workflow", "config", "envs", "profiles", "resources/reference", "data", "requirements")
RUN = "wf-test"
RECORDS, PER_CHUNK = 24, 8
N_CHUNKS = math.ceil(RECORDS / PER_CHUNK)
TEST_CONFIG = f"""\
run_name: {RUN}
sources:
  - {{path: data/conversations.jsonl, format: messages, weight: 1.0, max_records: {RECORDS}}}
prompts_per_chunk: {PER_CHUNK}
max_seq_len: 512
transformers: {{device: cpu, dtype: bfloat16, token_budget: 1024}}
extract: {{threads: 1, mem_mb: 2000, retries: 0}}
stats: {{position_bins: 32, seq_len_bins: 20}}
"""
# Tolerance, measured on this tiny model (bf16, CPU, batched with padding vs each sample alone):
# most tokens agree exactly or within 1e-2, but an expert's routing flip on a near-tie changes a
# few tokens by up to 0.9 and, through attention, nudges the tokens after them; a whole-sample
# relative error then reaches 0.16 (per-sample bounds of 5e-3 / 2.9e-2 hold only on models with a
# smaller weight scale). In float32 the same comparison gives <= 1.6e-6, so this is bf16 numerics,
# not the pipeline. Hence a per-token check: per sample and tensor, the median token within
# TOL_TOKEN and at least MIN_CLOSE of the tokens within it. A neighbouring, wrong layer has
# every token off by >= 0.22 (median >= 0.33), the pre-norm state instead of post-norm >= 0.8.
TOL_TOKEN, MIN_CLOSE, WRONG_MEDIAN = 2.9e-2, 0.85, 0.2


def snakemake_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("snakemake")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "snakemake"]


def make_workdir(dest: Path, config: str = TEST_CONFIG) -> Path:
    dest.mkdir(parents=True)
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / "config/test.yaml").write_text(config)
    return dest


def smk(
    workdir: Path, *args: str, check: bool = True, configfiles: tuple[str, ...] = ("config/test.yaml",),
    timeout: int = 900, env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run snakemake in `workdir`; targets and options first (--configfile takes every word after it).
    `env`: variables set on top of this process's (a PYTHONPATH there goes after the checkout's src)."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [*snakemake_cmd(), *args, "--cores", "2", "--configfile", *configfiles],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def job_counts(output: str) -> dict[str, int]:
    """The 'Job stats' table of a (dry) run: rule -> number of jobs."""
    table = output[output.index("Job stats:"):]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M) if m[1] != "total"}


def run_dir(workdir: Path) -> Path:
    return workdir / "results" / RUN


def shard_path(workdir: Path, chunk: int) -> Path:
    return run_dir(workdir) / "shards" / f"chunk-{chunk:05d}{SHARD_SUFFIX}"


def run_full(folder: Path) -> Path:
    """The full run of TEST_CONFIG (SCENARIOS: in the background from the module's first test on, so the
    tests before the ones that read it, and the failed-chunk test's own runs, overlap it)."""
    wd = make_workdir(folder / "a")
    (wd / "terminal.txt").write_text(smk(wd).stderr)  # what the user saw (Snakemake writes to stderr)
    return wd


@pytest.fixture(scope="module")
def full_run_started(scenarios_started: dict[str, Future[Path]]) -> Future[Path]:
    return scenarios_started["full_run"]


@pytest.fixture(scope="module")
def full_run(full_run_started: Future[Path]) -> Path:
    return full_run_started.result()


SCENARIOS = {"full_run": run_full}


def test_dry_run_plans_one_extract_job_per_chunk(tmp_path: Path) -> None:
    wd = make_workdir(tmp_path / "dry")
    counts = job_counts(smk(wd, "-n").stdout)
    assert counts == {
        "make_tiny_model": 1, "prepare": 1, "extract": N_CHUNKS, "validate": N_CHUNKS, "stats": N_CHUNKS,
        "aggregate_stats": 1, "seq_length_hist": 1, "manifest": 1, "all": 1,
    }
    # the chunk count follows prompts_per_chunk at parse time
    counts = job_counts(smk(wd, "-n", "--config", "prompts_per_chunk=5").stdout)
    assert counts["extract"] == math.ceil(RECORDS / 5) == 5
    assert not (wd / "results").exists()


def test_unknown_key_stops_before_any_job(tmp_path: Path) -> None:
    wd = make_workdir(tmp_path / "c")
    proc = smk(wd, "--config", "prompts_per_chunck=4", check=False)
    assert proc.returncode != 0
    assert ("prompts_per_chunck: unknown key; did you mean `prompts_per_chunk`? "
            "(workflow/schemas/config.schema.yaml)") in proc.stderr + proc.stdout
    assert not (wd / "results").exists() and not (wd / "logs").exists()


def test_aux_layer_beyond_depth_stops_before_any_job(tmp_path: Path) -> None:
    wd = make_workdir(tmp_path / "d")
    (wd / "config/deep.yaml").write_text(
        "capture: custom\naux_layers: [1, 5, 10]\naux_layers_convention: hidden_states\n")
    proc = smk(wd, check=False, configfiles=("config/test.yaml", "config/deep.yaml"))
    assert proc.returncode != 0
    assert (
        "aux_layers[2]: hidden_states[10] is beyond the aux layers of the tiny model (hsextract.tinymodel): it has "
        "10 decoder layers, so hidden_states ids 0..9 are allowed"
    ) in proc.stderr + proc.stdout
    assert not (wd / "results").exists() and not (wd / "logs").exists()


def test_failed_chunk_reruns_alone_and_same_config_gives_same_samples(
    tmp_path: Path, full_run_started: Future[Path]
) -> None:
    wd = make_workdir(tmp_path / "b")
    smk(wd, f"results/{RUN}/prompts/summary.json")
    bad = run_dir(wd) / "prompts/chunk-00001.parquet"
    good_bytes = bad.read_bytes()
    bad.write_bytes(b"this is not a parquet file")

    failed = smk(wd, "--keep-going", check=False)
    assert failed.returncode != 0
    assert shard_path(wd, 0).is_file() and shard_path(wd, 2).is_file() and not shard_path(wd, 1).exists()
    assert [p.name for p in (run_dir(wd) / "shards").iterdir() if p.name.endswith(".tmp")] == []  # no partial shard
    assert (run_dir(wd) / "validation/chunk-00002.json").is_file() and not (run_dir(wd) / "dataset.json").exists()
    log = (wd / "logs" / RUN / "extract/chunk-00001.log").read_text()
    assert "chunk-00001.parquet: cannot read the prompts parquet" in log
    kept = {i: shard_path(wd, i).stat().st_mtime_ns for i in (0, 2)}

    bad.write_bytes(good_bytes)
    plan = job_counts(smk(wd, "-n").stdout)
    assert plan == {"extract": 1, "validate": 1, "stats": 1, "aggregate_stats": 1, "seq_length_hist": 1, "manifest": 1,
            "all": 1}
    smk(wd)
    assert {i: shard_path(wd, i).stat().st_mtime_ns for i in (0, 2)} == kept
    assert json.loads((run_dir(wd) / "dataset.json").read_text())["all_valid"] is True

    # The same config (own tiny model, own prepare) gives the same samples as the full run.
    full_run = full_run_started.result()
    a, b = find_shards(run_dir(full_run)), find_shards(run_dir(wd))
    assert [p.name for p in a] == [p.name for p in b]
    for pa, pb in zip(a, b, strict=True):
        ra, rb = ShardReader(pa), ShardReader(pb)
        assert ra.sample_ids == rb.sample_ids
        for k in range(len(ra)):
            sa, sb = ra[k], rb[k]
            assert torch.equal(sa["input_ids"], sb["input_ids"]) and torch.equal(sa["loss_mask"], sb["loss_mask"])
            assert all(torch.equal(x, y) for x, y in zip(sa["hidden_states"], sb["hidden_states"], strict=True))


def test_full_run_validates(full_run: Path) -> None:
    rd = run_dir(full_run)
    manifest = json.loads((rd / "dataset.json").read_text())
    prep = json.loads((rd / "prompts/summary.json").read_text())
    assert manifest["all_valid"] is True
    assert [s["path"] for s in manifest["shards"]] == [f"shards/chunk-{i:05d}{SHARD_SUFFIX}" for i in range(N_CHUNKS)]
    for i, entry in enumerate(manifest["shards"]):
        report = json.loads((rd / entry["validation"]).read_text())
        assert report["passed"] is True, report
        assert entry["sha256"] == sha256_file(shard_path(full_run, i))
        assert entry["samples"] == len(ShardReader(shard_path(full_run, i)))
        # each shard records the prompts file it was made from; the manifest compared it with the file there
        prompts = sha256_file(rd / f"prompts/chunk-{i:05d}.parquet")
        assert entry["prompts_sha256"] == ShardReader(shard_path(full_run, i)).metadata["prompts_sha256"] == prompts
    assert manifest["prompts_unchecked"] == []
    counts = manifest["counts"]
    assert counts["samples"] == prep["kept"] and counts["tokens"] == prep["tokens"]
    assert counts["trained_tokens"] == prep["trained_tokens"]
    assert counts["samples"] + counts["dropped_samples"] == RECORDS
    assert counts["dropped"] == prep["dropped"]
    assert 0 < counts["stored_over_raw"] <= counts["codec_ratio"] < 1.0  # the codec alone: no sharing in it
    assert manifest["aux_layers"] == [2, 5, 7] and manifest["final_state"] == "pre_norm"  # capture: eagle3
    assert manifest["layer_convention"] == "hidden_states"
    assert manifest["layers"]["vllm"] == {"eagle_aux_hidden_state_layer_ids": [2, 5, 7]}
    assert manifest["layers"]["sglang_0.5.16"]["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]  # DeepseekV3: raw
    assert manifest["layers"]["specforge"] == {"0.2.0": {"aux_hidden_state_layer_ids": [2, 5, 7]},
                                               "hf_backend": {"aux_hidden_states_layers": [1, 4, 6]},
                                               "sglang_backend": {"aux_hidden_states_layers": [2, 5, 7]}}
    assert manifest["provenance"]["config"]["run_name"] == RUN
    assert len(manifest["provenance"]["model_hash"]) == 64
    lock = {"path": "requirements/cpu.lock", "sha256": sha256_file(ROOT / "requirements/cpu.lock")}
    assert manifest["provenance"]["lock"] == lock
    # token frequencies from the shards equal prepare's, computed from the prompts
    ours = torch.load(rd / "token_freq.pt", weights_only=True)
    assert ours == torch.load(rd / "prompts/token_freq.pt", weights_only=True)
    assert sum(ours.values()) == counts["trained_tokens"]
    summary = dict(line.split("\t") for line in (rd / "stats/summary.tsv").read_text().splitlines()[1:])
    assert int(summary["samples"]) == counts["samples"] and int(summary["chunks"]) == N_CHUNKS
    for png in ("seq_length_hist.png", "layer_rms_by_position.png"):
        assert (rd / "stats" / png).read_bytes()[:4] == b"\x89PNG"
    for rule in ("prepare", "extract", "validate", "stats", "aggregate_stats", "manifest"):
        assert any((full_run / "logs" / RUN / rule).iterdir()), rule
    assert (full_run / "benchmarks" / RUN / "extract/chunk-00000.tsv").is_file()
    # the run's last word on the terminal: its dataset.json, said
    assert (f"hsextract: results/{RUN}/dataset.json: {counts['samples']:,} samples, {counts['tokens']:,} tokens "
            f"({counts['trained_tokens']:,} trained) in {N_CHUNKS} shards, ") in (full_run / "terminal.txt").read_text()
    # the logs hold whole lines, no carriage-return bars (the extract's, transformers' loading weights)
    for rule in ("prepare", "extract", "validate"):
        for log in (full_run / "logs" / RUN / rule).iterdir():
            assert "\r" not in log.read_text(), log


def test_shards_match_prompts_exactly(full_run: Path) -> None:
    for i in range(N_CHUNKS):
        rows = pq.read_table(run_dir(full_run) / f"prompts/chunk-{i:05d}.parquet").to_pylist()
        reader = ShardReader(shard_path(full_run, i))
        assert reader.sample_ids == [r["sample_id"] for r in rows]
        for k, row in enumerate(rows):
            s = reader[k]
            assert s["input_ids"].tolist() == row["input_ids"] and s["input_ids"].dtype == torch.int64
            assert s["loss_mask"].tolist() == row["loss_mask"] and s["loss_mask"].dtype == torch.int64
            assert [tuple(h.shape) for h in s["hidden_states"]] == [(len(row["input_ids"]), 256)] * 4
            assert all(h.dtype == torch.bfloat16 for h in s["hidden_states"])


def token_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative error of every token: |got - ref| / |ref| over the hidden dimension."""
    return (got.float() - ref.float()).norm(dim=1) / ref.float().norm(dim=1)


def test_hidden_states_equal_independent_forward(full_run: Path) -> None:
    """Each sample alone, unpadded, through plain transformers: aux id i = hidden_states[i] (what an EAGLE-3
    engine feeds a drafter), and not hidden_states[i+1] (the outputs of those layers)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(full_run / "resources/tiny-model", dtype=torch.bfloat16).eval()
    last = {}
    model.model.layers[-1].register_forward_hook(
        lambda m, i, o: last.__setitem__("out", o[0] if isinstance(o, tuple) else o))
    aux = [2, 5, 7]  # the eagle3 preset of 10 layers
    checked = 0
    for i in range(N_CHUNKS):
        reader = ShardReader(shard_path(full_run, i))
        for k in range(min(3, len(reader))):  # the first samples of every chunk: each batch had padding
            s = reader[k]
            with torch.inference_mode():
                hs = model.model(input_ids=s["input_ids"][None], output_hidden_states=True).hidden_states
                pre = last["out"][0]
                post = model.model.norm(last["out"])[0]
            assert torch.equal(post, hs[-1][0])  # transformers' last hidden state is post-norm
            # final_state: pre_norm (the default): the last decoder layer's output, not the normed one
            right = [hs[layer][0] for layer in aux] + [pre]
            wrong = [hs[layer + 1][0] for layer in aux] + [post]
            for j in range(4):
                err = token_errors(s["hidden_states"][j], right[j])
                where = f"chunk {i} sample {k} tensor {j}"
                assert float(err.median()) <= TOL_TOKEN, (where, float(err.median()))
                assert float((err <= TOL_TOKEN).float().mean()) >= MIN_CLOSE, (where, err.tolist())
                assert float(token_errors(s["hidden_states"][j], wrong[j]).median()) >= WRONG_MEDIAN, where
            checked += 1
    assert checked >= 6


def test_default_run_exports_to_speculators_without_final_norm_warning(
    full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hsextract.export import export
    from hsextract.extract.final_norm import read_final_norm

    rd = full_run / "results" / RUN
    meta = ShardReader(shard_path(full_run, 0)).metadata
    assert meta["final_state"] == "pre_norm"
    norm = read_final_norm(str(full_run / "resources/tiny-model"))
    assert meta["final_norm"] == norm.to_metadata()
    summary = export(rd, tmp_path / "v1", "speculators-v1")
    assert summary["warning"] is None and capsys.readouterr().err == ""
    summary = export(rd, tmp_path / "sf", "specforge")  # pre -> post through the recorded norm
    assert summary["warning"] is None and summary["final_norm_applied"] and capsys.readouterr().err == ""


def test_export_job_without_a_shared_filesystem_reads_the_shards_in_place(full_run: Path, tmp_path: Path) -> None:
    """profiles/kubernetes: each job starts in an empty folder and gets its declared inputs from the storage. The
    export job, alone in a fresh working folder (what a pod is) over the full run's results in an `fs` storage:
    it has every shard (it declared only dataset.json before, and failed with "listed ... but missing"), each
    linked from the storage, not copied (shards are flagged sequential), and exports every sample.
    rsync, which the fs plugin runs to copy the rest, is not on this machine: a stand-in copies as it would."""
    pytest.importorskip("snakemake_storage_plugin_fs", reason="needs the cluster extra")
    store = tmp_path / "store"
    for name in ("results", "resources", "data"):
        shutil.copytree(full_run / name, store / name, symlinks=True)  # copy2: times kept, nothing is out of date
    assert not (store / "results" / RUN / "export").exists()  # TEST_CONFIG exports nothing: the export is to be made
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "rsync").write_text(
        "#!/bin/bash\n# rsync --recursive --times --copy-links SRC DST, as snakemake-storage-plugin-fs calls it\n"
        f'echo "$@" >> {tmp_path}/rsync.calls\n'
        'src="${@: -2:1}"; dst="${@: -1}"; mkdir -p "$(dirname "$dst")"\n'
        'if [ -d "$src" ]; then mkdir -p "$dst"; cp -rL --preserve=timestamps "${src%/}/." "$dst"\n'
        'else cp -L --preserve=timestamps "$src" "$dst"; fi\n')
    (bin_dir / "rsync").chmod(0o755)
    pod = make_workdir(tmp_path / "pod")
    proc = smk(pod, f"results/{RUN}/export/speculators-v1", "--default-storage-provider", "fs",
               "--default-storage-prefix", str(store), "--allowed-rules", "export",
               env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    out = proc.stdout + proc.stderr
    shards = [f"{store}/results/{RUN}/shards/chunk-{c:05d}{SHARD_SUFFIX}" for c in range(N_CHUNKS)]
    for shard in shards:
        assert f"Creating symlink for on-demand retrieval of {shard}." in out
    assert not any(SHARD_SUFFIX in line for line in (tmp_path / "rsync.calls").read_text().splitlines())
    manifest = json.loads((store / "results" / RUN / "dataset.json").read_text())
    exported = store / "results" / RUN / "export/speculators-v1/data"
    assert len(list(exported.glob("*.pt"))) == manifest["counts"]["samples"] > 0


def test_a_command_run_from_another_folder_says_where_it_looked(tmp_path: Path) -> None:
    """`snakemake -s <checkout>/Snakefile -d DIR --configfile FILE`: Snakemake skipped the missing default config
    silently, and a relative path's error did not say it was looked for in DIR (audit)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = tmp_path / "test.yaml"
    config.write_text(TEST_CONFIG)
    proc = subprocess.run([*snakemake_cmd(), "-n", "-s", str(ROOT / "Snakefile"), "-d", str(elsewhere),
                           "--configfile", str(config)], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0 and "Job stats" not in out, out[-3000:]
    assert (f"hsextract: NOTE: config/config.yaml is not in the working directory {elsewhere}: the embedded defaults "
            "do not apply, only the schema's and your config files' (whose relative paths are resolved against that "
            "directory)") in out
    assert f"does not exist (relative to the working directory {elsewhere})" in out, out[-3000:]


def test_report_of_an_unfinished_run_says_so(tmp_path: Path) -> None:
    """Before the run (or after a chunk failed under keep-going) there is no dataset.json to report: said as the
    run being unfinished, not as Snakemake's "marked for report but does not exist"."""
    wd = make_workdir(tmp_path / "wd")
    proc = smk(wd, "--report", "report.html", check=False)
    manifest = f"results/{RUN}/dataset.json"
    assert proc.returncode != 0 and not (wd / "report.html").exists()
    assert (f"snakemake --report: {manifest} does not exist: the run has not finished (a chunk failed, or it has "
            f"not run yet), and the report shows the whole dataset. Finish the run first (`snakemake --cores N`: "
            f"only the missing chunks are extracted; a failed job's log is under logs/{RUN}/)") in proc.stderr
    # with --report-after-run (which takes --report too) the run comes first: planned, not refused (review)
    # (a dry run, whose report Snakemake then cannot make: its own failure, after the plan)
    planned = smk(wd, "-n", "--report", "report.html", "--report-after-run", check=False)
    assert "Job stats" in planned.stdout and "snakemake --report:" not in planned.stderr


def test_report_of_a_run_unfinished_since_its_dataset_json_says_so(tmp_path: Path, full_run: Path) -> None:
    """A dataset.json of an earlier finish: a shard it lists gone, one written after it (a chunk being extracted
    again), another chunk count configured. Snakemake reported the earlier dataset without a word (audit)."""
    wd = copy_of(full_run, tmp_path)
    manifest, shard = f"results/{RUN}/dataset.json", shard_path(wd, 2)
    tail = (f"the report shows the whole dataset. Finish the run first (`snakemake --cores N`: only the missing "
            f"chunks are extracted; a failed job's log is under logs/{RUN}/)")
    shard.rename(tmp_path / "kept.hss")
    proc = smk(wd, "--report", "report.html", check=False)
    assert proc.returncode != 0 and not (wd / "report.html").exists()
    assert (f"snakemake --report: {shard.relative_to(wd)}, which {manifest} lists, is missing: the run has not "
            f"finished since (a chunk failed, or it is being extracted again), and {tail}") in proc.stderr
    (tmp_path / "kept.hss").rename(shard)
    os.utime(shard, (time.time() + 60, time.time() + 60))
    proc = smk(wd, "--report", "report.html", check=False)
    assert (f"snakemake --report: {shard.relative_to(wd)}, which {manifest} lists, was written after it: the run has "
            f"not finished since (a chunk failed, or it is being extracted again), and {tail}") in proc.stderr
    proc = smk(wd, "--report", "report.html", "--config", f"prompts_per_chunk={RECORDS}", check=False)
    assert (f"snakemake --report: {manifest} lists {N_CHUNKS} chunks and the config makes 1: it describes an earlier "
            f"run, this one has not finished, and {tail}") in proc.stderr
    assert not (wd / "report.html").exists()


def test_report_after_run(full_run: Path) -> None:
    smk(full_run, "--report", "report.html")
    html = (full_run / "report.html").read_text(errors="replace")
    for text in ("Dataset statistics", "Hidden states", "Validation", RUN, "resources/tiny-model"):
        assert text in html, text
    # the sources' list ends with a space before the sentence goes on (a template whitespace bug)
    assert f"(messages, at most {RECORDS} records) were rendered" in html and ")were" not in html
    # what decides the masks, said in the report (and in dataset.json's provenance)
    for text in ("reasoning trained", "chat template the tokenizer", "split_turns: auto", "once where they share"):
        assert text in html, text
    # the tables and the validation summary are HTML pages embedded in the report (base64 data URIs)
    pages = {}
    for uri in re.findall(r"data:text/html;[^,\"]*base64,([A-Za-z0-9+/=]+)", html):
        text = base64.b64decode(uri).decode()
        title = re.search(r"<h1>(.*?)</h1>", text)
        if title:
            pages[title[1]] = text
    assert set(pages) >= {"Totals", "Per chunk", "Per stored tensor", "Sequence-length quantiles",
                          "Dropped by prepare (whole records, or samples of a record)", "Validation"}, sorted(pages)
    samples = json.loads((run_dir(full_run) / "dataset.json").read_text())["counts"]["samples"]
    assert f'<tr><td>samples</td><td class="num">{samples:,}</td></tr>' in pages["Totals"]
    assert f"{N_CHUNKS} of {N_CHUNKS} shards passed validation ({samples:,} samples)." in pages["Validation"]
    assert '<tr><td>finite</td><td class="num">3</td><td class="num">0</td></tr>' in pages["Validation"]
    assert pages["Per chunk"].count("<tr><td") == N_CHUNKS


def readme_rerun_command() -> str:
    """The shell line of the README's rerun section (deleted shard)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Reruns and failures"):]
    return re.search(r"^ {6}(rm results/\S+\.hss; \S*snakemake .*)$", section, re.M)[1]


def test_readme_deleted_shard_reruns_alone(tmp_path: Path, full_run: Path) -> None:
    """The README's command, as written, in a copy of the full run whose config/config.yaml holds
    the test settings (the plain command reads no other config file)."""
    import yaml
    from snakemake.utils import update_config

    wd = tmp_path / "copy"
    shutil.copytree(full_run, wd, symlinks=True)
    base = yaml.safe_load((wd / "config/config.yaml").read_text())
    update_config(base, yaml.safe_load((wd / "config/test.yaml").read_text()))
    (wd / "config/config.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    command = readme_rerun_command()
    assert command == "rm results/tiny-default/shards/chunk-00002.hss; .venv/bin/snakemake --cores 2"
    command = command.replace("tiny-default", RUN).replace(".venv/bin/snakemake", shlex.join(snakemake_cmd()))
    kept = {i: shard_path(wd, i).stat().st_mtime_ns for i in (0, 1)}
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(command, shell=True, cwd=wd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert job_counts(proc.stdout + proc.stderr) == {
        "extract": 1, "validate": 1, "stats": 1, "aggregate_stats": 1, "seq_length_hist": 1, "manifest": 1, "all": 1,
    }
    assert {i: shard_path(wd, i).stat().st_mtime_ns for i in (0, 1)} == kept
    manifest = json.loads((run_dir(wd) / "dataset.json").read_text())
    assert manifest["all_valid"] is True
    assert manifest["shards"][2]["sha256"] == sha256_file(shard_path(wd, 2))
    # the rerun wrote the same samples as the first run
    assert sha256_file(shard_path(wd, 2)) == sha256_file(shard_path(full_run, 2))


def copy_of(full_run: Path, dest: Path) -> Path:
    wd = dest / "copy"
    shutil.copytree(full_run, wd, symlinks=True)
    return wd


CHUNK_FILES = (("prompts", ".parquet"), ("shards", SHARD_SUFFIX), ("validation", ".json"), ("stats", ".json"))


def test_fewer_chunks_remove_the_earlier_chunks_files(tmp_path: Path, full_run: Path) -> None:
    """The full run's 3 chunks, then a config of 1 (max_records 8): chunks 1 and 2's prompts (removed by prepare),
    shards, validation reports and statistics (by the manifest step) are gone, each named in the step's log; the
    shard folder and `hsextract validate` then read the current chunk alone, as dataset.json lists it."""
    wd = copy_of(full_run, tmp_path)
    (wd / "config/test.yaml").write_text(TEST_CONFIG.replace(f"max_records: {RECORDS}", f"max_records: {PER_CHUNK}"))
    smk(wd)
    rd = run_dir(wd)
    for folder, suffix in CHUNK_FILES:
        assert sorted(p.name for p in (rd / folder).glob("chunk-*")) == [f"chunk-00000{suffix}"], folder
    line = "removed results/{run}/{folder}/chunk-{c:05d}{suffix}: chunk {c} of an earlier configuration (now 1 chunks)"
    prepare_log = (wd / "logs" / RUN / "prepare/prepare.log").read_text().splitlines()
    manifest_log = (wd / "logs" / RUN / "manifest/manifest.log").read_text().splitlines()
    assert [x for x in prepare_log if x.startswith("removed ")] == [
        line.format(run=RUN, folder="prompts", suffix=".parquet", c=c) for c in (1, 2)]
    assert [x for x in manifest_log if x.startswith("removed ")] == [
        line.format(run=RUN, folder=folder, suffix=suffix, c=c) for folder, suffix in CHUNK_FILES[1:] for c in (1, 2)]
    from hsextract import open_dataset

    manifest = json.loads((rd / "dataset.json").read_text())
    assert len(manifest["shards"]) == 1 and manifest["all_valid"] is True
    assert len(open_dataset(rd / "shards")) == manifest["counts"]["samples"] == len(ShardReader(shard_path(wd, 0)))
    assert manifest["counts"]["samples"] + manifest["counts"]["dropped_samples"] == PER_CHUNK
    dry = smk(wd, "-n")
    assert "Nothing to be done" in dry.stdout + dry.stderr


def test_prompts_rewritten_under_their_old_mtime_stop_the_manifest(tmp_path: Path, full_run: Path) -> None:
    """Chunk 1's prompts rewritten with every input id changed, their modification time kept, and prepare's record
    of them (summary.json's per_chunk sha256) with them, as a prepare of a release that kept times would: Snakemake
    plans nothing (it compares times), but the manifest step, when it runs, stops naming the chunk; deleting the
    shard, as it says, reruns that chunk alone and the dataset is whole again."""
    wd = copy_of(full_run, tmp_path)
    rd = run_dir(wd)
    prompts, shard = rd / "prompts/chunk-00001.parquet", shard_path(wd, 1)
    recorded, st = sha256_file(prompts), prompts.stat()
    table = pq.read_table(prompts)
    field = table.schema.field("input_ids")
    ids = [[(t + 1) % 1000 for t in row] for row in table.column("input_ids").to_pylist()]
    pq.write_table(table.set_column(table.schema.get_field_index("input_ids"), field,
                                    pyarrow.array(ids, field.type)), prompts)
    os.utime(prompts, ns=(st.st_atime_ns, st.st_mtime_ns))
    summary_path = rd / "prompts/summary.json"
    summary, st_summary = json.loads(summary_path.read_text()), summary_path.stat()
    summary["per_chunk"][1]["sha256"] = sha256_file(prompts)
    summary_path.write_text(json.dumps(summary))
    os.utime(summary_path, ns=(st_summary.st_atime_ns, st_summary.st_mtime_ns))
    dry = smk(wd, "-n")
    assert "Nothing to be done" in dry.stdout + dry.stderr
    failed = smk(wd, "--forcerun", "manifest", check=False)
    assert failed.returncode != 0
    log = (wd / "logs" / RUN / "manifest/manifest.log").read_text()
    rel_shard, rel_prompts = shard.relative_to(wd), prompts.relative_to(wd)
    assert (f"hsextract.errors.ValidationFailure: {rel_shard}: chunk 1 was extracted from prompts of sha256 "
            f"{recorded}, but {rel_prompts} now has sha256 {sha256_file(prompts)}: the prompts changed after the shard "
            "was written (and kept an older modification time, so Snakemake did not rerun the chunk). Delete the shard "
            "and rerun: only its chunk is extracted again.") in log
    kept = {i: shard_path(wd, i).stat().st_mtime_ns for i in (0, 2)}
    shard.unlink()
    rerun = smk(wd)
    assert job_counts(rerun.stdout + rerun.stderr)["extract"] == 1
    assert {i: shard_path(wd, i).stat().st_mtime_ns for i in (0, 2)} == kept
    manifest = json.loads((rd / "dataset.json").read_text())
    assert manifest["all_valid"] is True and manifest["shards"][1]["prompts_sha256"] == sha256_file(prompts)
    assert ShardReader(shard)[0]["input_ids"].tolist() == ids[0]


def test_a_damaged_prompts_file_newer_than_its_shard_keeps_the_shard(tmp_path: Path, full_run: Path) -> None:
    """Chunk 1's prompts file damaged in place (a byte flipped, its time now): Snakemake would extract the chunk
    again and delete the good shard first, and the job then failed on the damaged file (audit). The command stops as
    the Snakefile is read, naming the file; restored with `cp -p`, nothing is planned and the shard is untouched."""
    wd = copy_of(full_run, tmp_path)
    rd = run_dir(wd)
    prompts, shard = rd / "prompts/chunk-00001.parquet", shard_path(wd, 1)
    shutil.copy2(prompts, tmp_path / "backup.parquet")
    recorded, before = sha256_file(prompts), shard.stat().st_mtime_ns
    data = bytearray(prompts.read_bytes())
    data[len(data) // 2] ^= 0xFF
    prompts.write_bytes(bytes(data))
    for args in (("-n",), ()):
        proc = smk(wd, *args, check=False)
        out = " ".join((proc.stdout + proc.stderr).split())
        assert proc.returncode != 0 and "Job stats" not in out, out[-3000:]
        rel_prompts, rel_shard = prompts.relative_to(wd), shard.relative_to(wd)
        assert (f"{rel_prompts} is newer than {rel_shard}, so Snakemake would extract chunk 1 again, deleting that "
                f"shard first; but it is not the prompts file prepare wrote (sha256 {sha256_file(prompts)}, prepare "
                f"recorded {recorded}): it was damaged or changed since, and the shard made from the original is good. "
                f"Restore {rel_prompts} (`cp -p` from a copy) and run the command again; or delete it and run the same "
                "command, which writes every chunk's prompts again and extracts every chunk again.") in out
        assert shard.stat().st_mtime_ns == before
    subprocess.run(["cp", "-p", str(tmp_path / "backup.parquet"), str(prompts)], check=True)
    assert "Nothing to be done" in smk(wd, "-n").stdout


# What a config change reruns (hsextract.config.reruns.KEYS). Each key is changed alone on a run where its rules have
# jobs: the full run for most keys; for `sglang.*` and `regenerate.*` (and the keys regenerate reads too), the
# full run recorded as made under `engine: sglang` or `regenerate.enabled` (snakemake --touch: nothing runs).
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    # post-norm: sglang.prefill_cuda_graph, changed with the other operational keys, is refused with a pre-norm state
    "sglang": {"engine": "sglang", "final_state": "post_norm"},
    "regenerate": {"regenerate": {"enabled": True}},
    "regenerate_sglang": {"regenerate": {"enabled": True, "engine": "sglang", "server_url": "http://127.0.0.1:30998"}},
    "regenerate_sampled": {"regenerate": {"enabled": True, "temperature": 0.7}},
}
# Keys that decide their rules only in some runs (hsextract.config.reruns.EFFECTIVE), each changed alone in a variant
# where it counts for nothing: it plans nothing there. SGLang serves in bfloat16 whatever transformers.dtype says; a
# regeneration on sglang loads no model, whatever regenerate.dtype says; one on transformers sends no request, so no
# seed in one (regenerate.send_seed); regenerate.engine transformers is the run's engine (null) in `regenerate`,
# whose greedy decoding draws nothing, whatever its seed, top_p and top_k.
_DRAWS = ("regenerate.seed", "regenerate.top_p", "regenerate.top_k")
INERT: dict[str, tuple[str, ...]] = {
    "sglang": ("transformers.dtype",),
    "regenerate": ("regenerate.send_seed", "regenerate.engine", *_DRAWS),
    "regenerate_sglang": ("regenerate.dtype",),
}
# ... and changed in a variant where they count (besides those of their section's variant)
COUNTS: dict[str, tuple[str, ...]] = {"regenerate_sglang": ("regenerate.send_seed", "regenerate.engine"),
                                      "regenerate_sampled": _DRAWS}
# Changed values the schema's types alone do not give: another value with the keys it needs, or a file that exists.
EXAMPLES: dict[str, dict[str, Any]] = {
    "run_name": {"run_name": "another-run"},
    "model": {"model": "resources/another-tiny-model"},
    "make_tiny_model": {"make_tiny_model": False, "reference_sample": "resources/reference/tiny.pt"},
    # the model's tokenizer, copied (the model's own directory, named, is null: the same param)
    "tokenizer": {"tokenizer": "resources/tiny-tokenizer"},
    # the tiny model's kimi tokenizer is custom code
    "trust_remote_code": {"trust_remote_code": False, "tiny_model_tokenizer": "fast"},
    # the shipped reference sample holds 3 aux layers
    "capture": {"capture": "custom", "aux_layers": [1, 2, 3], "aux_layers_convention": "hidden_states"},
    "aux_layers": {"capture": "custom", "aux_layers": [1, 2, 3], "aux_layers_convention": "hidden_states"},
    "aux_layers_convention": {"capture": "custom", "aux_layers": [1, 2, 3], "aux_layers_convention": "layer_output"},
    "reference_sample": {"reference_sample": "resources/reference/copy.pt"},
    "sources": {"sources": [{"path": "data/conversations.jsonl", "format": "messages", "max_records": RECORDS - 8}]},
    "chat_template": {"chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"},
    "chat_template_kwargs": {"chat_template_kwargs": {"thinking": False}},  # issue 35: it planned nothing
    # with regenerate.enabled, regeneration then runs on sglang too: through a server of its own
    "engine": {"engine": "sglang", "regenerate.server_url": "http://127.0.0.1:30998"},
    "transformers.device": {"transformers.device": "auto"},
    # the shards' dtype: the reference sample's must be it (checked at parse time)
    "transformers.dtype": {"transformers.dtype": "float16", "reference_sample": "resources/reference/f16.pt"},
    "sglang.python": {"sglang.python": sys.executable},
    "sglang.launch_args": {"sglang.launch_args": ["--mem-fraction-static", "0.8"]},
    # the file is made (mode 0600) by the test below
    "sglang.host": {"sglang.host": "0.0.0.0", "sglang.api_key_file": "config/api-key"},
    "sglang.api_key_file": {"sglang.api_key_file": "config/api-key"},
    # exactly tp x replicas ids (checked at parse time); tp and replicas as the other changes make them
    "sglang.gpus": {"sglang.gpus": [0, 1, 2, 3], "sglang.tp": 2, "sglang.replicas": 2},
    "sglang.server_url": {"sglang.server_url": "http://127.0.0.1:30999", "sglang.dump_dir": "dumps"},
    "sglang.servers": {"sglang.servers": ["http://127.0.0.1:30999"], "sglang.dump_dir": "dumps"},
    "sglang.dump_dir": {"sglang.dump_dir": "dumps"},
    "regenerate.stop_token_ids": {"regenerate.stop_token_ids": [1]},
    "regenerate.device": {"regenerate.device": "cpu"},
    "regenerate.server_url": {"regenerate.server_url": "http://127.0.0.1:30998"},
    "regenerate.api_key_file": {"regenerate.api_key_file": "config/api-key"},
}


def dotted_get(config: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        config = config[part]
    return config


def nested(changes: dict[str, Any]) -> dict[str, Any]:
    """{"a.b": 1} -> {"a": {"b": 1}}"""
    out: dict[str, Any] = {}
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def changed_value(key: str, prop: dict[str, Any], current: Any) -> dict[str, Any]:
    """{dotted key: value} that changes `key` from `current`: EXAMPLES, else from its schema."""
    if key in EXAMPLES:
        return EXAMPLES[key]
    types = prop["type"] if isinstance(prop.get("type"), list) else [prop.get("type")]
    if "enum" in prop:
        return {key: next(v for v in prop["enum"] if v != current and v is not None)}
    if isinstance(current, bool):
        return {key: not current}
    if "integer" in types or "number" in types:
        if current is None:
            return {key: 64}
        up = current + 1
        return {key: up if up <= prop.get("maximum", up) else current / 2 if "number" in types else current - 1}
    if "array" in types and "enum" in prop.get("items", {}):
        return {key: [next(v for v in prop["items"]["enum"] if v not in (current or ()))]}
    if types == ["string"] and isinstance(current, str) and "pattern" not in prop:
        return {key: current + "x"}
    raise AssertionError(f"{key}: the test cannot make another value of it from the schema; add one to EXAMPLES")


def tiny_reference(wd: Path) -> None:
    """resources/reference/tiny.pt: a reference of the tiny model's width, for make_tiny_model: false (a real
    model's must match it)."""
    dataset = json.loads((run_dir(wd) / "dataset.json").read_text())
    hidden, n = dataset["hidden_size"], len(dataset["aux_layers"]) + 1
    torch.save({"input_ids": torch.arange(4), "hidden_states": [torch.zeros(4, hidden, dtype=torch.bfloat16)] * n,
                "loss_mask": torch.ones(4, dtype=torch.int64)}, wd / "resources/reference/tiny.pt")


class Plans:
    """tests/snakemake_plans.py, running in `workdir`: `plan(config, forcerun)`, `touch(config)`."""

    def __init__(self, workdir: Path, log: Path) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/snakemake_plans.py"), str(workdir), "config/test.yaml"],
            cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
        )

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"snakemake_plans.py ended ({self.proc.poll()}): {self.log.read_text()[-3000:]}"
        answer = json.loads(line)
        assert "error" not in answer, f"{request}: {answer['error']}"
        return answer

    def plan(self, config: dict[str, Any], forcerun: tuple[str, ...] = ()) -> dict[str, int]:
        return self.ask({"plan": config, "forcerun": list(forcerun)})["plan"]

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(60)


def test_every_config_key_reruns_exactly_the_rules_it_decides(tmp_path: Path, full_run: Path) -> None:
    """Generated from the schema: after a finished run, each key that decides data, changed alone, makes the dry
    run plan exactly the rules hsextract.config.reruns.KEYS names for it and what follows them (the plan of `--forcerun
    RULES` under the same config); the operational keys, all changed at once, plan nothing. First, as a user
    would: `chat_template_kwargs: {thinking: false}` in a config file given to the same command plans prepare
    (issue 35: it planned nothing)."""
    import yaml
    from snakemake.utils import update_config

    from hsextract.config import reruns
    from hsextract.config.settings import fill_defaults, schema

    wd = tmp_path / "reruns"
    shutil.copytree(full_run, wd, symlinks=True)
    plans = Plans(wd, tmp_path / "plans.log")  # its imports overlap the command below
    try:
        (wd / "config/thinking.yaml").write_text("chat_template_kwargs: {thinking: false}\n")
        plan = job_counts(smk(wd, "-n", configfiles=("config/test.yaml", "config/thinking.yaml")).stdout)
        assert plan["prepare"] == 1 and plan["extract"] == N_CHUNKS and plan["manifest"] == 1, plan

        shutil.copy2(wd / "resources/reference/speculators-v1-data_0.pt", wd / "resources/reference/copy.pt")
        shutil.copytree(wd / "resources/tiny-model", wd / "resources/tiny-tokenizer",
                        ignore=shutil.ignore_patterns("*.safetensors"))
        (wd / "config/api-key").write_text("a-secret-of-16-chars-or-more\n")
        (wd / "config/api-key").chmod(0o600)
        tiny_reference(wd)
        # the shipped reference in float16, for a transformers.dtype of float16 (validation compares dtypes)
        ref = torch.load(wd / "resources/reference/speculators-v1-data_0.pt", weights_only=True)
        torch.save({**ref, "hidden_states": [t.to(torch.float16) for t in ref["hidden_states"]]},
                   wd / "resources/reference/f16.pt")
        leaves = _schema_leaves(schema()["properties"])
        assert set(leaves) == set(reruns.KEYS)  # tests/test_reruns.py says which differ
        base = yaml.safe_load((wd / "config/config.yaml").read_text())
        update_config(base, yaml.safe_load((wd / "config/test.yaml").read_text()))
        wrong, seen_rules = [], set()

        def check(name: str, variant: dict[str, Any], change: dict[str, Any], oracle: dict[Any, Any],
                  inert: bool = False) -> None:
            """`change` ({dotted key: value}) on top of `variant` plans what forcing its keys' rules plans (nothing
            where it is `inert`)."""
            nonlocal seen_rules
            config = copy.deepcopy(variant)
            update_config(config, nested(change))
            rules = () if inert else tuple(r for r in reruns.RULES if any(r in reruns.KEYS[k] for k in change))
            answer = plans.ask({"plan": config})
            got, seen_rules = answer["plan"], seen_rules | set(answer["rules"])
            expected: dict[str, int] = {}
            if rules:
                # forcing its rules on the unchanged run first (the same jobs, shared by keys), else under this config
                if rules not in oracle:
                    oracle[rules] = plans.plan(variant, rules)
                expected = oracle[rules] if got == oracle[rules] else plans.plan(config, rules)
                if not expected:
                    wrong.append(f"{name}: {list(change)}: none of the rules {rules} has a job in this run")
            if got != expected:
                why = rules or ("it counts for nothing here" if inert else "operational")
                wrong.append(f"{name}: {change}: planned {got}, expected {expected} ({why})")

        for name, variant in VARIANTS.items():
            if variant:
                plans.ask({"touch": variant})
            assert plans.plan(variant) == {}, name  # a finished run: nothing to do
            current = fill_defaults({**base, **variant})
            operational: dict[str, Any] = {}
            oracle: dict[Any, Any] = {}
            for key, rules in reruns.KEYS.items():
                section = key.split(".")[0] if "." in key else None
                wanted = (section == name) if section in VARIANTS else (
                    name == "default" or (name == "regenerate" and "regenerate_chunk" in rules))
                if (wanted or key in COUNTS.get(name, ())) and key not in INERT.get(name, ()):
                    change = changed_value(key, leaves[key], dotted_get(current, key))
                    if rules:
                        check(name, variant, change, oracle)
                    else:
                        operational.update(change)
            for key in INERT.get(name, ()):
                # the key alone (EXAMPLES' companions, such as a float16 reference, decide rules of their own)
                change = changed_value(key, leaves[key], dotted_get(current, key))
                check(name, variant, {key: change[key]}, oracle, inert=True)
            before = len(wrong)
            check(name, variant, operational, oracle)
            if len(wrong) > before:  # which of them
                for key, value in operational.items():
                    check(name, variant, {key: value}, oracle)

        # a chat template given as a file is an input: an edit of the file reruns prepare, as a changed key does
        template, config = wd / "config/template.jinja", {"chat_template": "config/template.jinja"}
        template.write_text(EXAMPLES["chat_template"]["chat_template"])
        plans.ask({"touch": config})
        assert plans.plan(config) == {}
        template.write_text(template.read_text() + "{# edited #}\n")
        summary = (run_dir(wd) / "prompts/summary.json").stat().st_mtime_ns
        os.utime(template, ns=(summary + 10**9, summary + 10**9))  # after the run, whatever the clock's resolution
        assert plans.plan(config) == plans.plan(config, ("prepare",)) != {}
    finally:
        plans.close()
    assert not wrong, "\n".join(wrong)
    assert set(reruns.RULES) <= seen_rules, set(reruns.RULES) - seen_rules


def test_files_changed_in_place_rerun_the_rules_that_read_them(tmp_path: Path, full_run: Path) -> None:
    """No config key changes, a file a key names does (hsextract.config.file_params): after a run recorded as made
    (snakemake --touch), a real model (make_tiny_model: false, a copy of the tiny model) whose chat_template.jinja or
    tokenizer file is rewritten plans prepare, whose weights are rewritten plans extract; a separate `tokenizer:`
    directory edited plans prepare; a source, or the chat_template file, replaced by other content with an older
    mtime (cp -p, rsync -a) plans prepare (and the tiny model, whose tokenizer is trained on the source). Each
    plan is what forcing that rule plans; nothing changed plans nothing, at every invocation."""
    wd = tmp_path / "inplace"
    shutil.copytree(full_run, wd, symlinks=True)
    plans = Plans(wd, tmp_path / "plans.log")
    try:
        tiny_reference(wd)
        real = wd / "models/real"
        shutil.copytree(wd / "resources/tiny-model", real)  # copy2: the files keep their mtimes
        config: dict[str, Any] = {"make_tiny_model": False, "model": "models/real",
                                  "reference_sample": "resources/reference/tiny.pt"}

        def later(path: Path, seconds: int = 1) -> None:
            """`path`'s mtime moved by `seconds` (whatever the clock's resolution)."""
            st = path.stat()
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))

        def accepted(config: dict[str, Any]) -> None:
            plans.ask({"touch": config})
            assert plans.plan(config) == {}

        def plans_rule(config: dict[str, Any], rule: str, what: str, then_accept: bool = True) -> None:
            got = plans.plan(config)
            assert got.get(rule) and got == plans.plan(config, (rule,)), (what, got)
            if then_accept:
                accepted(config)

        accepted(config)
        assert plans.plan(config) == {}  # again: the params are the same at every invocation
        # (a) the template the model ships, (b) a tokenizer file: by content
        template = real / "chat_template.jinja"
        template.write_text(template.read_text() + "{# edited #}\n")
        plans_rule(config, "prepare", "chat_template.jinja")
        cfg = real / "tokenizer_config.json"
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "hsx_edited": True}, indent=2))
        plans_rule(config, "prepare", "tokenizer_config.json")
        # touched, not changed: prepare's content hash holds it, and extract leaves the tokenizer's files to it
        later(real / "tiktoken.model")
        assert plans.plan(config) == {}
        # (c) the weights rewritten in place, the same size: by mtime
        weights = real / "model.safetensors"
        weights.write_bytes(weights.read_bytes())
        later(weights)
        got = plans.plan(config)
        assert "prepare" not in got
        plans_rule(config, "extract", "model.safetensors")
        # a tokenizer of its own
        shutil.copytree(real, wd / "models/tok")
        with_tokenizer = {**config, "tokenizer": "models/tok"}
        accepted(with_tokenizer)
        (wd / "models/tok/chat_template.jinja").write_text(template.read_text() + "{# again #}\n")
        plans_rule(with_tokenizer, "prepare", "tokenizer's chat_template.jinja", then_accept=False)

        def older(path: Path, text: str) -> None:
            """`path` replaced by `text` in a file dated before it (cp -p of an older file)."""
            before = path.stat().st_mtime_ns
            other = path.with_name(path.name + ".new")
            other.write_text(text)
            os.utime(other, ns=(before - 10**10, before - 10**10))
            other.replace(path)

        # a source replaced by an older file: the real model's run, then the tiny model's (trained on the source)
        source = wd / "data/conversations.jsonl"
        lines = source.read_text().splitlines(keepends=True)
        older(source, "".join(reversed(lines)))
        plans_rule(config, "prepare", "an older source")
        accepted({})
        older(source, "".join(lines))
        plans_rule({}, "make_tiny_model", "an older source of the tiny model")
        # a chat_template file replaced by an older one
        (wd / "config/t.jinja").write_text(EXAMPLES["chat_template"]["chat_template"])
        with_template = {**config, "chat_template": "config/t.jinja"}
        accepted(with_template)
        older(wd / "config/t.jinja", EXAMPLES["chat_template"]["chat_template"].replace(": ", " - "))
        plans_rule(with_template, "prepare", "an older chat_template file", then_accept=False)
    finally:
        plans.close()


def test_a_release_that_changes_the_tiny_model_rebuilds_it(tmp_path: Path, full_run: Path) -> None:
    """The tiny model's architecture (hsextract.tinymodel.build.TINY_CONFIG) and its weights' recipe (WEIGHTS_RECIPE)
    are make_tiny_model's param: after a finished run, the same config under a release with other head widths, or
    another recipe (here: a sitecustomize that changes them in the Snakemake process), plans the model and
    everything after it; the same release plans nothing."""
    wd = tmp_path / "release"
    shutil.copytree(full_run, wd, symlinks=True)
    assert "Nothing to be done" in smk(wd, "-n").stdout
    shim = tmp_path / "shim"
    shim.mkdir()
    for change in ("TINY_CONFIG['v_head_dim'] = 64", "WEIGHTS_RECIPE += 1"):
        (shim / "sitecustomize.py").write_text(f"import hsextract.tinymodel.build as b\nb.{change}\n")
        counts = job_counts(smk(wd, "-n", env={"PYTHONPATH": str(shim)}).stdout)
        assert counts == {"make_tiny_model": 1, "prepare": 1, "extract": N_CHUNKS, "validate": N_CHUNKS,
                          "stats": N_CHUNKS, "aggregate_stats": 1, "seq_length_hist": 1, "manifest": 1,
                          "all": 1}, (change, counts)


def test_another_runs_tiny_model_is_not_rebuilt_under_it(tmp_path: Path, full_run: Path) -> None:
    """Another run's dataset.json names this run's tiny model folder, and a new seed would rebuild that model: the
    dry run stops as the Snakefile is read, with the config error naming the other run, and plans nothing (raised
    from make_tiny_model's input function, Snakemake took the refusal for "no job makes the model" and planned
    prepare without the extract jobs). --unlock is no command that plans jobs; the model's own seed plans nothing."""
    wd = tmp_path / "shared-model"
    shutil.copytree(full_run, wd, symlinks=True)
    (wd / "results/other").mkdir()
    (wd / "results/other/dataset.json").write_text(json.dumps({"model": "resources/tiny-model"}))
    proc = smk(wd, "-n", "--config", "seed=1", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Job stats" not in out, out[-3000:]
    assert ("make_tiny_model: resources/tiny-model holds a model built with seed 0, which run(s) other name "
            f"(results/<run>/dataset.json), and run '{RUN}' would rebuild it with seed 1: those runs would then rerun "
            "whole at their next command.") in " ".join(out.split())
    for flag in ("--touch", "--delete-all-output"):  # they mark or remove the model: refused too
        assert smk(wd, flag, "--config", "seed=1", check=False).returncode != 0, flag
    # deleting every output of this run deletes the model the other run names, whatever its settings (audit)
    proc = smk(wd, "--delete-all-output", check=False)
    assert proc.returncode != 0
    assert ("snakemake --delete-all-output: would delete resources/tiny-model, which run(s) other also name "
            "(results/<run>/dataset.json): those runs would then rerun whole at their next command. Delete this run's "
            f"outputs alone (`rm -r results/{RUN}`), or the other runs' results first") in " ".join(proc.stderr.split())
    assert (wd / "resources/tiny-model/config.json").is_file() and shard_path(wd, 0).is_file()
    assert smk(wd, "--unlock", "--config", "seed=1").returncode == 0
    assert "Nothing to be done" in smk(wd, "-n").stdout


def _schema_leaves(props: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> its schema, for every key that is not an object with fixed properties."""
    out: dict[str, Any] = {}
    for key, sub in props.items():
        if sub.get("type") == "object" and "properties" in sub:
            out.update(_schema_leaves(sub["properties"], f"{prefix}{key}."))
        else:
            out[prefix + key] = sub
    return out


def test_dataset_json_records_the_effective_values(full_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key that decides the data, as the run used it (defaults filled, the capture preset resolved), and
    prepare's whole settings section (in its summary); a changed key reruns the manifest (the test above), and
    keys that decide only outputs beside it (a histogram's bins, the export formats) are left out."""
    import yaml
    from snakemake.utils import update_config

    from hsextract.config import reruns
    from hsextract.config.settings import SCHEMA_TO_TREE, from_config

    manifest = json.loads((run_dir(full_run) / "dataset.json").read_text())
    config = yaml.safe_load((full_run / "config/config.yaml").read_text())
    update_config(config, yaml.safe_load((full_run / "config/test.yaml").read_text()))
    monkeypatch.chdir(full_run)  # the preset resolves against the run's model
    settings = from_config(config)
    recorded = manifest["provenance"]["config"]
    beside = reruns.beside_manifest()
    assert set(beside) == {"export_formats", "stats.seq_len_bins"}  # no rerun of the manifest: not recorded
    assert "export_formats" not in recorded and "seq_len_bins" not in recorded["stats"]
    for key, rules in reruns.KEYS.items():
        if rules and key in SCHEMA_TO_TREE and key not in beside:  # a key the tree lacks: as the Snakefile resolved it
            assert reruns.plain(dotted_get(recorded, key)) == reruns.value(settings, key), key
    assert recorded["aux_layers"] == manifest["aux_layers"] == list(settings.extract.aux_layers)
    prepared = manifest["provenance"]["prepare"]["settings"]
    assert prepared == {k: v for k, v in reruns.plain(settings.prepare).items() if k != "chat_template"}
    assert prepared["chat_template_kwargs"] == {} and prepared["trust_remote_code"] is True
