"""Check an SGLang release against everything the hsextract plugin and client rely on, without importing it.

Reads the source (a wheel, or an installed package) with `ast` and verifies every hook target, attribute,
keyword argument and server flag the plugin uses; a missing one is reported with its file and line (the
line of the class or function where it was expected). Supported range: SGLang 0.5.16 to 0.5.23. Of the
releases whose wheels the tests check (RELEASES_CHECKED), RAN_ON_GPU ran on a GPU with the plugin; the others
are checked statically only: the report says which (`ran_on_gpu`, `releases`). One module for one job (a list
of checks, each a few lines, against one source tree), hence its length.

    python -m hsextract.sglang.compat --wheel sglang-0.5.23-*.whl
    python -m hsextract.sglang.compat --python /opt/sglang/bin/python     # the server's environment
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hsextract.atomic import write_bytes_atomic
from hsextract.sglang_plugin.plugin import (
    TARGET_FORWARD,
    TARGET_INIT_BACKENDS,
    TARGET_LAST_STORE,
    TARGET_LOAD_MODEL,
    TARGET_STORE,
)

SUPPORTED_MIN = (0, 5, 16)
SUPPORTED_MAX = (0, 5, 23)
# Releases whose wheels tests/test_sglang_compat.py checks against every requirement below.
RELEASES_CHECKED = ("0.5.16", "0.5.23")
# Of those, the ones that ran on a GPU with this project's plugin, and how (the defaults of config/kimi.yaml
# and envs/sglang.yaml follow this); every other release is checked statically only.
RAN_ON_GPU: dict[str, str] = {
    "0.5.16": "capture: plugin, on an H200 and an H100 (Python 3.12, torch 2.11.0+cu130, triton attention): "
              "bench/gpu/run_fidelity.sh, run_throughput.sh, run_eagle3_ids.sh, run_shared_prefix.sh and the "
              "production command, run_production.sh (bench/README.md)",
}

# needed_for: "all" (any use), "plugin" (capture set up by the plugin: 0.5.16), "builtin"
# (--enable-return-aux-hidden-states: 0.5.2x), "llama" / "deepseek" (that model family), "flat" / "shared"
# (share_prefixes off: the radix cache disabled; on: the radix cache namespaced by each request's extra_key).
@dataclass(frozen=True)
class Requirement:
    module: str  # dotted module
    qualname: str  # "Class.member", "function", or "" for module-level checks
    kind: str  # function | member | constant | string | server_arg
    why: str
    needed_for: str = "all"
    params: tuple[str, ...] = ()
    kwonly: tuple[str, ...] = ()
    value: str | None = None  # constant value / string literal


def _split(target: str) -> tuple[str, str]:
    parts = target.split(".")
    i = next(i for i, p in enumerate(parts) if p[:1].isupper())
    return ".".join(parts[:i]), ".".join(parts[i:])


_FWD_MOD, _FWD_QN = _split(TARGET_FORWARD)
_LOAD_MOD, _LOAD_QN = _split(TARGET_LOAD_MODEL)
_INIT_MOD, _INIT_QN = _split(TARGET_INIT_BACKENDS)
_STORE_MOD, _STORE_QN = _split(TARGET_STORE)
_LAST_MOD, _LAST_QN = _split(TARGET_LAST_STORE)
_SB = "sglang.srt.managers.schedule_batch"
_LP = "sglang.srt.layers.logits_processor"
_FBI = "sglang.srt.model_executor.forward_batch_info"

REQUIREMENTS: tuple[Requirement, ...] = (
    # plugin system
    Requirement("sglang.srt.plugins", "GENERAL_PLUGINS_GROUP", "constant", "entry-point group of the plugin",
                value="sglang.srt.plugins"),
    Requirement("sglang.srt.environ", "Envs.SGLANG_PLUGINS", "member", "SGLANG_PLUGINS whitelist"),
    Requirement("sglang.srt.plugins", "load_plugins", "function", "plugins run in every scheduler process"),
    Requirement("sglang.srt.plugins.hook_registry", "HookRegistry.register", "function", "hook registration",
                params=("target", "hook", "hook_type")),
    Requirement("sglang.srt.plugins.hook_registry", "HookType.AROUND", "member", "AROUND hooks"),
    Requirement("sglang.srt.plugins.hook_registry", "HookType.AFTER", "member", "AFTER hooks"),
    # hook targets
    Requirement(_FWD_MOD, _FWD_QN, "function", "the dump hook (outside CUDA graphs)", params=("batch", "is_verify")),
    Requirement(_FWD_MOD, _FWD_QN, "function", "forcing CaptureHiddenMode.FULL on EXTEND batches",
                needed_for="plugin", kwonly=("capture_hidden_mode",)),
    Requirement(_LOAD_MOD, _LOAD_QN, "function", "capture set-up after model load"),
    Requirement(_INIT_MOD, _INIT_QN, "function", "capture-layer check before CUDA graph capture"),
    Requirement(_LOAD_MOD, "ModelRunner.model", "member", "the loaded model"),
    Requirement(_LOAD_MOD, "ModelRunner.server_args", "member", "choosing the capture source"),
    Requirement(_LOAD_MOD, "ModelRunner.is_draft_worker", "member", "skipping draft workers"),
    Requirement(_STORE_MOD, _STORE_QN, "function", "appending the final state to the aux capture",
                needed_for="plugin",
                params=("hidden_states", "hidden_states_before_norm", "aux_hidden_states", "logits_metadata")),
    Requirement(_LAST_MOD, _LAST_QN, "function", "the pre-norm final state instead of the post-norm one",
                needed_for="builtin", params=("hidden_states", "aux_hidden_states", "logits_metadata")),
    # what the hook reads
    Requirement("sglang.srt.managers.utils", "GenerationBatchResult.logits_output", "member", "forward result"),
    Requirement(_LP, "LogitsProcessorOutput.hidden_states", "member", "captured rows"),
    Requirement(_LP, "LogitsProcessorOutput.last_hidden_states", "member", "post-norm final state",
                needed_for="builtin"),
    Requirement(_LP, "LogitsMetadata.capture_hidden_mode", "member", "capture mode in the logits processor",
                needed_for="plugin"),
    Requirement(_FBI, "CaptureHiddenMode.FULL", "member", "full-sequence capture", needed_for="plugin"),
    Requirement(_FBI, "CaptureHiddenMode.is_full", "function", "full-sequence capture", needed_for="plugin"),
    Requirement(_FBI, "ForwardMode.is_extend", "function", "selecting prefill batches"),
    Requirement(_SB, "ScheduleBatch.reqs", "member", "per-request slicing"),
    Requirement(_SB, "ScheduleBatch.prefix_lens", "member", "per-request slicing"),
    Requirement(_SB, "ScheduleBatch.extend_lens", "member", "per-request slicing"),
    Requirement(_SB, "ScheduleBatch.forward_mode", "member", "selecting prefill batches"),
    Requirement(_SB, "Req.__init__", "function", "request id and prompt", params=("rid", "origin_input_ids")),
    Requirement(_SB, "Req.rid", "member", "dump file name"),
    Requirement(_SB, "Req.origin_input_ids", "member", "prompt length and id check"),
    Requirement("sglang.srt.runtime_context", "get_parallel", "function", "the writer rank"),
    Requirement("sglang.srt.runtime_context", "", "string", "the writer rank", value="attn_tp_rank"),
    # server flags the launcher passes
    Requirement("", "disable_radix_cache", "server_arg", "every row computed (no prefix-cache hits)",
                needed_for="flat"),
    Requirement("", "chunked_prefill_size", "server_arg", "prefill chunking"),
    Requirement("", "skip_tokenizer_init", "server_arg", "token-id requests"),
    Requirement("", "enable_return_hidden_states", "server_arg", "prefill CUDA graphs in FULL mode",
                needed_for="plugin"),
    Requirement("", "enable_return_aux_hidden_states", "server_arg", "SGLang's own aux capture",
                needed_for="builtin"),
    Requirement("", "return_aux_hidden_state_layer_ids", "server_arg", "SGLang's own aux capture",
                needed_for="builtin"),
    # the API key: the launcher names a 0600 YAML file with --config (hsextract.sglang.keyfile), which
    # prepare_server_args turns into --api-key inside the process
    Requirement("", "api_key", "server_arg", "the server's API key"),
    Requirement("sglang.srt.server_args", "prepare_server_args", "function", "--config file of server flags",
                params=("argv",)),
    Requirement("sglang.srt.server_args", "", "string", "--config file of server flags (the API key)",
                value="--config"),
    # HTTP contract the client uses
    Requirement("sglang.srt.managers.io_struct", "GenerateReqInput.rid", "member", "request id"),
    Requirement("sglang.srt.managers.io_struct", "GenerateReqInput.input_ids", "member", "token-id prompts"),
    Requirement("sglang.srt.managers.io_struct", "GenerateReqInput.sampling_params", "member", "max_new_tokens"),
    # share_prefixes: each request's radix namespace (its family within one chunk attempt), carried from the
    # HTTP request to the scheduler's Req and into every radix key
    Requirement("sglang.srt.managers.io_struct", "GenerateReqInput.extra_key", "member",
                "each request's prefix-cache namespace", needed_for="shared"),
    Requirement(_SB, "Req.extra_key", "member", "each request's prefix-cache namespace", needed_for="shared"),
    Requirement("sglang.srt.mem_cache.radix_cache", "RadixKey.extra_key", "member",
                "radix matches only within one namespace", needed_for="shared"),
    Requirement("sglang.srt.sampling.sampling_params", "SamplingParams.max_new_tokens", "member",
                "max_new_tokens 0"),
    Requirement("sglang.srt.entrypoints.http_server", "", "string", "POST /generate", value="/generate"),
    Requirement("sglang.srt.entrypoints.http_server", "", "string", "GET /health", value="/health"),
    # models
    Requirement("sglang.srt.models.llama", "LlamaModel.layers_to_capture", "member", "capture layers",
                needed_for="llama"),
    Requirement("sglang.srt.models.llama", "LlamaForCausalLM.set_dflash_layers_to_capture", "function",
                "capture set-up (+1)", needed_for="llama", params=("layer_ids",)),
    Requirement("sglang.srt.models.deepseek_v2", "DeepseekV2Model.layers_to_capture", "member", "capture layers",
                needed_for="deepseek"),
    Requirement("sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM.set_dflash_layers_to_capture",
                "function", "capture set-up (+1, avoids set_eagle3's raw-id quirk)", needed_for="deepseek",
                params=("layer_ids",)),
    Requirement("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM", "member", "the DeepseekV3 class",
                needed_for="deepseek"),
)

SERVER_ARG_FILES = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/fields/")


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    what: str
    needed_for: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what} [{self.needed_for}]"


@dataclass
class CompatReport:
    source: str
    version: str | None
    problems: list[Problem] = field(default_factory=list)
    checked: int = 0

    def _ok(self, group: str) -> bool:
        return not any(p.needed_for == group for p in self.problems)

    @property
    def in_range(self) -> bool:
        v = parse_version(self.version)
        return v is not None and SUPPORTED_MIN <= v <= SUPPORTED_MAX

    @property
    def capture_sources(self) -> list[str]:
        return [g for g in ("builtin", "plugin") if self._ok(g)]

    @property
    def models(self) -> list[str]:
        return [g for g in ("llama", "deepseek") if self._ok(g)]

    @property
    def prefix_modes(self) -> list[str]:
        """share_prefixes off ("flat") and on ("shared"): the ones this release supports."""
        return [g for g in ("flat", "shared") if self._ok(g)]

    @property
    def ok(self) -> bool:
        return self.in_range and self._ok("all") and bool(self.capture_sources)

    @property
    def ran_on_gpu(self) -> bool:
        v = parse_version(self.version)
        return v is not None and ".".join(map(str, v)) in RAN_ON_GPU

    def summary(self) -> dict:
        v = parse_version(self.version)
        release = ".".join(map(str, v)) if v else None
        return {
            "source": self.source,
            "sglang_version": self.version,
            "in_supported_range": self.in_range,
            "supported_range": [".".join(map(str, SUPPORTED_MIN)), ".".join(map(str, SUPPORTED_MAX))],
            "ran_on_gpu": self.ran_on_gpu,
            "tested": RAN_ON_GPU.get(release or "", "checked statically only (this report), never ran on a GPU"
                                     if self.checked else "not checked: no SGLang source was found to check"),
            "releases": {"ran_on_gpu": dict(RAN_ON_GPU),
                         "checked_statically_only": [r for r in RELEASES_CHECKED if r not in RAN_ON_GPU],
                         "neither": "every other release of the supported range"},
            "capture_sources": self.capture_sources,
            "models": self.models,
            "prefix_modes": self.prefix_modes,
            "checked": self.checked,
            "ok": self.ok,
            "problems": [asdict(p) | {"text": str(p)} for p in self.problems],
        }


def parse_version(v: str | None) -> tuple[int, ...] | None:
    if not v:
        return None
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", v)
    return tuple(int(x) for x in m.groups()) if m else None


# ---- source access ------------------------------------------------------------------------------------
class _Tree:
    """Read-only view of the package files, keyed by 'sglang/...' relative paths."""

    def __init__(self, root: Path | None = None, zf: zipfile.ZipFile | None = None) -> None:
        self.root, self.zf = root, zf
        self._cache: dict[str, str | None] = {}
        self._names = set(zf.namelist()) if zf else None

    def read(self, rel: str) -> str | None:
        if rel not in self._cache:
            if self.zf is not None:
                self._cache[rel] = self.zf.read(rel).decode() if rel in self._names else None
            else:
                p = self.root / rel
                self._cache[rel] = p.read_text(encoding="utf-8") if p.is_file() else None
        return self._cache[rel]

    def list(self, prefix: str) -> list[str]:
        if self.zf is not None:
            return sorted(n for n in self._names if n.startswith(prefix) and n.endswith(".py"))
        d = self.root / prefix
        return sorted(str(p.relative_to(self.root)) for p in d.glob("*.py")) if d.is_dir() else []


def _module_file(tree: _Tree, module: str) -> str:
    base = module.replace(".", "/")
    return f"{base}/__init__.py" if tree.read(f"{base}/__init__.py") is not None else f"{base}.py"


class _Index:
    def __init__(self, src: str) -> None:
        self.tree = ast.parse(src)
        self.src = src
        self.top: dict[str, ast.AST] = {}
        for node in self.tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                self.top[node.name] = node
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        self.top[t.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self.top[node.target.id] = node

    @staticmethod
    def class_member(cls: ast.ClassDef, name: str) -> ast.AST | None:
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return node
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return node
        for node in ast.walk(cls):  # self.<name> = ... in any method
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if (isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                            and t.value.id == "self"):
                        return node
        return None


def _check_one(tree: _Tree, idx_cache: dict[str, _Index | None], req: Requirement) -> Problem | None:
    if req.kind == "server_arg":
        files = [SERVER_ARG_FILES[0]] + tree.list(SERVER_ARG_FILES[1])
        for f in files:
            if tree.read(f) is None:
                continue
            try:
                parsed = _index(tree, idx_cache, f).tree
            except SyntaxError:
                continue
            for node in ast.walk(parsed):
                if isinstance(node, ast.ClassDef) and _Index.class_member(node, req.qualname) is not None:
                    return None
        return Problem(SERVER_ARG_FILES[0], 0, f"server argument {req.qualname} not found ({req.why})", req.needed_for)
    rel = _module_file(tree, req.module)
    if tree.read(rel) is None:
        return Problem(rel, 0, f"module {req.module} is missing ({req.why})", req.needed_for)
    try:
        idx = _index(tree, idx_cache, rel)
    except SyntaxError as e:
        return Problem(rel, e.lineno or 0, f"cannot parse: {e.msg} ({req.why})", req.needed_for)
    if req.kind == "string":
        if any(isinstance(n, ast.Constant) and n.value == req.value for n in ast.walk(idx.tree)):
            return None
        return Problem(rel, 0, f"string {req.value!r} does not occur ({req.why})", req.needed_for)
    parts = req.qualname.split(".")
    node = idx.top.get(parts[0])
    if node is None:
        return Problem(rel, 0, f"{parts[0]} is not defined at module level ({req.why})", req.needed_for)
    owner = node
    for p in parts[1:]:
        if not isinstance(owner, ast.ClassDef):
            return Problem(rel, owner.lineno, f"{req.qualname}: {owner_name(owner)} is not a class", req.needed_for)
        member = _Index.class_member(owner, p)
        if member is None:
            return Problem(rel, owner.lineno, f"class {owner.name} has no member {p!r} ({req.why})", req.needed_for)
        owner = member
    if req.kind == "constant":
        if not (isinstance(owner, ast.Assign) and isinstance(owner.value, ast.Constant)
                and owner.value.value == req.value):
            return Problem(rel, owner.lineno, f"{req.qualname} is not {req.value!r} ({req.why})", req.needed_for)
        return None
    if req.kind == "function":
        if not isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Problem(rel, owner.lineno, f"{req.qualname} is not a function ({req.why})", req.needed_for)
        a = owner.args
        names = {x.arg for x in a.posonlyargs + a.args}
        kw = {x.arg for x in a.kwonlyargs}
        for p in req.params:
            if p not in names and p not in kw and a.kwarg is None:
                return Problem(rel, owner.lineno, f"{req.qualname} has no parameter {p!r} ({req.why})",
                               req.needed_for)
        for p in req.kwonly:
            if p not in kw and p not in names:
                return Problem(rel, owner.lineno, f"{req.qualname} has no keyword argument {p!r} ({req.why})",
                               req.needed_for)
    return None


def owner_name(node: ast.AST) -> str:
    return getattr(node, "name", type(node).__name__)


def _index(tree: _Tree, cache: dict, rel: str) -> _Index:
    if rel not in cache:
        cache[rel] = _Index(tree.read(rel) or "")
    return cache[rel]


def check_tree(tree: _Tree, source: str, version: str | None) -> CompatReport:
    report = CompatReport(source=source, version=version)
    cache: dict[str, _Index] = {}
    for req in REQUIREMENTS:
        report.checked += 1
        prob = _check_one(tree, cache, req)
        if prob is not None:
            report.problems.append(prob)
    if not report.in_range:
        report.problems.append(Problem("METADATA", 0, f"SGLang {version} is outside the supported range "
                                       f"{'.'.join(map(str, SUPPORTED_MIN))}-{'.'.join(map(str, SUPPORTED_MAX))}",
                                       "all"))
    return report


def _metadata_version(text: str | None) -> str | None:
    m = re.search(r"^Version:\s*(\S+)", text or "", re.M)
    return m.group(1) if m else None


def check_wheel(path: str | Path) -> CompatReport:
    """Check a downloaded `sglang-*.whl` (read in place, nothing extracted or imported)."""
    path = Path(path)
    with zipfile.ZipFile(path) as zf:
        meta = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        version = _metadata_version(zf.read(meta).decode()) if meta else None
        return check_tree(_Tree(zf=zf), str(path), version)


def check_directory(site: str | Path) -> CompatReport:
    """Check the `sglang/` package under a site-packages directory."""
    site = Path(site)
    metas = sorted(site.glob("sglang-*.dist-info/METADATA"))
    version = _metadata_version(metas[-1].read_text(encoding="utf-8")) if metas else None
    return check_tree(_Tree(root=site), str(site / "sglang"), version)


def check_installed(python: str | None = None) -> CompatReport:
    """Check the SGLang that `python` (default: this interpreter) would import, without importing it."""
    code = ("import importlib.util, json; s = importlib.util.find_spec('sglang'); "
            "print(json.dumps([list(s.submodule_search_locations) if s else None, "
            "importlib.util.find_spec('xxhash') is not None]))")
    out = subprocess.run([python or sys.executable, "-c", code], capture_output=True, text=True, encoding="utf-8",
                         errors="replace", timeout=120)
    locs, has_xxhash = json.loads(out.stdout.strip() or "[null, false]") if out.returncode == 0 else (None, False)
    if not locs:
        r = CompatReport(source=python or sys.executable, version=None)
        r.problems.append(Problem("-", 0, f"no sglang package importable by {python or sys.executable} "
                                  f"({out.stderr.strip()[-300:] or 'find_spec returned None'})", "all"))
        return r
    r = check_directory(Path(locs[0]).parent)
    if not has_xxhash:  # the plugin checksums its dumps; hsextract is installed there with --no-deps
        r.problems.append(Problem("-", 0, f"xxhash is not importable by {python or sys.executable}: "
                                  "pip install 'xxhash>=3.0' into the server environment", "all"))
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--wheel", help="an sglang-*.whl file")
    g.add_argument("--python", help="the server environment's Python executable")
    g.add_argument("--site", help="a site-packages directory holding sglang/")
    ap.add_argument("--json", help="write the report here")
    a = ap.parse_args(argv)
    rep = check_wheel(a.wheel) if a.wheel else check_directory(a.site) if a.site else check_installed(a.python)
    text = json.dumps(rep.summary(), indent=2)
    if a.json:
        write_bytes_atomic(a.json, (text + "\n").encode())
    print(text)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
