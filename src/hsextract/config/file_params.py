"""What the files a config names hold, as rule params: a file changed in place under the same path reruns its rules.

A config key's value (hsextract.config.reruns) is a path; what the rule reads is the file there. Snakemake sees a
file only as a rule's input, and then only its mtime, and only a newer one than the outputs': a real model (no DAG
input: it is not the workflow's to rebuild) fine-tuned in place, a tokenizer file or chat_template.jinja rewritten,
or a source replaced by an older file (`cp -p`, `rsync -a`, `tar x`) would rerun nothing. So the rules that read
them take, as `params: files=`, a signature of what they read (Snakemake's params trigger compares it with the one
recorded with the outputs):

    prepare, regenerate_chunk  the tokenizer's files (provenance.tokenizer_hash: small files, by content), the chat
                               template's text (the `chat_template` file, or the one stored with the tokenizer), and
                               each source's files (relative name, size, mtime_ns: a source can be many GB)
    extract                    the model's files (relative name, size, mtime_ns); regenerate_chunk too when it loads
                               the model (its transformers engine)
    regenerate_chunk           also the model's generation_config.json (by content: its end-of-turn ids), on either
                               engine
    make_tiny_model            the source its tokenizer is trained on (name, size, mtime_ns)

Left out, so that a path the workflow itself writes reruns through its rules, never because it appeared between two
invocations: paths under `produced` (the run's results, and the tiny model when make_tiny_model builds it), a name
that is no local file or directory (a hub id: nothing to stat), and in the model's directory the tokenizer files
whose content prepare's signature already holds (a `touch` of one does not re-extract), generation_config.json
(regenerate's own param) and the files for people (DOC_SUFFIXES, DOC_NAMES: README.md, images, LICENSE).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from hsextract.config.reruns import regenerate_engine
from hsextract.config.settings import Settings, Source
from hsextract.provenance import chat_template_text, sha256_file, text_hash, tokenizer_file_names, tokenizer_hash

# the rules that take `params: files=` (workflow/rules/*.smk)
RULES = ("make_tiny_model", "regenerate_chunk", "prepare", "extract")


def inside(path: str | os.PathLike[str], dirs: Iterable[str | os.PathLike[str]]) -> bool:
    """Whether `path` is one of `dirs` or under one (both resolved: symlinks, `..`)."""
    p = Path(path).resolve()
    return any(p.is_relative_to(Path(d).resolve()) for d in dirs)


def stat_signature(root: Path, files: Iterable[Path]) -> str:
    """sha256 over (name relative to `root`, size, mtime_ns) of each file, in name order: what changes when a file
    is rewritten, without reading it. A symlink counts as its target (the hub cache links snapshots to blobs)."""
    rows = []
    for p in files:
        st = p.stat()
        rows.append(f"{p.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n")
    return hashlib.sha256("".join(sorted(rows)).encode()).hexdigest()


def _tree(root: Path) -> list[Path]:
    """The files under `root`, hidden names (.cache, .git) and __pycache__ left out at any depth."""
    out = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        out += [Path(top, f) for f in files if not f.startswith(".") and Path(top, f).is_file()]
    return out


def _local(path: str | None, produced: Sequence[str]) -> Path | None:
    """`path` when it is a local file or directory the workflow does not write; else None."""
    if not path or not Path(path).exists() or inside(path, produced):
        return None
    return Path(path)


# What a checkpoint ships for people, which no model load reads (Kimi-K2.5's README.md, LICENSE, figures/*.png,
# docs/*.md): rewritten by a fresh `hf download`, they would rerun every extract job (GPU-days on Kimi).
DOC_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp", ".pdf")
DOC_NAMES = ("LICENSE", "NOTICE")
# the generation defaults (its end-of-turn ids): regenerate's, whatever its engine, and no forward's
GENERATION_CONFIG = "generation_config.json"


def _for_people(name: str) -> bool:
    return name.lower().endswith(DOC_SUFFIXES) or name.split(".")[0] in DOC_NAMES


def model_signature(model: str, produced: Sequence[str], exclude: Collection[str] = ()) -> str | None:
    """The model directory's files by relative name, size and mtime_ns; `exclude` (names at its top) and the files
    for people (DOC_SUFFIXES, DOC_NAMES) left out.

    By mtime and not by content: a real checkpoint is hundreds of GB (Kimi-K2.5's about 600), read at every parse
    of the Snakefile it would take minutes; and not by size alone: a checkpoint fine-tuned in place keeps every
    size. None for a hub id or a model the workflow builds (make_tiny_model: its rule reruns what follows it).
    """
    root = _local(model, produced)
    if root is None or not root.is_dir():
        return None
    return stat_signature(root, [p for p in _tree(root) if not _for_people(p.name)
                                 and p.relative_to(root).as_posix() not in exclude])


def tokenizer_files(tokenizer_dir: str) -> set[str]:
    """The files of a tokenizer directory that provenance.tokenizer_hash reads (by content)."""
    root = Path(tokenizer_dir)
    return set(tokenizer_file_names(root)) if root.is_dir() else set()


def tokenizer_identity(tokenizer_dir: str, produced: Sequence[str]) -> str | None:
    """provenance.tokenizer_hash of a local tokenizer directory the workflow does not build; else None."""
    root = _local(tokenizer_dir, produced)
    return tokenizer_hash(str(root)) if root is not None and root.is_dir() else None


def template_identity(chat_template: str | None, tokenizer_dir: str, produced: Sequence[str]) -> str | None:
    """sha256 of the chat template's text: the `chat_template` file's (its text, when given inline, is the key's
    value: None), else the one stored with a local tokenizer the workflow does not build (chat_template.jinja or
    tokenizer_config.json); None where there is nothing to read."""
    from hsextract.prepare.tokenizer_loading import chat_template_file

    if chat_template:
        path = chat_template_file(chat_template)
        return text_hash(path.read_text(encoding="utf-8")) if path is not None and _local(str(path), produced) else None
    root = _local(tokenizer_dir, produced)
    return text_hash(chat_template_text(str(root))) if root is not None and root.is_dir() else None


def source_signature(spec: Source, produced: Sequence[str]) -> str | None:
    """The files a source's reader reads (prepare.sources.data_files) by name, size and mtime_ns (a source can be
    many GB: not read at every parse); None for a path the workflow writes or that does not exist (the workflow
    says why where it reads it)."""
    from hsextract.prepare.sources import data_files

    path = _local(spec.path, produced)
    if path is None:
        return None
    root = path if path.is_dir() else path.parent
    return stat_signature(root, data_files(spec))


def params(settings: Settings, rule: str, produced: Sequence[str]) -> dict[str, Any]:
    """`rule`'s `params: files=` (keys sorted, plain types: Snakemake compares params by repr); {} for a rule of
    none of RULES. `produced`: the directories the workflow writes (its files are left out)."""
    if rule not in RULES:
        return {}
    if rule == "make_tiny_model":
        from hsextract.config.checks import tiny_model_corpus

        corpus = tiny_model_corpus(settings)
        spec = next((src for src in settings.prepare.sources if src.path == corpus), None)
        return {"corpus": source_signature(spec, produced) if spec is not None else None}
    s = settings.extract
    tok = s.tokenizer_dir
    out: dict[str, Any] = {}
    if rule in ("prepare", "regenerate_chunk"):
        # regenerate.enabled: prepare reads the regenerated conversations (an output: left out), regenerate the sources
        sources = () if rule == "prepare" and settings.regenerate.enabled else settings.prepare.sources
        out["chat_template"] = template_identity(settings.prepare.chat_template, tok, produced)
        out["sources"] = [source_signature(spec, produced) for spec in sources]
        out["tokenizer"] = tokenizer_identity(tok, produced)
    if rule == "extract" or (rule == "regenerate_chunk" and regenerate_engine(settings) == "transformers"):
        # the tokenizer's own files in the model's directory: prepare's (regenerate's) content hash holds them
        same = Path(tok).resolve() == Path(s.model).resolve()
        exclude = {*(tokenizer_files(tok) if same else ()), GENERATION_CONFIG}
        out["model"] = model_signature(s.model, produced, exclude=exclude)
    if rule == "regenerate_chunk":  # its end-of-turn ids, on either engine (regenerate.run: end_of_turn_ids)
        root = _local(s.model, produced)
        path = root / GENERATION_CONFIG if root is not None else None
        out["generation_config"] = sha256_file(path) if path is not None and path.is_file() else None
    return dict(sorted(out.items()))


__all__ = ["DOC_NAMES", "DOC_SUFFIXES", "GENERATION_CONFIG", "RULES", "inside", "model_signature", "params",
           "source_signature", "stat_signature", "template_identity", "tokenizer_files", "tokenizer_identity"]
