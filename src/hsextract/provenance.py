"""Hashes and versions that say where a dataset came from (shard metadata, dataset.json)."""

from __future__ import annotations

import ast
import hashlib
import json
import platform
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

# Weight files can be hundreds of GB: hash their size and first MiB, everything else whole.
_PREFIX_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def config_hash(config: Mapping[str, Any]) -> str:
    """sha256 of the config as canonical JSON (sorted keys): equal configs, equal hashes."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def model_hash(model: str) -> str:
    """sha256 over a model directory: small files whole; weight files by name, size and first MiB.

    A hub id that is not a local directory hashes as its name (prefix `name:`).
    """
    root = Path(model)
    if not root.is_dir():
        return "name:" + hashlib.sha256(model.encode()).hexdigest()
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        rel = p.relative_to(root).as_posix()
        if rel.startswith("."):
            continue
        size = p.stat().st_size
        h.update(f"{rel}\0{size}\0".encode())
        with open(p, "rb") as f:
            if p.suffix in _WEIGHT_SUFFIXES:
                h.update(f.read(_PREFIX_BYTES))
            else:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


# transformers 5 saves a tokenizer's named templates other than the default beside chat_template.jinja, one file each
ADDITIONAL_TEMPLATES = "additional_chat_templates"


def additional_templates(root: Path) -> dict[str, str]:
    """{name: text} of the named templates in `root`/additional_chat_templates/<name>.jinja."""
    folder = root / ADDITIONAL_TEMPLATES
    if not folder.is_dir():
        return {}
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.jinja")) if p.is_file()}


def jinja_templates(root: Path) -> str | dict[str, str] | None:
    """The chat template of `root`/chat_template.jinja, or with named templates beside it {"default": it, name:
    template, ...}; None without that file."""
    jinja = root / "chat_template.jinja"
    if not jinja.is_file():
        return None
    named = additional_templates(root)
    return {"default": jinja.read_text(encoding="utf-8"), **named} if named else jinja.read_text(encoding="utf-8")


def _auto_map_modules(root: Path) -> list[str]:
    """The files of the modules tokenizer_config.json's `auto_map` names here ("module.Class"; not
    "repo--module.Class", another repository's code)."""
    try:
        auto_map = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8")).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return []
    refs = [r for v in (auto_map.values() if isinstance(auto_map, dict) else ())
            for r in (v if isinstance(v, list) else [v]) if isinstance(r, str) and "--" not in r]
    modules = [r.rsplit(".", 1)[0] for r in refs if "." in r]
    return [m.replace(".", "/") + ".py" for m in modules if all(part.isidentifier() for part in m.split("."))]


def tokenizer_code(root: Path) -> list[str]:
    """The tokenizer's code in `root`, by file name: its `tokenization_*.py` and `auto_map` modules, and the modules
    of `root` they import relatively (`from .x import y`, `from . import x`; of a package, its every `.py`), as far as
    those go: custom code may keep part of itself beside it (Kimi-K2.5's tokenization_kimi.py renders tool
    declarations with tool_declaration_ts.py), and it decides the ids as much as the vocabulary does."""
    seen: set[str] = set()
    todo = [n for n in {*(p.name for p in root.glob("tokenization_*.py")), *_auto_map_modules(root)}
            if (root / n).is_file()]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            tree = ast.parse((root / name).read_bytes())
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
            continue  # unreadable code fails where it loads, not here (this runs as the Snakefile is read)
        base = (root / name).parent
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 1):
                continue
            for module in [node.module] if node.module else [a.name for a in node.names]:
                target = base / module.split(".")[0]
                if target.with_suffix(".py").is_file():
                    todo.append(target.with_suffix(".py").relative_to(root).as_posix())
                elif target.is_dir():
                    seen.update(p.relative_to(root).as_posix() for p in target.rglob("*.py") if p.is_file())
    return sorted(seen)


def tokenizer_file_names(root: Path) -> list[str]:
    """The names tokenizer_hash reads in a tokenizer directory (those that exist among them): TOKENIZER_FILES, its
    code (tokenizer_code) and its additional named templates."""
    return [*TOKENIZER_FILES, *tokenizer_code(root),
            *(f"{ADDITIONAL_TEMPLATES}/{name}.jinja" for name in additional_templates(root))]


def tokenizer_hash(tokenizer_dir: str) -> str:
    """sha256 over the tokenizer files that exist in the directory (names and contents).

    A tokenizer shipped as custom code (Kimi-K2.5's tokenization_kimi.py) counts its code too (tokenizer_code).
    """
    root = Path(tokenizer_dir)
    if not root.is_dir():
        return "name:" + hashlib.sha256(tokenizer_dir.encode()).hexdigest()
    h = hashlib.sha256()
    for name in tokenizer_file_names(root):
        p = root / name
        if p.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def data_hash(files: Sequence[Path]) -> str:
    """sha256 of a source's data: its file's, or over its files (names, sizes, contents), every byte, as the data
    decides the dataset."""
    if len(files) == 1:
        return sha256_file(files[0])
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{p.stat().st_size}\0{sha256_file(p)}\0".encode())
    return h.hexdigest()


def text_hash(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("hsextract", "torch", "transformers", "tokenizers", "zstandard", "pyarrow", "snakemake", "sglang"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            if dist == "hsextract":
                from hsextract import __version__

                out[dist] = __version__
    return out


def chat_template_text(tokenizer_dir: str) -> str | None:
    """The chat template stored with a tokenizer (chat_template.jinja or tokenizer_config.json)."""
    root = Path(tokenizer_dir)
    template = jinja_templates(root)
    if template is not None:  # named templates: hash them all, the default as `default`
        return template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    cfg = root / "tokenizer_config.json"
    if cfg.is_file():
        template = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
        if isinstance(template, list):  # named templates: hash them all, in order
            return json.dumps(template, sort_keys=True)
    return None
