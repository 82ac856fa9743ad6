"""The production command of README.md, run as written (dry run) against a Kimi-K2.5-shaped config directory
(tests/fixtures/kimi-k25-config: config.json and tokenizer_config.json, no weights), and the refusal of its
custom-code tokenizer with trust_remote_code: false before any job; README's run command as a dry run on one
GPU with the miniature Kimi-K2.5 checkpoint (`tinymodel --packaging kimi-k25`) as `model`, as the GPU check of
issue 34 runs it. Slow (runs Snakemake)."""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_workflow import ROOT, job_counts, make_workdir, snakemake_cmd

from hsextract.config.files import configfile_groups, earlier_configfiles

PER_CHUNK = 2048  # config/kimi.yaml
Proc = subprocess.CompletedProcess[str]


def readme_command(prefix: str) -> list[str]:
    """The first command line of README.md that starts with `prefix` (comments dropped)."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.strip().startswith(prefix):
            return shlex.split(line.split("#")[0])
    raise AssertionError(f"README.md has no line starting with {prefix!r}")


def kimi_workdir(tmp_path: Path) -> Path:
    wd = make_workdir(tmp_path / "prod")
    shutil.copytree(ROOT / "tests/fixtures/kimi-k25-config", wd / "kimi-config")
    (wd / "my-sources.yaml").write_text(
        "model: kimi-config\nsources:\n  - {path: data/conversations.jsonl, format: auto}\n")
    return wd


def run(wd: Path, argv: list[str]) -> Proc:
    assert argv[0] == "snakemake"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([*snakemake_cmd(), *argv[1:]], cwd=wd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_configfile_groups() -> None:
    argv = ["snakemake", "-n", "--cores", "8", "--configfile", "config/kimi.yaml", "--configfile", "my.yaml"]
    assert configfile_groups(argv) == [["config/kimi.yaml"], ["my.yaml"]]
    assert earlier_configfiles(argv, [Path("my.yaml").absolute()]) == [Path("config/kimi.yaml").absolute()]
    # one flag with both files: nothing dropped
    assert earlier_configfiles(["snakemake", "--configfiles", "a.yaml", "b.yaml", "-n"], ["a.yaml", "b.yaml"]) == []
    assert configfile_groups(["x", "--configfile=a.yaml", "b.yaml", "--configfile", "c.yaml"]) == [
        ["a.yaml", "b.yaml"], ["c.yaml"]]
    # argv that is not what Snakemake parsed (API use): leave the config alone
    assert earlier_configfiles(argv, [Path("other.yaml").absolute()]) == []


README_PRODUCTION = "snakemake -n --cores 8 --resources gpu=8 --configfile config/kimi.yaml"


def run_readme_production(tmp_path: Path) -> tuple[Path, Proc, Proc]:
    """README's production dry run as written, and its one-flag spelling."""
    wd = kimi_workdir(tmp_path)
    return (wd, run(wd, readme_command(README_PRODUCTION)),
            run(wd, ["snakemake", "-n", "--cores", "8", "--resources", "gpu=8", "--configfile", "config/kimi.yaml",
                     "my-sources.yaml"]))


@pytest.mark.slow
def test_readme_production_dry_run_plans_every_job(
    scenario: tuple[Path, Proc, Proc],
) -> None:
    argv = readme_command(README_PRODUCTION)
    assert argv == ["snakemake", "-n", "--cores", "8", "--resources", "gpu=8", "--configfile", "config/kimi.yaml",
                    "--configfile", "my-sources.yaml"]
    wd, proc, one = scenario
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    n = math.ceil(sum(1 for _ in open(wd / "data/conversations.jsonl")) / PER_CHUNK)
    assert job_counts(out) == {"build_patched_server": 1, "prepare": 1, "extract": n, "validate": n, "stats": n,
                               "aggregate_stats": 1, "seq_length_hist": 1, "manifest": 1, "export": 1, "all": 1}
    # config/kimi.yaml applied (run name, export) under my-sources.yaml (the model directory)
    assert "results/kimi-k25/export/speculators-v1" in out and "results/tiny-default" not in out
    assert "make_tiny_model" not in out
    # the one-flag spelling plans the same jobs
    assert one.returncode == 0 and job_counts(one.stdout) == job_counts(out)
    assert not (wd / "results").exists()


def run_without_pool(tmp_path: Path) -> tuple[Path, Proc]:
    """README's production dry run without its --resources gpu=8: profiles/default's pool is gpu=1."""
    wd = kimi_workdir(tmp_path)
    argv = [w for w in readme_command(README_PRODUCTION) if w not in ("--resources", "gpu=8")]
    return wd, run(wd, argv)


@pytest.mark.slow
def test_a_pool_smaller_than_one_extract_job_refuses_before_any_job(scenario: tuple[Path, Proc]) -> None:
    """A TP-8 extract job under the pool gpu=1 would run (and be planned) as gpu=1: refused, naming the flag."""
    wd, proc = scenario
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert ("extract jobs need 8 GPUs each (engine sglang: a local server of sglang.tp 8), but the "
            "run's GPU pool is gpu=1") in out
    assert "Pass --resources gpu=8 on a machine with 8 GPUs" in out
    assert "rule extract:" not in out and not (wd / "results").exists()


README_RUN = "snakemake --cores 8 --resources"
# what a sources file adds for the miniature: its depth takes the eagle3 preset (config/kimi.yaml lists Kimi's
# [2, 30, 58] of 61 layers), a sample of its width (the shipped reference is Kimi's 7168), one GPU (tp 1)
MINIATURE_SOURCES = """\
model: kimi-k25-mini
sources:
  - {path: data/conversations.jsonl, format: auto}
aux_layers: null
reference_sample: reference-256.pt
sglang: {tp: 1}
"""


def run_readme_run_on_the_miniature(tmp_path: Path) -> tuple[Path, Proc, Proc]:
    """README's production run command with -n, --resources gpu=1, the miniature K2.5 checkpoint in the sources;
    and the same without `aux_layers: null` (config/kimi.yaml's Kimi ids)."""
    from hsextract.tinymodel.build import make_tiny_model

    wd = make_workdir(tmp_path / "mini")
    make_tiny_model(wd / "kimi-k25-mini", wd / "data/conversations.jsonl", tokenizer="kimi", packaging="kimi-k25")
    torch.save({"input_ids": torch.arange(5), "hidden_states": [torch.ones(5, 256, dtype=torch.bfloat16)] * 4,
                "loss_mask": torch.ones(5, dtype=torch.int64)}, wd / "reference-256.pt")
    (wd / "my-sources.yaml").write_text(MINIATURE_SOURCES)
    argv = readme_command(README_RUN)
    argv = [argv[0], "-n", *argv[1:]]
    argv[argv.index("--resources") + 1] = "gpu=1"
    planned = run(wd, argv)
    (wd / "my-sources.yaml").write_text(MINIATURE_SOURCES.replace("aux_layers: null\n", ""))
    return wd, planned, run(wd, argv)


@pytest.mark.slow
def test_readme_run_command_plans_every_job_on_the_miniature_kimi_k25(scenario: tuple[Path, Proc, Proc]) -> None:
    wd, proc, kimi_ids = scenario
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    n = math.ceil(sum(1 for _ in open(wd / "data/conversations.jsonl")) / PER_CHUNK)
    assert job_counts(out) == {"build_patched_server": 1, "prepare": 1, "extract": n, "validate": n, "stats": n,
                               "aggregate_stats": 1, "seq_length_hist": 1, "manifest": 1, "export": 1, "all": 1}
    assert "results/kimi-k25/export/speculators-v1" in out and "make_tiny_model" not in out
    extract = out.split("rule extract:")[1].split("\n\n")[0]
    assert "gpu=1" in extract.replace(" ", "")  # tp 1 x 1 replica, within the pool
    # the depth is the wrapper's text_config's: the eagle3 preset of its 10 layers, not Kimi's ids of 61
    assert kimi_ids.returncode != 0
    assert "hidden_states[2, 5, 7]" in kimi_ids.stdout + kimi_ids.stderr
    assert "10 decoder layers" in kimi_ids.stdout + kimi_ids.stderr
    assert not (wd / "results").exists()


def run_untrusted(tmp_path: Path) -> tuple[Path, Proc]:
    wd = kimi_workdir(tmp_path)
    (wd / "untrusted.yaml").write_text("trust_remote_code: false\n")
    argv = ["snakemake", "--cores", "8", "--configfile", "config/kimi.yaml", "my-sources.yaml", "untrusted.yaml"]
    return wd, run(wd, argv)


@pytest.mark.slow
def test_untrusted_custom_tokenizer_stops_before_any_job(scenario: tuple[Path, Proc]) -> None:
    wd, proc = scenario
    assert proc.returncode != 0
    msg = (
        "trust_remote_code: the tokenizer of kimi-config is custom code (kimi-config/tokenizer_config.json auto_map "
        "AutoTokenizer -> tokenization_kimi.TikTokenTokenizer), which transformers runs only with "
        "trust_remote_code: true. Read the tokenizer module it names; if you trust it, set "
        "`trust_remote_code: true` in the config (config/kimi.yaml does), or pass --trust-remote-code to "
        "`hsextract masks`.")
    assert msg in proc.stdout + proc.stderr
    assert not (wd / "results").exists() and not (wd / "logs").exists()


def run_misspelt(tmp_path: Path) -> Proc:
    wd = kimi_workdir(tmp_path)
    (wd / "typo.yaml").write_text("prompts_per_chunck: 512\nsglang:\n  tpp: 8\n")
    return run(wd, ["snakemake", "-n", "--configfile", "config/kimi.yaml", "my-sources.yaml", "typo.yaml"])


def test_a_misspelt_key_is_one_line_with_the_closest_key(scenario: Proc) -> None:
    proc = scenario
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert ("prompts_per_chunck: unknown key; did you mean `prompts_per_chunk`? "
            "(workflow/schemas/config.schema.yaml)") in out
    assert len(out.splitlines()) <= 8, out  # not the whole schema and config (Snakemake's validate)


def run_old_list(tmp_path: Path) -> Proc:
    wd = kimi_workdir(tmp_path)
    (wd / "old-layers.yaml").write_text("capture: custom\naux_layers: [1, 29, 57]\n")  # written before conventions
    return run(wd, ["snakemake", "-n", "--configfile", "config/kimi.yaml", "--configfile", "my-sources.yaml",
                    "old-layers.yaml"])


def test_a_list_layered_on_kimi_yaml_does_not_inherit_its_convention(scenario: Proc) -> None:
    """config/kimi.yaml says hidden_states for its own list; a later file's list must say its own."""
    out = scenario.stdout + scenario.stderr
    assert scenario.returncode != 0
    assert "aux_layers: [1, 29, 57] in /" in out  # the file's absolute path
    assert "/old-layers.yaml does not say which layers it means; add " in out
    assert "/old-layers.yaml itself: a convention set by another file is not taken for this file's list" in out


def test_model_shape_of_a_local_kimi_dir_and_of_a_hub_id(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    from hsextract.config.model_info import read_model_shape

    fixture = ROOT / "tests/fixtures/kimi-k25-config"
    local = read_model_shape(str(fixture))
    assert (local.num_layers, local.hidden_size, local.vocab_size) == (61, 7168, 163840)
    # a hub id: only config.json is fetched and read as JSON (Kimi-K2.5's config class is custom code, which
    # transformers' AutoConfig would refuse without trust_remote_code)
    fetched: list[tuple[str, str]] = []

    def fake_download(repo_id: str, filename: str, **kwargs: object) -> str:
        fetched.append((repo_id, filename))
        return str(fixture / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    hub = read_model_shape("moonshotai/Kimi-K2.5")
    assert fetched == [("moonshotai/Kimi-K2.5", "config.json")]
    assert (hub.num_layers, hub.hidden_size, hub.vocab_size, hub.source) == (
        61, 7168, 163840, "hub config of moonshotai/Kimi-K2.5")


# the Snakemake runs above, all started in the background by the first test that needs one: see
# scenarios_started in conftest.py
SCENARIOS = {
    "test_readme_production_dry_run_plans_every_job": run_readme_production,
    "test_readme_run_command_plans_every_job_on_the_miniature_kimi_k25": run_readme_run_on_the_miniature,
    "test_a_pool_smaller_than_one_extract_job_refuses_before_any_job": run_without_pool,
    "test_untrusted_custom_tokenizer_stops_before_any_job": run_untrusted,
    "test_a_misspelt_key_is_one_line_with_the_closest_key": run_misspelt,
    "test_a_list_layered_on_kimi_yaml_does_not_inherit_its_convention": run_old_list,
}
