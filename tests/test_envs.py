"""The install pins: requirements/cpu.lock (what `make run` / `make test` install) and the conda
environments of the rules (envs/*.yaml). Static checks, no network: every env pin is the lock's version,
every rule's env provides the third-party modules its script imports (directly or through hsextract),
and the Makefile installs the lock exactly (--no-deps, torch from the CPU index)."""

from __future__ import annotations

import ast
import functools
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements/cpu.lock"
# Imported only inside the SGLang server's own Python (envs/sglang.yaml), never by a workflow env.
SERVER_ONLY = {"sglang"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[norm(name)] = version
    return pins


def env_pins(env: Path) -> dict[str, str]:
    deps = yaml.safe_load(env.read_text())["dependencies"]
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    pins = {}
    for item in pip:
        if item.startswith("-"):
            continue
        name, version = item.split("==")
        pins[norm(name)] = version
    return pins


def rules() -> dict[str, tuple[str, str]]:
    """rule -> (env file, script file) from workflow/rules/*.smk."""
    out = {}
    for smk in (ROOT / "workflow/rules").glob("*.smk"):
        for block in re.split(r"^\s*rule ", smk.read_text(), flags=re.M)[1:]:
            name = block.split(":", 1)[0]
            conda = re.search(r'conda:\s*"\.\./\.\./(envs/[\w.]+)"', block)
            script = re.search(r'script:\s*"\.\./(scripts/[\w.]+)"', block)
            if conda and script:
                out[name] = (conda[1], "workflow/" + script[1])
    return out


def _imports(path: Path, module_level: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    if module_level:  # what runs on import: top level, and inside top-level if/try
        nodes, todo = [], list(tree.body)
        while todo:
            n = todo.pop()
            nodes.append(n)
            if isinstance(n, ast.If | ast.Try):
                handlers = [s for h in getattr(n, "handlers", []) for s in h.body]
                todo += n.body + n.orelse + getattr(n, "finalbody", []) + handlers
    else:
        nodes = list(ast.walk(tree))
    names = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            names |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            names |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    return names


def _module_file(name: str) -> Path | None:
    p = ROOT / "src" / Path(*name.split("."))
    for f in (p / "__init__.py", p.with_suffix(".py")):
        if f.is_file():
            return f
    return None


def third_party_imports(script: Path) -> set[str]:
    """Top-level third-party modules a rule script can import: all of the script's imports, and the
    imports of every hsextract module reachable from it (lazy ones included: a rule may call them)."""
    seen: set[str] = set()
    found: set[str] = set()
    todo = list(_imports(script, module_level=False))
    while todo:
        name = todo.pop()
        top = name.split(".")[0]
        if top != "hsextract":
            if top not in sys.stdlib_module_names:
                found.add(top)
            continue
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            f = _module_file(mod)
            if f is not None and mod not in seen:
                seen.add(mod)
                todo += _imports(f, module_level=False)
    return found - SERVER_ONLY


@functools.cache
def _module_dists() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def distribution(module: str) -> str:
    dists = _module_dists().get(module)
    assert dists, f"no installed distribution provides module {module!r}"
    return norm(dists[0])


def test_lock_pins_every_package_once_with_the_cpu_torch() -> None:
    pins = lock_pins()
    assert pins["torch"].endswith("+cpu")
    assert not [n for n in pins if n.startswith("nvidia-")], "the lock holds CUDA packages"
    names = [norm(line.split("==")[0]) for line in LOCK.read_text().splitlines() if line and line[0] != "#"]
    assert len(names) == len(set(names))
    assert "hsextract" not in pins


@pytest.mark.parametrize("env", sorted(p.name for p in (ROOT / "envs").glob("*.yaml") if p.name != "sglang.yaml"))
def test_env_pins_are_the_locks_versions(env: str) -> None:
    lock = lock_pins()
    for name, version in env_pins(ROOT / "envs" / env).items():
        assert name in lock, f"envs/{env}: {name} is not in requirements/cpu.lock"
        want = lock[name].split("+")[0]  # the env's torch build comes from its index (CPU or CUDA)
        assert version == want, f"envs/{env}: {name}=={version}, the lock has {lock[name]}"


def test_every_rule_env_provides_what_its_script_imports() -> None:
    table = rules()
    assert {"prepare", "extract", "validate", "stats", "aggregate_stats", "seq_length_hist", "manifest",
            "export", "make_tiny_model", "build_patched_server"} <= set(table)
    checked = 0
    for rule, (env, script) in table.items():
        if env == "envs/sglang.yaml":
            continue
        provided = set(env_pins(ROOT / env))
        needed = {distribution(m) for m in third_party_imports(ROOT / script)}
        assert needed <= provided, f"rule {rule} ({script}) imports {sorted(needed - provided)}, not in {env}"
        checked += 1
    assert checked >= 10


def test_env_sets_differ_and_the_model_env_holds_the_model_libraries() -> None:
    envs = {p.name: env_pins(p) for p in (ROOT / "envs").glob("*.yaml") if p.name != "sglang.yaml"}
    assert sorted(envs) == ["data.yaml", "model.yaml"]
    assert set(envs["model.yaml"]) != set(envs["data.yaml"])
    assert {"transformers", "tokenizers"} <= set(envs["model.yaml"]) and "transformers" not in envs["data.yaml"]
    assert "matplotlib" in envs["data.yaml"]


def test_makefile_installs_the_lock_exactly() -> None:
    make = (ROOT / "Makefile").read_text()
    install = make[make.index("$(BIN)/.installed:"):make.index("\nrun:")]
    assert "requirements/cpu.lock" in install.splitlines()[0]
    assert "$(BIN)/pip install -q --no-deps -r requirements/cpu.lock" in install
    assert '$(BIN)/pip install -q --no-deps --extra-index-url $(TORCH_INDEX) "$(TORCH)"' in install
    assert "TORCH_INDEX ?= https://download.pytorch.org/whl/cpu" in make
    assert "$(BIN)/pip check" in install
    # the envs name the same CPU index
    for env in ("model.yaml", "data.yaml"):
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in (ROOT / "envs" / env).read_text()
    assert re.search(r"^lock:", make, re.M) and "pip freeze" in make
