"""A `chat_template_kwargs` key the chat template never reads is an error (hsextract.masks.kwargs): at config
check, and where the masker is made (prepare, regenerate, `masks --explain`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from chatfix import make_tokenizer
from test_config import ROOT, write_model, write_reference

from hsextract.config.checks import check
from hsextract.errors import ConfigError
from hsextract.masks.kwargs import check_kwargs, template_variables
from hsextract.masks.masker import ChatMasker

KIMI_ENABLE_THINKING = (
    "chat_template_kwargs: the chat template never reads `enable_thinking`, so it changes nothing (the data would be "
    "rendered as without it); the template reads `thinking` besides the variables every rendering passes. Use that "
    "name, or remove the key")


def test_a_key_the_template_never_reads_is_refused_naming_what_it_reads():
    with pytest.raises(ConfigError) as e:
        ChatMasker(make_tokenizer("kimi_k25"), chat_template_kwargs={"enable_thinking": False})
    assert str(e.value) == KIMI_ENABLE_THINKING
    with pytest.raises(ConfigError) as e:
        ChatMasker(make_tokenizer("llama3"), chat_template_kwargs={"enable_thinking": False, "x": 1})
    assert str(e.value) == (
        "chat_template_kwargs: the chat template never reads `enable_thinking` or `x`, so they change nothing (the "
        "data would be rendered as without them); the template reads no variable besides those every rendering "
        "passes (the conversation, its flags, the special tokens). Remove the key")
    with pytest.raises(ConfigError) as e:
        ChatMasker(make_tokenizer("glm47"), chat_template_kwargs={"thinking": True, "clear_thinking": False})
    assert str(e.value) == (
        "chat_template_kwargs: the chat template never reads `thinking`, so it changes nothing (the data would be "
        "rendered as without it); the template reads `clear_thinking` and `enable_thinking` besides the variables "
        "every rendering passes. Use one of those names, or remove the key")


@pytest.mark.parametrize("family,kwargs", [
    ("kimi_k25", {"thinking": False}), ("deepseek_v31", {"thinking": True}), ("qwen3", {"enable_thinking": False}),
    ("gemma4", {"enable_thinking": True}), ("glm45", {"enable_thinking": False}),
    ("glm47", {"enable_thinking": False, "clear_thinking": False}), ("harmony", {"reasoning_effort": "high"}),
    ("llama3", {"bos_token": "<|begin_of_text|>"})])  # a variable the server passes, read: no error
def test_keys_the_template_reads_pass(family, kwargs):
    assert ChatMasker(make_tokenizer(family), chat_template_kwargs=kwargs).renderer.kwargs == kwargs


def test_variables_set_by_the_template_itself_are_not_listed_as_kwargs():
    """Qwen3's template sets `content` and `reasoning_content` in its loop (read from the context only where it
    has not set them): a key of that name is read, so not refused, but only `enable_thinking` is listed."""
    found = template_variables(make_tokenizer("qwen3").chat_template)
    assert {"content", "reasoning_content", "enable_thinking"} <= found.names and found.complete
    assert found.kwargs == ("enable_thinking",)
    masker = ChatMasker(make_tokenizer("qwen3"), chat_template_kwargs={"content": "x"})
    assert masker.renderer.kwargs == {"content": "x"}


def test_a_variable_the_template_defaults_when_the_caller_did_not_set_it_is_a_kwarg():
    """DeepSeek-V3.1's template opens with `{% if not thinking is defined %}{% set thinking = false %}{% endif %}`,
    gpt-oss's sets `reasoning_effort` the same way: the caller's to set, so named in the error."""
    v31 = ("{% if not thinking is defined %}{% set thinking = false %}{% endif %}{% for m in messages %}"
           "{{ m.content }}{% endfor %}{% if thinking %}<think>{% endif %}")
    oss = ("{%- macro system() %}{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}"
           "{%- endif %}Reasoning: {{ reasoning_effort }}{%- endmacro %}{{ system() }}")
    assert template_variables(v31).kwargs == ("thinking",) and template_variables(oss).kwargs == ("reasoning_effort",)
    with pytest.raises(ConfigError) as e:
        check_kwargs(v31, {"enable_thinking": False})
    assert str(e.value) == (
        "chat_template_kwargs: the chat template never reads `enable_thinking`, so it changes nothing (the data "
        "would be rendered as without it); the template reads `thinking` besides the variables every rendering "
        "passes. Use that name, or remove the key")
    check_kwargs(v31, {"thinking": True})


def test_a_rendering_flag_or_a_quoted_boolean_is_refused():
    """`add_generation_prompt` (or `messages`) would reach the render twice: a TypeError on every record. A quoted
    boolean is a non-empty string, true in a template: `thinking: "false"` renders thinking on."""
    kimi = (ROOT / "tests/fixtures/templates/kimi_k25.jinja").read_text()
    for key in ("add_generation_prompt", "messages"):
        with pytest.raises(ConfigError) as e:
            check_kwargs(kimi, {key: True})
        assert str(e.value) == (f"chat_template_kwargs: `{key}` is an argument of every rendering itself (the "
                                "conversation and its flags); remove the key. The template reads `thinking` besides "
                                "the variables every rendering passes")
    for value in ("false", "True", " FALSE "):
        with pytest.raises(ConfigError) as e:
            check_kwargs(kimi, {"thinking": value})
        assert str(e.value) == (f"chat_template_kwargs.thinking: {value!r} is a string, and a template takes every "
                                f"non-empty string for true ({value!r} included); write {value.strip().lower()} "
                                "without quotes")
    check_kwargs(kimi, {"thinking": False})
    # Kimi's `thinking is false` passes false alone: 0 left the data thinking-on
    for value in (0, 1, 0.0):
        with pytest.raises(ConfigError) as e:
            check_kwargs(kimi, {"thinking": value})
        assert str(e.value) == (f"chat_template_kwargs.thinking: {value!r} is a number, and the template tests "
                                "`thinking is false` or `thinking is true`, which only false or true pass "
                                f"({value!r} passes neither); write true or false")
    # a template that takes the number as a number (`if x`, `x > 0`) keeps it
    check_kwargs("{% if budget > 0 %}{{ budget }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}",
                 {"budget": 0})


def test_a_template_that_includes_others_is_checked_by_rendering_with_and_without_the_key():
    """`include` has no loader in transformers, so the variables of an included template cannot be listed: a key
    is refused only where the probe renderings are the same with and without it; without renderings (config
    check), it passes."""
    tok = make_tokenizer("qwen3")
    tok.chat_template = "{%- if false -%}{% include 'extra.jinja' %}{%- endif -%}" + tok.chat_template
    assert not template_variables(tok.chat_template).complete
    assert ChatMasker(tok, chat_template_kwargs={"enable_thinking": False}).renderer.kwargs == {
        "enable_thinking": False}
    with pytest.raises(ConfigError) as e:
        ChatMasker(tok, chat_template_kwargs={"enable_thinking": False, "thinking": False})
    assert str(e.value) == (
        "chat_template_kwargs: the chat template includes other templates (not read here), and `thinking` changes "
        "none of the probe renderings (a prompt, a turn with reasoning, a tool call and its result), so it changes "
        "nothing (the data would be rendered as without it); the template reads `enable_thinking` (in its own text; "
        "it includes other templates, not read here) besides the variables every rendering passes. Use that name, "
        "or remove the key")
    assert not check_kwargs(tok.chat_template, {"thinking": False}).complete  # no renderings: passes


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.chdir(tmp_path)
    write_model(tmp_path / "m")
    write_reference(tmp_path / "ref.pt")
    (tmp_path / "conv.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                                                  {"role": "assistant", "content": "a"}]}) + "\n")
    c = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    c.update(model="m", make_tiny_model=False, reference_sample="ref.pt", capture="custom", aux_layers=[1, 2, 3],
             aux_layers_convention="hidden_states", trust_remote_code=False)
    c["sources"] = [{"path": "conv.jsonl", "format": "messages", "weight": 1.0, "max_records": None}]
    return c


def test_config_check_refuses_a_key_the_template_never_reads(cfg: dict, tmp_path: Path):
    """Before any job runs: the template of the tokenizer directory (tokenizer_config.json or chat_template.jinja),
    or `chat_template`, or the tiny model's as the workflow builds it."""
    make_tokenizer("kimi_k25").save_pretrained(tmp_path / "m")
    cfg["chat_template_kwargs"] = {"enable_thinking": False}
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert str(e.value) == KIMI_ENABLE_THINKING
    cfg["chat_template_kwargs"] = {"thinking": False}
    assert check(cfg).settings.prepare.chat_template_kwargs == {"thinking": False}
    cfg["chat_template"] = (tmp_path / "qwen.jinja").as_posix()
    (tmp_path / "qwen.jinja").write_text(make_tokenizer("qwen3").chat_template)
    with pytest.raises(ConfigError, match="never reads `thinking`.* reads `enable_thinking` besides"):
        check(cfg)
    # the default run: the tiny model's Kimi-K2.5-shaped template, read before the workflow builds it
    default = {**cfg, "model": "resources/tiny-model", "make_tiny_model": True, "trust_remote_code": True,
               "chat_template": None, "chat_template_kwargs": {"enable_thinking": False}}
    with pytest.raises(ConfigError) as e:
        check(default)
    assert str(e.value) == KIMI_ENABLE_THINKING
    assert check({**default, "chat_template_kwargs": {"thinking": True}}).n_chunks == 1


def test_config_check_reads_every_named_template(cfg: dict, tmp_path: Path):
    """tokenizer_config.json's chat_template as a list of named templates: a key `tool_use` alone reads passes (the
    records with tools are rendered with it), one none reads is refused."""
    make_tokenizer("qwen3").save_pretrained(tmp_path / "m")
    tc = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    (tmp_path / "m" / "chat_template.jinja").unlink(missing_ok=True)
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
    tc["chat_template"] = [{"name": "default", "template": plain},
                           {"name": "tool_use", "template": make_tokenizer("qwen3").chat_template}]
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(tc))
    cfg["chat_template_kwargs"] = {"enable_thinking": False}
    assert check(cfg).settings.prepare.chat_template_kwargs == {"enable_thinking": False}
    cfg["chat_template_kwargs"] = {"thinking": False}
    with pytest.raises(ConfigError, match=r"^chat_template_kwargs: the chat template never reads `thinking`.* reads "
                                          r"`enable_thinking` besides"):
        check(cfg)


def test_named_templates_saved_by_transformers_5_are_read_and_hashed(tmp_path: Path):
    """transformers 5 saves the default template as chat_template.jinja and the others as
    additional_chat_templates/<name>.jinja: the config check reads them all, and the hashes that decide reruns
    and a dataset's identity change with any of them."""
    from hsextract import provenance
    from hsextract.masks.kwargs import stored_template

    tok = make_tokenizer("qwen3")
    qwen = tok.chat_template
    tok.chat_template = {"default": "{% for m in messages %}{{ m.content }}{% endfor %}", "tool_use": qwen}
    tok.save_pretrained(tmp_path / "m")
    tool_use = tmp_path / "m" / "additional_chat_templates" / "tool_use.jinja"
    assert tool_use.read_text() == qwen
    assert stored_template(tmp_path / "m") == {"default": "{% for m in messages %}{{ m.content }}{% endfor %}",
                                               "tool_use": qwen}
    check_kwargs(stored_template(tmp_path / "m"), {"enable_thinking": False})  # tool_use reads it
    before = (provenance.tokenizer_hash(str(tmp_path / "m")), provenance.chat_template_text(str(tmp_path / "m")))
    tool_use.write_text(qwen.replace("<tool_call>", "<tool_call> "))
    after = (provenance.tokenizer_hash(str(tmp_path / "m")), provenance.chat_template_text(str(tmp_path / "m")))
    assert before[0] != after[0] and before[1] != after[1]
