"""The plugin's hook targets, attributes and keyword arguments checked against real SGLang wheels.

Wheels come from `pip download --no-deps` into a cache ($HSEXTRACT_SGLANG_WHEELS, else
~/.cache/hsextract/sglang-wheels); a version that cannot be downloaded is skipped with the reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hsextract.sglang import compat as sc

VERSIONS = ("0.5.16", "0.5.23")


def _cache_dir() -> Path:
    d = os.environ.get("HSEXTRACT_SGLANG_WHEELS")
    return Path(d) if d else Path.home() / ".cache" / "hsextract" / "sglang-wheels"


def _wheel(version: str) -> Path:
    for d in (_cache_dir(), Path("/work/.cache/sglang-wheels")):
        hits = sorted(d.glob(f"sglang-{version}-*.whl")) if d.is_dir() else []
        if hits:
            return hits[0]
    d = _cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64", "--platform", "any",
           "-d", str(d), f"sglang=={version}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot download sglang=={version} wheel: {e}")
    hits = sorted(d.glob(f"sglang-{version}-*.whl"))
    if r.returncode != 0 or not hits:
        pytest.skip(f"cannot download sglang=={version} wheel (pip exit {r.returncode}): {r.stderr.strip()[-300:]}")
    return hits[0]


@pytest.fixture(scope="module", params=VERSIONS)
def wheel(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, _wheel(request.param)


def test_wheel_passes_every_check(wheel: tuple[str, Path]) -> None:
    version, path = wheel
    rep = sc.check_wheel(path)
    assert rep.version == version and rep.in_range
    assert rep.checked == len(sc.REQUIREMENTS)
    assert [p for p in rep.problems if p.needed_for != "builtin"] == []
    assert rep.models == ["llama", "deepseek"]
    assert rep.prefix_modes == ["flat", "shared"]
    assert rep.ok
    if version == "0.5.16":  # no --enable-return-aux-hidden-states yet: the plugin sets capture up itself
        assert rep.capture_sources == ["plugin"]
        assert sorted(str(p) for p in rep.problems) == [
            "sglang/srt/layers/logits_processor.py:154: class LogitsProcessorOutput has no member "
            "'last_hidden_states' (post-norm final state) [builtin]",
            "sglang/srt/layers/logits_processor.py:336: class LogitsProcessor has no member "
            "'_get_last_hidden_states_to_store' (the pre-norm final state instead of the post-norm one) [builtin]",
            "sglang/srt/server_args.py:0: server argument enable_return_aux_hidden_states not found "
            "(SGLang's own aux capture) [builtin]",
            "sglang/srt/server_args.py:0: server argument return_aux_hidden_state_layer_ids not found "
            "(SGLang's own aux capture) [builtin]",
        ]
    else:
        assert rep.capture_sources == ["builtin", "plugin"] and rep.problems == []


def _extract_needed(whl: Path, dest: Path) -> None:
    """Only the files the checker reads, plus METADATA: a small tree we can edit."""
    with zipfile.ZipFile(whl) as zf:
        names = set(zf.namelist())
        want = {n for n in names if n.endswith(".dist-info/METADATA") or n.startswith("sglang/srt/arg_groups/fields/")}
        for req in sc.REQUIREMENTS:
            if req.module:
                base = req.module.replace(".", "/")
                want |= {f"{base}.py", f"{base}/__init__.py"} & names
        want |= {"sglang/srt/server_args.py"} & names
        for n in want:
            zf.extract(n, dest)


def test_missing_kwarg_is_reported_with_file_and_line(tmp_path: Path) -> None:
    whl = _wheel("0.5.16")
    _extract_needed(whl, tmp_path)
    assert sc.check_directory(tmp_path).ok
    tp = tmp_path / "sglang/srt/managers/tp_worker.py"
    src = tp.read_text()
    line = next(i for i, s in enumerate(src.splitlines(), 1) if "def forward_batch_generation(" in s and
                "forward_batch: ForwardBatch" not in s and i > 200)
    tp.write_text(src.replace("capture_hidden_mode: Optional[CaptureHiddenMode] = None,", "capture_mode=None,", 1))
    rep = sc.check_directory(tmp_path)
    assert not rep.ok and rep.capture_sources == []
    assert [str(p) for p in rep.problems if p.needed_for == "plugin"] == [
        f"sglang/srt/managers/tp_worker.py:{line}: TpModelWorker.forward_batch_generation has no keyword "
        "argument 'capture_hidden_mode' (forcing CaptureHiddenMode.FULL on EXTEND batches) [plugin]"
    ]
    assert line == 529


def test_missing_hook_target_and_renamed_member(tmp_path: Path) -> None:
    _extract_needed(_wheel("0.5.23"), tmp_path)
    mr = tmp_path / "sglang/srt/model_executor/model_runner.py"
    mr.write_text(mr.read_text().replace("def init_attention_backends(self)", "def init_attn_backends(self)"))
    sb = tmp_path / "sglang/srt/managers/schedule_batch.py"
    sb.write_text(re.sub(r"\bextend_lens\b", "extend_lengths", sb.read_text()))  # an upstream rename
    rep = sc.check_directory(tmp_path)
    texts = [str(p) for p in rep.problems]
    cls_line = next(i for i, s in enumerate(mr.read_text().splitlines(), 1)
                    if re.match(r"class ModelRunner\b[:(]", s))
    assert (f"sglang/srt/model_executor/model_runner.py:{cls_line}: class ModelRunner has no member "
            "'init_attention_backends' (capture-layer check before CUDA graph capture) [all]") in texts
    assert any(t.startswith("sglang/srt/managers/schedule_batch.py:") and "no member 'extend_lens'" in t
               for t in texts)
    assert not rep.ok


def test_the_shared_prefix_requirements_are_their_own_mode(tmp_path: Path) -> None:
    """share_prefixes needs /generate's extra_key carried to the radix key; without it the release still serves
    flat runs (and without --disable-radix-cache it serves shared runs only)."""
    _extract_needed(_wheel("0.5.16"), tmp_path)
    io = tmp_path / "sglang/srt/managers/io_struct.py"
    src = io.read_text()
    line = next(i for i, s in enumerate(src.splitlines(), 1) if s.startswith("class GenerateReqInput"))
    io.write_text(re.sub(r"\bextra_key\b", "cache_tag", src))  # an upstream rename
    rep = sc.check_directory(tmp_path)
    assert [str(p) for p in rep.problems if p.needed_for == "shared"] == [
        f"sglang/srt/managers/io_struct.py:{line}: class GenerateReqInput has no member 'extra_key' (each request's "
        "prefix-cache namespace) [shared]"]
    assert rep.prefix_modes == ["flat"] and rep.ok and rep.summary()["prefix_modes"] == ["flat"]
    args = tmp_path / "sglang/srt/server_args.py"
    args.write_text(re.sub(r"\bdisable_radix_cache\b", "no_radix", args.read_text()))
    assert sc.check_directory(tmp_path).prefix_modes == []


def test_unparsable_file_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    _extract_needed(_wheel("0.5.23"), tmp_path)
    (tmp_path / "sglang/srt/managers/utils.py").write_text("def broken(:\n")
    rep = sc.check_directory(tmp_path)
    assert "sglang/srt/managers/utils.py:1: cannot parse: invalid syntax" in [
        str(p).split(" (")[0] for p in rep.problems]
    assert not rep.ok


def test_version_outside_range_fails(tmp_path: Path) -> None:
    _extract_needed(_wheel("0.5.23"), tmp_path)
    meta = next(tmp_path.glob("sglang-*.dist-info/METADATA"))
    meta.write_text(meta.read_text().replace("Version: 0.5.23", "Version: 0.6.0"))
    rep = sc.check_directory(tmp_path)
    assert rep.version == "0.6.0" and not rep.in_range and not rep.ok
    assert "SGLang 0.6.0 is outside the supported range 0.5.16-0.5.23" in str(rep.problems[-1])


def test_check_installed_without_sglang_names_the_interpreter() -> None:
    rep = sc.check_installed(sys.executable)
    if rep.version is not None:
        pytest.skip("sglang is installed in this environment")
    assert not rep.ok
    assert f"no sglang package importable by {sys.executable}" in str(rep.problems[0])


def test_report_says_which_releases_ran_and_which_were_checked_statically_only(tmp_path: Path) -> None:
    """The defaults (config/kimi.yaml, envs/sglang.yaml) are what ran; every other checked release is static."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    assert set(sc.RAN_ON_GPU) <= set(sc.RELEASES_CHECKED) == set(VERSIONS)
    ran = sc.CompatReport(source="x", version="0.5.16").summary()
    assert ran["ran_on_gpu"] is True and ran["tested"] == sc.RAN_ON_GPU["0.5.16"]
    static = sc.CompatReport(source="x", version="0.5.23", checked=12).summary()
    assert static["ran_on_gpu"] is False and "statically only" in static["tested"]
    # no source found, nothing checked: the report says so instead of claiming a static check
    none = sc.CompatReport(source="x", version="0.5.23").summary()
    assert none["tested"] == "not checked: no SGLang source was found to check"
    assert static["releases"]["checked_statically_only"] == ["0.5.23"]
    env = yaml.safe_load((root / "envs/sglang.yaml").read_text())
    pins = dict(p.split("==") for d in env["dependencies"] if isinstance(d, dict) for p in d["pip"] if "==" in p)
    assert pins["sglang"] in sc.RAN_ON_GPU
    kimi = yaml.safe_load((root / "config/kimi.yaml").read_text())
    assert kimi["sglang"]["capture"] == "plugin" and "capture: plugin" in sc.RAN_ON_GPU[pins["sglang"]]
