"""Every text file the project reads or writes is UTF-8 whatever the locale: a template or a config read in a
Latin-1 locale's encoding changed token ids silently (test_cli's utf8 test shows the symptom). Checked on the
source: each text-mode open(), Path.read_text() and Path.write_text() names its encoding."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_FILES = {"os", "gzip", "tarfile", "zipfile", "bz2", "lzma", "webbrowser"}  # .open() of something else


def _unnamed(call: ast.Call) -> bool:
    f = call.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    if name not in ("open", "read_text", "write_text") or any(k.arg in ("encoding", None) for k in call.keywords):
        return False
    if name == "read_text":
        return not call.args
    if name == "write_text":
        return len(call.args) == 1
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in NOT_FILES:
        return False
    modes = [k.value for k in call.keywords if k.arg == "mode"] or call.args[1 if isinstance(f, ast.Name) else 0:][:1]
    return not modes or isinstance(modes[0], ast.Constant) and "b" not in str(modes[0].value)


def test_every_text_file_is_opened_with_its_encoding() -> None:
    files = [p for d in ("src", "workflow", "bench", "tools") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 50
    bad = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in files
           for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
           if isinstance(n, ast.Call) and _unnamed(n)]
    assert bad == [], "give these encoding=\"utf-8\": " + ", ".join(bad)


def test_the_check_sees_each_form() -> None:
    def calls(src: str) -> list[bool]:
        return [_unnamed(n) for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)
                and getattr(n.func, "attr", getattr(n.func, "id", "")) in ("open", "read_text", "write_text")]

    assert calls("open(p); open(p, 'w'); p.open(); p.read_text(); p.write_text(s); p.read_text(errors='x')") \
        == [True] * 6
    assert calls("open(p, 'rb'); p.open('wb'); os.open(p, 1); gzip.open(p); open(p, encoding='utf-8'); "
                 "p.read_text(encoding='utf-8'); p.write_text(s, encoding='utf-8'); open(p, mode='rb')") == [False] * 8
