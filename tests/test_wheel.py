"""A built wheel carries the config schema (package data), and hsextract installed from it alone, away from any
checkout, builds its Settings with the schema's defaults."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow/schemas/config.schema.yaml"


def test_the_wheel_holds_the_schema_and_builds_settings_installed(tmp_path: Path) -> None:
    link = ROOT / "src/hsextract/resources/config.schema.yaml"
    assert link.is_symlink() and link.resolve() == SCHEMA.resolve()  # one file, no copy in the checkout
    tree = tmp_path / "tree"  # built from a copy: an in-tree build would leave build/ and egg-info in the checkout
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src/hsextract", tree / "src/hsextract", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(ROOT / "workflow/schemas", tree / "workflow/schemas")
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"),
                    str(tree)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("hsextract-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read("hsextract/resources/config.schema.yaml") == SCHEMA.read_bytes()
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True,
                   capture_output=True)
    code = ("import json, hsextract, hsextract.config.settings as st; s = st.from_config({}); "
            "print(json.dumps([hsextract.__file__, str(st.SCHEMA_PATH), s.extract.run_name, s.prepare.seed]))")
    # the installed copy first on the path (the venv's editable install comes after PYTHONPATH); run away from
    # the checkout, so nothing can reach workflow/
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, capture_output=True,
                         text=True).stdout
    where, schema_path, run_name, seed = json.loads(out)
    assert Path(where) == site / "hsextract/__init__.py"
    assert Path(schema_path) == site / "hsextract/resources/config.schema.yaml"
    assert not Path(schema_path).is_symlink()
    defaults = yaml.safe_load(SCHEMA.read_text())["properties"]
    assert (run_name, seed) == (defaults["run_name"]["default"], defaults["seed"]["default"]) == ("tiny-default", 0)
