"""Which variables a chat template reads, and the check that every `chat_template_kwargs` key is one of them.

A key the template never reads changes nothing, silently: Kimi-K2.5's template reads `thinking`, so
`enable_thinking: false` (Qwen's name) leaves the data thinking-on while the config says off. The variables
are jinja2's `meta.find_undeclared_variables` of the template parsed in the environment transformers renders
with: every name the template reads from its context (a name it sets before reading is its own). Jinja has no
other way to read the context (no `locals()`, no context object), so that set is complete, unless the template
pulls in other templates (`include`, `import`, `extends`): those have no loader in transformers, so they cannot
be read here; the check then renders probe conversations with and without the key instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta, nodes

from hsextract.errors import ConfigError

KEY = "chat_template_kwargs"
# apply_chat_template's own arguments: a kwarg of one of these names reaches the render twice (a TypeError); the
# special tokens a kwarg may override (transformers merges them into one mapping)
RENDER_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})
# What every rendering passes a template besides chat_template_kwargs (transformers' apply_chat_template:
# the conversation, its flags and the tokenizer's special tokens); a key naming one of these is read anyway.
SERVER_VARIABLES = RENDER_ARGUMENTS | {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                                      "mask_token", "additional_special_tokens"}


@dataclass(frozen=True)
class TemplateVariables:
    """The names a template reads from its context (`names`), those it also sets somewhere itself (`assigned`:
    read from the context only on paths that do not set them, as Qwen's `content`); `complete` false when it
    pulls in templates not read here."""

    names: frozenset[str]
    assigned: frozenset[str]
    complete: bool
    defaulted: frozenset[str] = frozenset()  # names it sets only where the caller did not: the caller's to set
    identity_tested: frozenset[str] = frozenset()  # names it tests with `is true` / `is false` (bools alone pass)

    @property
    def kwargs(self) -> tuple[str, ...]:
        """The names only a `chat_template_kwargs` key can set: read, and never set by the server nor by the
        template unless it asks whether the caller did (`{% if thinking is not defined %}{% set thinking = false
        %}`, DeepSeek-V3.1's `thinking`, gpt-oss's `reasoning_effort`)."""
        return tuple(sorted(self.names - (self.assigned - self.defaulted) - SERVER_VARIABLES))

    def describe(self) -> str:
        """What the template reads that kwargs can set, in words: "reads `thinking` besides ..." (`masks --explain`
        and the error below)."""
        own = "" if self.complete else " (in its own text; it includes other templates, not read here)"
        if not self.kwargs:
            return f"reads no variable{own} besides those every rendering passes (the conversation, " \
                   f"its flags, the special tokens)"
        names = [f"`{n}`" for n in self.kwargs]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        return f"reads {listed}{own} besides the variables every rendering passes"


def template_variables(template: str) -> TemplateVariables:
    """The variables `template` reads (see the module docstring); none, incomplete, if it does not parse."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:  # the environment apply_chat_template renders with (it knows `{% generation %}`)
        tree = _compile_jinja_template(template).environment.parse(template)
    except jinja2.TemplateError:
        return TemplateVariables(frozenset(), frozenset(), False)
    names = frozenset(meta.find_undeclared_variables(tree))
    assigned = frozenset(n.name for n in tree.find_all(nodes.Name) if n.ctx in ("store", "param")) | frozenset(
        m.name for m in tree.find_all(nodes.Macro))
    tested = frozenset(t.node.name for t in tree.find_all(nodes.Test)
                       if t.name in ("true", "false") and isinstance(t.node, nodes.Name))
    return TemplateVariables(names, assigned, not any(True for _ in meta.find_referenced_templates(tree)),
                             _defaulted(tree), tested)


def _defaulted(tree: nodes.Template) -> frozenset[str]:
    """Names the template sets only where the caller did not: `{% if x is not defined %}{% set x = ... %}` (or
    `not x is defined`) and `{% set x = x if x is defined else ... %}`, the idiom of a template's own kwargs."""

    def undefined_name(test: nodes.Node) -> str | None:  # `x is not defined` / `not x is defined` -> x
        if isinstance(test, nodes.Not) and isinstance(test.node, nodes.Test) and test.node.name == "defined" \
                and isinstance(test.node.node, nodes.Name):
            return test.node.node.name
        return None

    out = set()
    for branch in tree.find_all(nodes.If):
        name = undefined_name(branch.test)
        if name and any(isinstance(a.target, nodes.Name) and a.target.name == name
                        for stmt in branch.body for a in [stmt, *stmt.find_all(nodes.Assign)]
                        if isinstance(a, nodes.Assign)):
            out.add(name)
    for a in tree.find_all(nodes.Assign):
        cond = a.node
        if isinstance(a.target, nodes.Name) and isinstance(cond, nodes.CondExpr) and isinstance(cond.test, nodes.Test) \
                and cond.test.name == "defined" and isinstance(cond.test.node, nodes.Name) \
                and cond.test.node.name == a.target.name:
            out.add(a.target.name)
    return frozenset(out)


def named_variables(templates: Mapping[str, str]) -> TemplateVariables:
    """The variables several named templates read (a tokenizer's `default` and `tool_use`: each record is rendered
    with one of them, so a key any of them reads is read)."""
    each = [template_variables(t) for t in templates.values()]
    return TemplateVariables(frozenset().union(*(v.names for v in each)),
                             frozenset().union(*(v.assigned for v in each)), all(v.complete for v in each),
                             frozenset().union(*(v.defaulted for v in each)),
                             frozenset().union(*(v.identity_tested for v in each)))


def check_kwargs(template: str | Mapping[str, str], kwargs: Mapping[str, Any],
                 renders: Callable[[Mapping[str, Any]], object] | None = None) -> TemplateVariables:
    """Refuse a `chat_template_kwargs` key the template never reads (ConfigError naming it and the variables
    the template reads); `template` may be a tokenizer's named templates (a key one of them reads passes). Where
    the template's variables cannot all be listed, a key is refused when `renders` (the probe renderings under
    given kwargs) are the same with and without it; without `renders`, it passes."""
    found = template_variables(template) if isinstance(template, str) else named_variables(template)
    for k, v in kwargs.items():
        if k in RENDER_ARGUMENTS:  # the render would get it twice (TypeError on every record)
            raise ConfigError(f"{KEY}: `{k}` is an argument of every rendering itself (the conversation and its "
                              f"flags); remove the key. The template {found.describe()}")
        if isinstance(v, str) and v.strip().lower() in ("true", "false"):
            raise ConfigError(f"{KEY}.{k}: {v!r} is a string, and a template takes every non-empty string for true "
                              f"({v!r} included); write {v.strip().lower()} without quotes")
        if k in found.identity_tested and isinstance(v, (int, float)) and not isinstance(v, bool):
            raise ConfigError(f"{KEY}.{k}: {v!r} is a number, and the template tests `{k} is false` or `{k} is true`, "
                              f"which only false or true pass ({v!r} passes neither); write true or false")
    unread = [k for k in kwargs if k not in found.names]
    if not found.complete:
        if renders is None:
            return found
        base = renders(kwargs)
        unread = [k for k in unread if renders({q: v for q, v in kwargs.items() if q != k}) == base]
    if not unread:
        return found
    keys = " or ".join(f"`{k}`" for k in unread)
    it = "it changes" if len(unread) == 1 else "they change"
    why = (f"never reads {keys}" if found.complete else
           f"includes other templates (not read here), and {keys} changes none of the probe renderings (a "
           f"prompt, a turn with reasoning, a tool call and its result)")
    fix = ("Use that name, or remove the key" if len(found.kwargs) == 1 else
           "Use one of those names, or remove the key" if found.kwargs else "Remove the key")
    raise ConfigError(f"{KEY}: the chat template {why}, so {it} nothing (the data would be rendered as without "
                      f"{'it' if len(unread) == 1 else 'them'}); the template {found.describe()}. {fix}")


def stored_template(tokenizer_dir: str | Path, chat_template: str | None = None) -> str | dict[str, str] | None:
    """The chat template a tokenizer directory holds (chat_template.jinja, else tokenizer_config.json's; named
    templates as {name: template}), or `chat_template` (a file or the text) when set; None when there is none
    to read without loading the tokenizer."""
    from hsextract.prepare.tokenizer_loading import chat_template_file

    if chat_template:
        path = chat_template_file(chat_template)
        return path.read_text(encoding="utf-8") if path else chat_template
    from hsextract.provenance import jinja_templates

    root = Path(tokenizer_dir)
    if (template := jinja_templates(root)) is not None:  # transformers 5's files, named templates beside
        return template
    try:
        template = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):  # named templates: each renders the records it is chosen for
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        named = {k: v for k, v in named.items() if isinstance(k, str) and isinstance(v, str)}
        return named or None
    return template if isinstance(template, str) else None


__all__ = ["KEY", "SERVER_VARIABLES", "TemplateVariables", "check_kwargs", "named_variables", "stored_template",
           "template_variables"]
