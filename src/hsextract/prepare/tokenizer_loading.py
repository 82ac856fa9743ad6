"""Loading the tokenizer a checkpoint ships: fast, slow, or custom code behind `trust_remote_code`.

Every stage that needs a tokenizer (prepare, regenerate) loads it with `load_tokenizer`, and the
workflow's parse-time checks call `check_tokenizer_source`, so a checkpoint whose tokenizer is custom
code is refused before any job runs while the config key `trust_remote_code` is false. Custom code means
an `auto_map` entry for AutoTokenizer in tokenizer_config.json naming a module shipped with the
checkpoint, as Kimi-K2.5 does (`tokenization_kimi.TikTokenTokenizer`, a tiktoken-based slow tokenizer).

Such a module is written against one transformers major version: the imports it takes from transformers'
internals move between majors (transformers 5 removed `bytes_to_unicode` from
`transformers.models.gpt2.tokenization_gpt2`; it lives in `transformers.convert_slow_tokenizer`, which
both majors have). When the code fails to load, the error reads the module's transformers imports,
names the ones the installed transformers lacks and the version range in which they resolve.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsextract.errors import ConfigError

KEY = "trust_remote_code"
# The oldest transformers this project supports (pyproject.toml, the model extra).
MIN_TRANSFORMERS = "4.57"
# Imports that custom tokenizer files take from transformers and that moved between majors:
# (module, name) -> (range of transformers versions where the import resolves, where it lives in both).
MOVED_IMPORTS: dict[tuple[str, str], tuple[str, str]] = {
    ("transformers.models.gpt2.tokenization_gpt2", "bytes_to_unicode"):
        (f">={MIN_TRANSFORMERS},<5", "transformers.convert_slow_tokenizer"),
}


@dataclass(frozen=True)
class RemoteCode:
    """The custom tokenizer class a tokenizer directory declares."""

    config_file: Path  # the tokenizer_config.json that holds the auto_map
    class_ref: str  # e.g. "tokenization_kimi.TikTokenTokenizer"
    module_file: Path | None  # the module in the directory; None when the code lives in another hub repo

    def describe(self) -> str:
        return f"{self.config_file} auto_map AutoTokenizer -> {self.class_ref}"


def _tokenizer_config(source: str) -> Path | None:
    """tokenizer_config.json of a local directory, or of a hub id already in the local cache (no network)."""
    root = Path(source)
    if root.is_dir():
        cfg = root / "tokenizer_config.json"
        return cfg if cfg.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        hit = try_to_load_from_cache(source, "tokenizer_config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id: nothing cached to read
        return None
    return Path(hit) if isinstance(hit, str) and Path(hit).is_file() else None


def remote_tokenizer_code(source: str | os.PathLike[str]) -> RemoteCode | None:
    """The custom tokenizer code `source` declares (tokenizer_config.json `auto_map`), or None.

    Reads a local directory, or the local cache of a hub id; None when neither holds a tokenizer_config.json.
    """
    cfg_path = _tokenizer_config(str(source))
    if cfg_path is None:
        return None
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer: cannot read {cfg_path} ({e}); the tokenizer directory is damaged") from None
    auto_map = cfg.get("auto_map") if isinstance(cfg, dict) else None
    ref = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    if isinstance(ref, (list, tuple)):  # [slow class, fast class], either may be null
        ref = next((r for r in ref if isinstance(r, str) and r), None)
    if not isinstance(ref, str) or not ref:
        return None
    module = ref.rsplit(".", 1)[0]
    local = cfg_path.parent / f"{module}.py" if "--" not in module else None
    return RemoteCode(cfg_path, ref, local if local is not None and local.is_file() else None)


def refusal(source: str, code: RemoteCode | None) -> ConfigError:
    where = code.describe() if code else "its tokenizer_config.json auto_map"
    module = f"{code.module_file}" if code and code.module_file else "the tokenizer module it names"
    return ConfigError(
        f"{KEY}: the tokenizer of {source} is custom code ({where}), which transformers runs only with "
        f"{KEY}: true. Read {module}; if you trust it, set `{KEY}: true` in the config "
        f"(config/kimi.yaml does), or pass --trust-remote-code to `hsextract masks`.")


def check_tokenizer_source(source: str | os.PathLike[str], trust_remote_code: bool) -> RemoteCode | None:
    """Parse-time check: refuse custom tokenizer code unless trusted. Returns the custom code found, if any."""
    code = remote_tokenizer_code(source)
    if code is not None and not trust_remote_code:
        raise refusal(str(source), code)
    return code


def _transformers_version() -> str:
    try:
        import transformers

        return str(transformers.__version__)
    except ImportError:
        return "not installed"


def _resolves(module: str, name: str | None) -> bool:
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a module that fails to import does not resolve
        return False
    if name is None:
        return True
    try:
        return hasattr(mod, name)
    except Exception:  # noqa: BLE001 - lazy modules may raise on attribute access
        return False


def unresolved_imports(module_file: Path) -> list[tuple[str, str | None]]:
    """The transformers imports of a module file that the installed transformers does not provide."""
    try:
        tree = ast.parse(module_file.read_text(encoding="utf-8"), filename=str(module_file))
    except (OSError, SyntaxError, ValueError):
        return []
    wanted: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "transformers" or node.module.startswith("transformers."):
                wanted += [(node.module, a.name) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            wanted += [(a.name, None) for a in node.names if a.name.startswith("transformers.")]
    return [(m, n) for m, n in wanted if not _resolves(m, n)]


def _other_major_range(installed: str) -> str:
    major = installed.split(".", 1)[0]
    if major == "5":
        return f">={MIN_TRANSFORMERS},<5"
    if major == "4":
        return ">=5,<6"
    return f">={MIN_TRANSFORMERS},<6"


def incompatible_code_error(source: str, code: RemoteCode | None, exc: BaseException) -> ConfigError:
    """The error for custom tokenizer code that fails to load: which import, which transformers works."""
    installed = _transformers_version()
    first = str(exc).splitlines()[0] if str(exc) else ""
    module = code.module_file if code else None
    where = f"{module}" if module else (code.class_ref if code else f"the custom tokenizer code of {source}")
    if isinstance(exc, ImportError) and "requires the following packages" in str(exc):
        return ConfigError(
            f"tokenizer: {where} needs a package that is not installed ({first}); install it "
            f"(the hsextract `model` extra and envs/model.yaml include tiktoken, which Kimi's tokenizer needs)")
    missing = unresolved_imports(module) if module else []
    if missing:
        names = ", ".join(f"{m}.{n}" if n else m for m, n in missing)
        known = [MOVED_IMPORTS[(m, n)] for m, n in missing if n is not None and (m, n) in MOVED_IMPORTS]
        if known and len(known) == len(missing):
            works = known[0][0]
            fix = "; ".join(f"{n} is in {MOVED_IMPORTS[(m, n)][1]} in transformers 4 and 5"
                            for m, n in missing if n is not None)
        else:
            works = _other_major_range(installed)
            fix = "update the file's imports to the installed transformers"
        return ConfigError(
            f"tokenizer: {where} was written for another transformers major version: it imports {names}, "
            f"which transformers {installed} does not have (it resolves in `transformers{works}`). "
            f"Install `transformers{works}` for this tokenizer, or use a revision of the checkpoint whose "
            f"tokenizer file imports it from its current place ({fix}). Load error: {type(exc).__name__}: {first}")
    return ConfigError(
        f"tokenizer: the custom tokenizer code {where} failed to load under transformers {installed} "
        f"({type(exc).__name__}: {first}). Custom tokenizer files are written against one transformers major "
        f"version; if the file predates transformers {installed.split('.', 1)[0]}, try "
        f"`transformers{_other_major_range(installed)}`.")


def load_tokenizer(tokenizer: Any, chat_template: str | None = None, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a directory or hub id (or a tokenizer object), with an optional chat template override.

    Fast, slow and sentencepiece tokenizers load as transformers' AutoTokenizer does; custom code only with
    `trust_remote_code` (else ConfigError naming the key).
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        source = str(tokenizer)
        if not os.path.isdir(source) and (os.path.exists(source) or os.path.isabs(source) or source.count("/") > 1
                                          or source.startswith((".", "~"))):  # a path, never a hub id
            raise ConfigError(f"cannot load a tokenizer from {source}: "
                              f"{'not a folder' if os.path.exists(source) else 'no such folder'}; give the model's "
                              "(or tokenizer's) folder, or a hub id such as org/name")
        check_tokenizer_files(source)
        code = check_tokenizer_source(source, trust_remote_code)
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        except Exception as e:  # custom code fails in any way (ImportError, AttributeError, ...); re-raised
            if not trust_remote_code and KEY in str(e):  # a hub id whose config was not in the local cache
                raise refusal(source, remote_tokenizer_code(source)) from None
            code = code or (remote_tokenizer_code(source) if trust_remote_code else None)
            if code is None:
                raise ConfigError(f"cannot load a tokenizer from {source}: {type(e).__name__}: {e}") from e
            raise incompatible_code_error(source, code, e) from e
    if chat_template:
        path = chat_template_file(chat_template)
        tokenizer.chat_template = path.read_text(encoding="utf-8") if path else chat_template
    return tokenizer


# A tokenizer folder holds one of these at least (else transformers fails with a word about sentencepiece or
# tiktoken not being installed, which misleads).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                    "vocab.txt", "spiece.model")


def check_tokenizer_files(source: str) -> None:
    """A local folder without any tokenizer file (a checkpoint's weights alone): ConfigError naming `tokenizer`."""
    root = Path(source)
    if root.is_dir() and not any((root / name).is_file() for name in VOCABULARY_FILES):
        raise ConfigError(
            f"cannot load a tokenizer from {source}: the folder holds no tokenizer files (none of "
            f"{', '.join(VOCABULARY_FILES)}); set `tokenizer:` to the folder (or hub id) that holds the model's "
            f"tokenizer")


def chat_template_file(chat_template: str | None) -> Path | None:
    """The file `chat_template` names, or None when it is the template text itself (or null). ConfigError for a
    value that is neither: no file there, and no Jinja in it (a mistyped path would be rendered as the text)."""
    if chat_template and len(chat_template) < 4096 and Path(chat_template).is_file():
        return Path(chat_template)
    if chat_template and "{{" not in chat_template and "{%" not in chat_template:
        raise ConfigError(f"chat_template: {chat_template!r} is no file (from {Path.cwd()}) and no Jinja template "
                          "(it has no {{ or {%): give the template file's path, or the template's text")
    return None


__all__ = ["KEY", "MOVED_IMPORTS", "RemoteCode", "VOCABULARY_FILES", "chat_template_file", "check_tokenizer_files",
           "check_tokenizer_source",
           "incompatible_code_error", "load_tokenizer", "refusal", "remote_tokenizer_code", "unresolved_imports"]
