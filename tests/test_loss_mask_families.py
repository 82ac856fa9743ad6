"""Loss masks on templates shaped like each family models ship (tests/fixtures/templates), token by token,
through a fast tokenizer and its slow twin (same vocabulary, no offset mappings)."""

from __future__ import annotations

import datetime
import json

import pytest
import transformers.utils.chat_template_utils as hf_templates
from chatfix import (
    BOS,
    EOS,
    SPECIALS,
    SYS,
    TEMPLATES,
    A,
    U,
    make_slow_tokenizer,
    make_tokenizer,
    tokenizer_with,
    trained_segments,
)
from mask_golden import EXPECTED

from hsextract.masks.explain import marked
from hsextract.masks.ids import common_prefix, common_suffix
from hsextract.masks.locators import LOCATORS
from hsextract.masks.masker import ChatMasker
from hsextract.masks.probe import SENT
from hsextract.masks.refusals import TemplateError
from hsextract.masks.rendering import content_format
from hsextract.masks.turns import Frame, find_turn
from hsextract.prepare.conversations import Conversation, normalize_record

CONVS = {
    "single": Conversation([U("Hello there!"), A("How are you today?")]),
    "system": Conversation([SYS, U("Hello there!"), A("How are you today?", "The user greets.")]),
    "multi": Conversation([U("Hello there!"), A("How are you today?", "The user greets."),
                           U("What is two plus two?"), A("Two plus two is four.", "Add them.")]),
    "tool": Conversation([SYS, U("What is the weather in Paris?"),
                          A("", "Let me think.", [("get_weather", {"city": "Paris"})]),
                          {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "c1"},
                          A("The weather in Paris is sunny.", "21 degrees.")]),
    "empty": Conversation([U("Hello there!"), A("", "Nothing to say."), U("What is two plus two?"), A("Four.")]),
    "unicode": Conversation([U("Ça va? 日本語"), A("Très bien ✓ 日本", "Répondre poliment.")]),
}
FLAGS = {"default": {}, "neither": {"train_on_eot": False, "train_on_reasoning": False}}
FAMILIES = ["harmony", "llama3", "qwen3", "kimi_k25", "deepseek_v31", "mistral", "gemma3", "deepseek_r1", "qwq",
            "glm45", "glm47", "phi3", "gemma4"]
# conversations a template refuses, with its words or ours (the exact masks of the others are in mask_golden)
OPENED = ("TemplateError: assistant turn {}: the generation prompt opens a reasoning block ('<think>') that the "
          "template never renders for an assistant turn, and this turn has no reasoning to fill it: give it "
          "`reasoning_content`, or its raw text with '</think>' in `content` (or regenerate the responses with "
          "this model)")
NO_TOOLS = ("TemplateError: assistant turn 2: the chat template does not render its tool calls, so its sample "
            "would train an empty turn: set a `chat_template` that renders tool calls, or leave conversations with "
            "tool calls out")
THINKING_OFF = ("TemplateError: assistant turn 2: the template is not prefix-stable: the turn rendered does not start "
                "with the generation prompt the server saw (first difference at token 41: prompt '<channel|>' vs turn "
                "'Let me think.'). Set `chat_template_kwargs` (e.g. enable_thinking / thinking) to match the data, or "
                "fix the data's reasoning fields")
REFUSED = {
    "gemma3": {"tool": NO_TOOLS},
    "gemma4": {"tool": THINKING_OFF},  # reasoning in a tool-call turn, a prompt that closed the thought channel
    "phi3": {"tool": NO_TOOLS},
    "deepseek_r1": {"single": OPENED.format(1), "empty": OPENED.format(3)},
    "qwq": {"single": OPENED.format(1), "empty": OPENED.format(3)},
}


@pytest.fixture(scope="module", params=["fast", "slow"])
def kind(request):
    return request.param


def _tok(family, kind):
    return make_tokenizer(family) if kind == "fast" else make_slow_tokenizer(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_masks(family, kind):
    tok = _tok(family, kind)
    assert tok.is_fast == (kind == "fast")
    for (flags, name), want in EXPECTED[family].items():
        samples = ChatMasker(tok, **FLAGS[flags]).encode(CONVS[name])
        assert [marked(s, tok) for s in samples] == want, (family, flags, name)
        for s in samples:  # the ids are the tokenization of the text they decode to
            text = tok.decode(s.input_ids, spaces_between_special_tokens=False)
            assert s.input_ids == tok(text, add_special_tokens=False)["input_ids"]


def _encoded(tok, conv, **kw):
    """The samples' (ids, mask, turn), or the error's text where the conversation is refused."""
    try:
        return [(s.input_ids, s.loss_mask, s.turn) for s in ChatMasker(tok, **kw).encode(conv)]
    except Exception as e:  # noqa: BLE001 - a template's own raise_exception (Gemma: no tool role) or ours
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_slow_masks_equal_fast_masks(family):
    fast, slow = make_tokenizer(family), make_slow_tokenizer(family)
    refused = {}
    for flags in FLAGS.values():
        for split in ("auto", "never", "always"):
            for name, conv in CONVS.items():
                a = _encoded(fast, conv, split_turns=split, **flags)
                assert a == _encoded(slow, conv, split_turns=split, **flags)
                if isinstance(a, str):
                    refused[name] = a
    assert refused == REFUSED.get(family, {})


@pytest.mark.parametrize("family", FAMILIES)
def test_sentinels_change_nothing_outside_their_turn(family):
    """The content sentinels that find where a turn's text starts and ends change no token outside the turn:
    two renders with different sentinels are identical before the generation prompt's end and after the stop."""
    m = ChatMasker(make_tokenizer(family))
    checked = 0
    for conv in CONVS.values():
        if isinstance(_encoded(m.tokenizer, conv), str):
            continue  # refused (REFUSED)
        for j, msg in enumerate(conv.messages):
            if msg["role"] != "assistant":
                continue
            frame = list(conv.messages[:j + 1])
            x = m.renderer.render_ids(frame)
            p = m.renderer.render_ids(frame[:j], add_generation_prompt=True)
            if x[:len(p)] != p:
                continue  # history rewritten before the turn: covered by the exact masks
            sp = find_turn(m.renderer, Frame(frame, None, j, x), len(p))
            renders = []
            for sent in SENT:
                try:
                    renders.append(m.renderer.render_ids(frame[:j] + [{**msg, "content": sent}]))
                except Exception:  # noqa: BLE001 - harmony refuses content next to thinking in a tool call
                    pass
            if len(renders) == 2:
                a, b = renders
                assert common_prefix(a, b) >= sp.prompt_end, (family, j)
                assert len(a) - common_suffix(a, b) <= len(a) - (len(x) - sp.end), (family, j)
                checked += 1
    # R1 and QwQ: a turn after a prompt that opens reasoning is no prefix of its rendering, nor is one after
    # Gemma-4's prompt that closes an empty thought channel (the exact masks cover those)
    assert checked >= (0 if family in ("deepseek_r1", "qwq", "gemma4") else 6)


def test_split_counts_and_cost_in_tokens():
    tok = make_tokenizer("qwen3")
    m = ChatMasker(tok)
    samples = m.encode(CONVS["multi"])
    (whole,) = ChatMasker(tok, split_turns="never").encode(CONVS["multi"])
    assert [s.turn for s in samples] == [1, 3]
    assert dict(m.stats) == {"conversations": 1, "turns": 2, "split_conversations": 1, "samples": 2}
    # The cost: the first turn's context is stored twice.
    assert sum(len(s.input_ids) for s in samples) > len(whole.input_ids)
    m2 = ChatMasker(tok, split_turns="never")
    m2.encode(CONVS["multi"])
    assert m2.stats["turns_history_fallback"] == 1 and m2.stats["samples"] == 1
    # Llama never rewrites history: auto keeps one sample; always splits anyway.
    assert len(ChatMasker(make_tokenizer("llama3")).encode(CONVS["multi"])) == 1
    assert [s.turn for s in ChatMasker(make_tokenizer("llama3"), split_turns="always").encode(CONVS["multi"])] == [1, 3]


def test_reasoning_passed_under_the_field_the_template_reads():
    m = ChatMasker(make_tokenizer("harmony"))
    assert m.renderer.reasoning_fields == ("thinking",)
    assert ChatMasker(make_tokenizer("qwen3")).renderer.reasoning_fields == ("reasoning_content",)
    text = m.render(CONVS["system"].messages)
    assert "<|channel|>analysis<|message|>The user greets.<|end|>" in text


def test_template_refusing_empty_content_with_thinking_gets_the_record_without_content():
    tok = make_tokenizer("harmony")
    msgs = [dict(m) for m in CONVS["tool"].messages]
    prepared = ChatMasker(tok).renderer._prepare(msgs[2], False)
    with pytest.raises(Exception, match="Cannot pass both content and thinking"):
        tok.apply_chat_template(msgs[:2] + [prepared], tokenize=False)
    assert "Let me think." in ChatMasker(tok).render(msgs[:3])


def test_a_turn_rendered_as_its_stop_token_alone_is_not_trained():
    """A turn of reasoning and no content: where the template renders the reasoning (Kimi-K2.5, thinking on), it is
    the turn (with train_on_reasoning false only its stop token is trained); where it does not (Llama 3,
    DeepSeek-V3.1 and Kimi-K2.5 with thinking off), trained it would teach the model to stop right after the
    prompt: it is not (its own sample not stored when split; untrained in the whole rendering), counted in
    `turns_empty`. A conversation of such turns only is refused, as prepare refuses an empty content without
    reasoning."""
    tok = make_tokenizer("kimi_k25")
    (s,) = ChatMasker(tok, train_on_reasoning=False, split_turns="never").encode(CONVS["empty"])
    assert marked(s, tok).count("⟦<|im_end|>⟧") == 1
    for family, kwargs, stop in [("llama3", {}, "<|eot_id|>"), ("deepseek_v31", {}, "<｜end▁of▁sentence｜>"),
                                 ("kimi_k25", {"thinking": False}, "<|im_end|>")]:
        tok = make_tokenizer(family)
        for split in ("never", "auto", "always"):
            m = ChatMasker(tok, chat_template_kwargs=kwargs, split_turns=split)
            got = [marked(s, tok) for s in m.encode(CONVS["empty"])]
            assert "".join(got).count("⟦") == 1 and got[-1].endswith(f"⟦Four.{stop}⟧"), (family, split, got)
            assert m.stats["turns_empty"] == 1 and m.stats["samples"] == 1, (family, split)
            with pytest.raises(TemplateError) as e:
                m.encode(Conversation(CONVS["empty"].messages[:2]))
            assert e.value.reason == "empty_turn" and str(e.value) == (
                "assistant turn 1: its content is empty and the chat template does not render its reasoning (with "
                "these `chat_template_kwargs`), so its sample would train only the stop token right after the "
                "prompt, and the conversation has no other turn to train. Give the turn content, have its "
                "reasoning rendered (`chat_template_kwargs`, e.g. thinking on), or leave it out")


def test_turns_given_weight_zero_are_context_in_every_split_mode():
    """OpenAI's `weight: 0` on an assistant message: the turn stays in the context of later ones, never trained
    (counted in `turns_weight_0`); a conversation whose every turn has weight 0 trains nothing (prepare drops it:
    no_trained_tokens)."""
    record = {"messages": [{"role": "user", "content": "Hello there!"},
                           {"role": "assistant", "content": "Go away.", "weight": 0},
                           {"role": "user", "content": "What is two plus two?"},
                           {"role": "assistant", "content": "Two plus two is four.", "weight": 1}]}
    conv = normalize_record(record)
    for family, stop in [("llama3", "<|eot_id|>"), ("kimi_k25", "<|im_end|>")]:
        tok = make_tokenizer(family)
        for split in ("never", "auto", "always"):
            m = ChatMasker(tok, split_turns=split)
            got = [marked(s, tok) for s in m.encode(conv)]
            assert len(got) == 1 and got[0].count("⟦") == 1, (family, split, got)
            assert "Go away." in got[0] and f"Two plus two is four.{stop}⟧" in got[0], (family, split, got)
            assert m.stats["turns_weight_0"] == 1 and m.stats["samples"] == 1, (family, split)
            none = normalize_record({"messages": [*record["messages"][:3],
                                                  {**record["messages"][3], "weight": 0}]})
            (s,) = m.encode(none)
            assert sum(s.loss_mask) == 0 and m.stats["turns_weight_0"] == 3, (family, split)


def test_thinking_switches():
    # Kimi with thinking off: the empty block is in the prompt, nothing of it is trained.
    tok = make_tokenizer("kimi_k25")
    (s,) = ChatMasker(tok, chat_template_kwargs={"thinking": False}).encode(CONVS["single"])
    assert marked(s, tok).endswith(
        "<|im_assistant|>assistant<|im_middle|><think></think>⟦How are you today?<|im_end|>⟧")
    # DeepSeek-V3.1 with thinking on: the prompt opens <think>, no turn is ever rendered with it, the template
    # writes </think> + content: the reasoning goes before that </think>, as the model writes it.
    tok = make_tokenizer("deepseek_v31")
    m = ChatMasker(tok, chat_template_kwargs={"thinking": True})
    (s,) = m.encode(CONVS["system"])
    assert marked(s, tok) == ("<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello there!<｜Assistant｜>"
                              "<think>⟦The user greets.</think>How are you today?<｜end▁of▁sentence｜>⟧")
    assert m.stats["reasoning_inserted"] == 1
    # a turn without reasoning: the template renders it `</think>` + content; after the prompt's `<think>` the model
    # wrote that closer itself, trained as the (empty) reasoning block it ends
    (s,) = m.encode(CONVS["single"])
    assert marked(s, tok) == ("<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜><think>"
                              "⟦</think>How are you today?<｜end▁of▁sentence｜>⟧")
    assert m.stats["reasoning_inserted"] == 1


@pytest.mark.parametrize("family,kwargs,stops,auto", [
    ("deepseek_v31", {"thinking": True}, ["<｜end▁of▁sentence｜>"] * 2, [[0], [1]]),
    ("glm47", {}, ["<|user|>", None], [[0], [1]]),  # GLM writes no stop token: the next header, none after the last
    # Kimi-K2.5 (thinking is its default): prefix-stable, the prompt's `<think>` then `</think>` + content
    ("kimi_k25", {}, ["<|im_end|>"] * 2, [[0, 1]]),
    ("kimi_k25", {"thinking": True}, ["<|im_end|>"] * 2, [[0, 1]])])
def test_a_closer_the_model_wrote_after_the_prompts_opener_is_trained_in_every_split_mode(family, kwargs, stops,
                                                                                           auto):
    """The generation prompt opens `<think>` and the template renders a turn without reasoning as `</think>` +
    content (DeepSeek-V3.1 with `thinking: true`, GLM-4.7), or as `<think></think>` + content with the prompt a
    prefix of it (Kimi-K2.5): the model wrote that `</think>`, so it is trained as the reasoning block it ends
    (with `train_on_reasoning`; untrained without), whether each turn is its own sample (`auto` where the template
    rewrites history, `always`) or located in the whole rendering (`never`, `auto` where it does not): the same
    kinds on the same tokens."""
    tok = make_tokenizer(family)
    conv = Conversation([U("Hello there!"), A("How are you today?"), U("What is two plus two?"), A("Four.")])
    for flags, closer in (({}, "reasoning"), ({"train_on_reasoning": False}, "untrained")):
        turns = [[(closer, "</think>"), ("body", body)] + ([("eot", stop)] if stop else [])
                 for body, stop in zip(("How are you today?", "Four."), stops, strict=True)]
        for split, per_sample in (("auto", auto), ("always", [[0], [1]]), ("never", [[0, 1]])):
            m = ChatMasker(tok, chat_template_kwargs=kwargs, split_turns=split, **flags)
            samples = m.encode(conv)
            got = [[(k, tok.decode(s.input_ids[a:b])) for sp in s.spans for a, b, k in
                    sp.labels(m.train_on_reasoning, True)] for s in samples]
            assert got == [sum((turns[t] for t in ts), []) for ts in per_sample], (split, flags)
            for s in samples:
                assert trained_segments(s, tok) == ["".join(text for k, text in turn if k != "untrained")
                                                    for turn in (turns[t.index // 2] for t in s.spans)]


def test_kimi_turn_without_reasoning_trains_the_closer_after_the_prompts_opener_never_the_opener():
    """Kimi-K2.5 with thinking on prompts `<think>` and renders a turn without reasoning `<think></think>` + answer:
    the `</think>` is the model's, trained iff `train_on_reasoning`, the same in every split mode; the opener is the
    prompt's. With thinking off the prompt holds the whole `<think></think>`: nothing of it is trained."""
    tok = make_tokenizer("kimi_k25")
    head = "<|im_assistant|>assistant<|im_middle|>"
    body = len(tok("How are you today?", add_special_tokens=False)["input_ids"])
    for kwargs, reasoning, tail in (
            ({}, True, "<think>⟦</think>How are you today?<|im_end|>⟧"),
            ({"thinking": True}, True, "<think>⟦</think>How are you today?<|im_end|>⟧"),
            ({"thinking": True}, False, "<think></think>⟦How are you today?<|im_end|>⟧"),
            ({"thinking": False}, True, "<think></think>⟦How are you today?<|im_end|>⟧"),
            ({"thinking": False}, False, "<think></think>⟦How are you today?<|im_end|>⟧")):
        for split in ("auto", "always", "never"):
            m = ChatMasker(tok, chat_template_kwargs=kwargs, train_on_reasoning=reasoning, split_turns=split)
            (s,) = m.encode(CONVS["single"])
            assert marked(s, tok).rsplit(head, 1)[1] == tail, (kwargs, reasoning, split)
            # the answer, <|im_end|>, and </think> where it is trained (one token each)
            assert sum(s.loss_mask) == body + 1 + ("⟦</think>" in tail), (kwargs, reasoning, split)


def test_prompt_that_closes_a_block_it_never_opened():
    """Kimi-shaped, with a generation prompt that writes the closer alone when thinking is off (`<|im_middle|></think>`,
    as some Kimi-K2.5 prompts are quoted) while every rendered turn has `<think></think>`: the model wrote the
    answer right after that `</think>`; the rendering's empty block is not the model's."""
    tok = make_tokenizer("kimi_k25")
    old = "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    assert tok.chat_template.count(old) == 1
    tok.chat_template = tok.chat_template.replace(old, old.replace("<think></think>", "</think>"))
    m = ChatMasker(tok, chat_template_kwargs={"thinking": False})
    (s,) = m.encode(CONVS["single"])
    assert marked(s, tok).endswith("<|im_assistant|>assistant<|im_middle|></think>⟦How are you today?<|im_end|>⟧")
    prompt = m.render(CONVS["single"].messages[:1], add_generation_prompt=True)
    assert s.input_ids == tok(prompt + "How are you today?<|im_end|>", add_special_tokens=False)["input_ids"]
    never = ChatMasker(tok, chat_template_kwargs={"thinking": False}, split_turns="never")
    (s,) = never.encode(CONVS["single"])  # the rendering, its empty block untrained
    assert marked(s, tok).endswith("<|im_assistant|>assistant<|im_middle|><think></think>⟦How are you today?"
                                   "<|im_end|>⟧")


@pytest.mark.parametrize("family", ["deepseek_r1", "qwq"])
def test_prompt_that_opens_reasoning_gets_the_turns_reasoning_in_any_form(family):
    """R1 and QwQ end the generation prompt with `<think>\\n` and cut everything up to `</think>` from every
    assistant turn: each turn's sample is its prompt, then the reasoning, `</think>`, the blank line and the answer
    the model wrote. The data may hold the reasoning as a field or inline (with or without the opener): the same
    sample; inline text that departs from the usual layout is kept as written."""
    tok = make_tokenizer(family)
    tail = U("What is two plus two?"), A("Four.", "Add.")
    forms = [A("How are you today?", "The user greets."),
             {"role": "assistant", "content": "<think>\nThe user greets.\n</think>\n\nHow are you today?"},
             {"role": "assistant", "content": "The user greets.\n</think>\n\nHow are you today?"}]
    got = [ChatMasker(tok).encode(Conversation([U("Hello there!"), a, *tail])) for a in forms]
    (first, second), rest = got[0], got[1:]
    assert all([(s.input_ids, s.loss_mask) for s in r][:1] == [(first.input_ids, first.loss_mask)] for r in rest)
    m = ChatMasker(tok)
    prompt = tok(m.render([U("Hello there!")], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert first.input_ids[:len(prompt)] == prompt and tok.decode(prompt).endswith("<think>\n")
    assert trained_segments(first, tok) == ["The user greets.\n</think>\n\nHow are you today?" + EOS[family]]
    assert trained_segments(second, tok) == ["Add.\n</think>\n\nFour." + EOS[family]]
    (odd, _) = ChatMasker(tok).encode(Conversation([
        U("Hello there!"), {"role": "assistant", "content": "<think>The user greets.</think>How are you today?"},
        *tail]))
    assert trained_segments(odd, tok) == ["The user greets.</think>How are you today?" + EOS[family]]
    (s,) = ChatMasker(tok, train_on_reasoning=False, train_on_eot=False).encode(Conversation([U("Hello there!"),
                                                                                              forms[0]]))
    assert trained_segments(s, tok) == ["How are you today?"]
    # Unsplit, the full rendering has no reasoning and no <think>: the turns are trained as it renders them.
    never = ChatMasker(tok, split_turns="never")
    (s,) = never.encode(Conversation([U("Hello there!"), forms[0], *tail]))
    assert trained_segments(s, tok) == ["How are you today?" + EOS[family], "Four." + EOS[family]]
    assert dict(never.stats) == {"conversations": 1, "turns": 2, "turns_history_fallback": 2, "samples": 1,
                                 "reasoning_not_rendered": 2}


def test_harmony_history_rewrite_is_split_and_never_mode_falls_back():
    tok = make_tokenizer("harmony")
    m = ChatMasker(tok, split_turns="never")
    (s,) = m.encode(CONVS["multi"])
    # In the full rendering the first answer is history (<|end|>, reasoning dropped): trained as shown there.
    assert marked(s, tok) == (
        "<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>Hello there!<|end|>"
        "<|start|>assistant⟦<|channel|>final<|message|>How are you today?<|end|>⟧<|start|>user<|message|>"
        "What is two plus two?<|end|><|start|>assistant⟦<|channel|>analysis<|message|>Add them.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Two plus two is four.<|return|>⟧")
    assert m.stats["turns_history_fallback"] == 1


def test_harmony_call_after_the_turns_reasoning_trains_the_call_messages_header():
    """A harmony turn of reasoning then a tool call: after its analysis message the model writes the call's
    message itself, header included (`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`):
    trained, whatever `train_on_reasoning` says, token by token after the prompt. Unsplit (`never`), the full
    rendering drops the analysis of calls followed by a final answer, and each call is located there, after the
    tool result before it (not in a later turn), trained as rendered."""
    tok = make_tokenizer("harmony")
    conv = Conversation([U("Weather?"), A("", "Let me think.", [("get_weather", {"city": "Paris"})]),
                         {"role": "tool", "content": "21", "tool_call_id": "c1"},
                         A("", "Now the time.", [("get_time", {})]),
                         {"role": "tool", "content": "noon", "tool_call_id": "c2"}, A("Sunny.", "Done.")])
    call = [("header", "<|start|>assistant"),
            ("body", ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'),
            ("eot", "<|call|>")]
    second = [("header", "<|start|>assistant"),
              ("body", " to=functions.get_time<|channel|>commentary json<|message|>{}"), ("eot", "<|call|>")]
    final = [("header", "<|start|>assistant<|channel|>final<|message|>"), ("body", "Sunny."), ("eot", "<|return|>")]
    for flags, kind in (({}, "reasoning"), ({"train_on_reasoning": False}, "untrained")):
        m = ChatMasker(tok, **flags)
        samples = m.encode(conv)
        assert [s.turn for s in samples] == [1, 3, 5]
        for s, analysis, rest in zip(samples, ("Let me think.", "Now the time.", "Done."), (call, second, final),
                                     strict=True):
            (sp,) = s.spans
            prompt = m.renderer.render_ids(conv.messages[:s.turn], add_generation_prompt=True)
            labels = [(k, tok.decode(s.input_ids[a:b])) for a, b, k in sp.labels(m.train_on_reasoning, True)]
            assert s.input_ids[:sp.prompt_end] == prompt and sp.end == len(s.input_ids)
            assert labels == [(kind, f"<|channel|>analysis<|message|>{analysis}<|end|>"), *rest]
            first = sp.prompt_end if kind == "reasoning" else sp.header_start  # the call's header on: trained
            assert s.loss_mask == [0] * first + [1] * (len(s.input_ids) - first)
        never = ChatMasker(tok, split_turns="never", **flags)
        (s,) = never.encode(conv)
        assert [[(k, tok.decode(s.input_ids[a:b])) for a, b, k in sp.labels(never.train_on_reasoning, True)]
                for sp in s.spans] == [call[1:], second[1:], [(kind, "<|channel|>analysis<|message|>Done.<|end|>"),
                                                               *final]]
        assert never.stats["turns_unlocated"] == 0 and never.stats["turns_history_fallback"] == 3


def test_piecewise_tokenization_is_checked_against_whole_tokenization():
    from chatfix import TEMPLATES, _tokenizer_object
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_str(_tokenizer_object().to_str())
    # `<|im_end|>` eats the whitespace after it: pieces cut at added tokens no longer tokenize like the whole.
    raw.add_special_tokens([AddedToken(t, rstrip=(t == "<|im_end|>"), special=True) for t in
                            ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>",
                                  chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    m = ChatMasker(tok, split_turns="never")
    (s,) = m.encode(CONVS["system"])
    assert s.input_ids == tok(s.text, add_special_tokens=False)["input_ids"]
    assert m.renderer.notes == ["piecewise tokenization differs from whole tokenization: tokenizing whole texts"]
    assert marked(s, tok).endswith("<think>\nThe user greets.\n</think>\n\nHow are you today?<|im_end|>⟧")


def test_system_prompt_in_the_last_user_message_split_as_the_server_saw_it():
    """Mistral-v0.3-style templates put the system prompt into the last user message only: the prompt of turn j
    holds it, the turn rendered last and the whole conversation do not, and the template has no generation
    prompt to find the turn by. Each turn's sample is its prompt as the server saw it plus the turn."""
    tok = make_tokenizer("mistral")
    conv = Conversation([SYS, U("Hello there!"), A("How are you today?"), U("What is two plus two?"),
                         A("Two plus two is four.")])
    m = ChatMasker(tok)
    samples = m.encode(conv)
    assert [s.turn for s in samples] == [2, 4]
    for s, j, turn in zip(samples, (2, 4), (" How are you today?</s>", " Two plus two is four.</s>"), strict=True):
        prompt = tok(m.render(conv.messages[:j], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        assert s.input_ids[:len(prompt)] == prompt and "You are a helpful assistant." in tok.decode(prompt)
        assert trained_segments(s, tok) == [turn]
        assert s.loss_mask == [0] * len(prompt) + [1] * (len(s.input_ids) - len(prompt))
    assert m.stats["turns_after_rewritten_history"] == 2
    # Unsplit, both turns are located in the rendering without the system prompt (which has none).
    never = ChatMasker(tok, split_turns="never")
    (s,) = never.encode(conv)
    assert marked(s, tok) == ("<s>[INST] Hello there![/INST]⟦ How are you today?</s>⟧[INST] What is two plus two?"
                              "[/INST]⟦ Two plus two is four.</s>⟧")
    assert never.stats["turns_history_fallback"] == 2 and never.stats["turns_unlocated"] == 0


@pytest.mark.parametrize("family", ["glm45", "glm47"])
def test_template_without_a_stop_token_trains_the_next_header_the_model_stops_with(family):
    """GLM-4.5/4.7 write no token after an assistant turn: the model stops by writing the next message's header
    (`<|user|>`, `<|observation|>`: stop ids of its generation config). That header is the turn's stop token
    (trained with `train_on_eot`) wherever a message follows the turn; the `</tool_call>` closing a call is the
    call's own markup, trained with it whatever `train_on_eot` says; a turn that ends the conversation has no
    stop in the data."""
    tok = make_tokenizer(family)
    facts = ChatMasker(tok).renderer.facts()
    ids = tok.convert_tokens_to_ids
    assert not facts.writes_stop
    assert facts.next_stops == (("user", ids("<|user|>")), ("tool", ids("<|observation|>")))
    assert facts.stop_ids == {ids("<|endoftext|>"), ids("<|user|>"), ids("<|observation|>")}
    nl = "\n" if family == "glm45" else ""
    # without reasoning, GLM-4.5 writes an empty think block before the turn's text (filler, untrained); GLM-4.7
    # writes `</think>` after the prompt's `<think>`: the model's closer, trained as reasoning
    c = "</think>" if family == "glm47" else ""
    calls = (f"<tool_call>get_weather{nl}<arg_key>city</arg_key>{nl}<arg_value>Paris</arg_value>{nl}<arg_key>days"
             f"</arg_key>{nl}<arg_value>2</arg_value>{nl}</tool_call>{nl}<tool_call>get_time{nl}</tool_call>")
    conv = Conversation([U("What is the weather in Paris?"),
                         A("", None, [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
                         {"role": "tool", "content": "21"}, {"role": "tool", "content": "noon"},
                         A("Sunny at noon."), U("Thanks!"), A("You are welcome.")])
    turns = [[c + calls + "<|observation|>"], [c + "Sunny at noon.<|user|>"], [c + "You are welcome."]]
    # GLM-4.7's prompt ends with `<think>`, its history renders a turn without reasoning `</think>` + text: each
    # turn's prompt is in no later rendering, so `auto` splits
    splits = ("always", "auto") if family == "glm47" else ("always",)
    for split in ("auto", "never", "always"):
        got = [trained_segments(s, tok) for s in ChatMasker(tok, split_turns=split).encode(conv)]
        assert got == (turns if split in splits else [sum(turns, [])]), (family, split)
    got = [trained_segments(s, tok) for s in ChatMasker(tok, train_on_eot=False).encode(conv)]
    assert sum(got, []) == [c + calls, c + "Sunny at noon.", c + "You are welcome."]
    # A split turn's own sample ends with the header the model wrote after it; the last turn's has none.
    samples = ChatMasker(tok, split_turns="always").encode(conv)
    assert [tok.convert_ids_to_tokens(s.input_ids[-1]) for s in samples[:2]] == ["<|observation|>", "<|user|>"]
    assert tok.decode(samples[2].input_ids).endswith("You are welcome.")


@pytest.mark.parametrize("family", FAMILIES)
def test_turn_whose_text_holds_a_stop_token_is_refused(family):
    """The model stops at its stop token: an assistant turn whose content or reasoning holds one (eos here) was
    not generated as written; a user message may hold it (the server's prompt holds it as well)."""
    tok = make_tokenizer(family)
    m = ChatMasker(tok)
    eos = EOS[family]
    for key, turn in (("content", A(f"Four.{eos}Thanks")), ("reasoning_content", A("Four.", f"x{eos}y"))):
        with pytest.raises(TemplateError) as e:
            m.encode(Conversation([U("What is two plus two?"), turn]))
        at = turn[key].index(EOS[family])
        assert str(e.value).startswith(f"assistant turn 1: its {key} holds {EOS[family]!r} (at character {at}), a "
                                       "token that ends a turn") and e.value.reason == "stop_token_in_turn"
    with pytest.raises(TemplateError) as e:  # data exported with the stop token it already ends with
        m.encode(Conversation([U("What is two plus two?"), A(f"Four.{eos}\n")]))
    assert str(e.value) == (f"assistant turn 1: its content ends with {eos!r}, a token that ends a turn, which the "
                            "template writes itself: strip it from the data")
    (s,) = m.encode(Conversation([U(f"Say {EOS[family]}"), A("Four.", "Add.")]))
    assert "Four." in trained_segments(s, tok)[-1]


# the markup each template writes around a plain exchange's messages (TemplateRenderer.markup_texts)
MARKUP = {
    "harmony": ["<|start|>", "<|message|>", "<|channel|>"], "llama3": ["<|start_header_id|>", "<|end_header_id|>"],
    "qwen3": ["<|im_start|>"], "qwq": ["<|im_start|>"],
    "kimi_k25": ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"],
    "deepseek_v31": ["<｜User｜>", "<｜Assistant｜>"], "deepseek_r1": ["<｜User｜>", "<｜Assistant｜>"],
    "mistral": ["[INST]", "[/INST]"], "gemma3": ["<start_of_turn>"], "gemma4": ["<|turn>"],
    "glm45": ["[gMASK]", "<sop>", "<|system|>", "<|assistant|>"],
    "glm47": ["[gMASK]", "<sop>", "<|system|>", "<|assistant|>"],
    "phi3": ["<|system|>", "<|user|>", "<|assistant|>"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_turn_whose_text_holds_the_template_s_markup_is_refused(family):
    """An answer followed by a made-up next turn whose stop was cut (`Answer.<|im_user|>user<|im_middle|>more?`):
    the tokenizer reads the header as its special token, which the model writes only after a stop; trained, it
    would teach a turn that goes on into the next. A user message may hold it (the server's prompt does too)."""
    from hsextract.masks.rendering import TemplateRenderer

    tok = make_tokenizer(family)
    assert TemplateRenderer(tok).markup_texts() == MARKUP[family]
    m = ChatMasker(tok)
    mark = MARKUP[family][-1]
    for key, turn in (("content", A(f"Answer.{mark}user more?")), ("reasoning_content", A("Four.", f"x{mark}y"))):
        with pytest.raises(TemplateError) as e:
            m.encode(Conversation([U("What is two plus two?"), turn]))
        assert str(e.value) == (
            f"assistant turn 1: its {key} holds {mark!r} (at character {turn[key].index(mark)}), the template's own "
            "markup around messages, which the tokenizer reads as that special token wherever it is written: the "
            "model writes it only between turns, so the turn was not generated as written (a made-up next turn, or "
            "text that quotes the markup). Cut or rewrite the text there, or regenerate the responses with this "
            "model") and e.value.reason == "markup_in_turn"
    (s,) = m.encode(Conversation([U(f"Say {mark}"), A("Four.", "Add.")]))
    assert "Four." in trained_segments(s, tok)[-1]


@pytest.mark.parametrize("family", ["kimi_k25", "qwen3"])
def test_a_tool_call_whose_arguments_hold_a_stop_token_or_a_closer_in_reasoning_is_refused(family):
    """The calls' names and arguments are the turn's own text too (refused naming them, not blaming the template);
    a reasoning closer inside the reasoning ends it there: the rest was not generated as reasoning."""
    tok = make_tokenizer(family)
    m = ChatMasker(tok)
    eos = EOS[family]
    turn = A("", None, [("get_weather", {"city": f"Paris{eos}"})])
    with pytest.raises(TemplateError) as e:
        m.encode(Conversation([U("Weather?"), turn, {"role": "tool", "content": "21"}, A("Sunny.")]))
    assert str(e.value).startswith(f"assistant turn 1: its tool_calls[0].function.arguments holds {eos!r} (at "
                                   "character 15), a token that ends a turn") and e.value.reason == "stop_token_in_turn"
    with pytest.raises(TemplateError) as e:
        m.encode(Conversation([U("Weather?"), A("Sunny.", "It is </think> fake answer")]))
    assert str(e.value) == (
        "assistant turn 1: its reasoning_content holds '</think>' (at character 6), the token that ends a reasoning "
        "block: the model's reasoning ends at the first, so the rest was not generated as reasoning. Move the text "
        "after it to the content, or cut it") and e.value.reason == "reasoning_in_content"
    for exported in ("<think>\nLook.\n</think>", "Look.\n</think>\n", "<think>Look."):  # the template's own tags
        with pytest.raises(TemplateError) as e:
            m.encode(Conversation([U("Weather?"), A("Sunny.", exported)]))
        tag = "<think>" if exported.startswith("<think>") else "</think>"
        assert str(e.value) == (f"assistant turn 1: its reasoning_content is written with the tag {tag!r}, which the "
                                "template writes around it itself: strip the tags from the data")


def test_tool_calls_and_results_a_template_drops_are_refused():
    """Phi-3's template renders a tool-call turn as if it had no calls (trained, its sample would teach the stop
    token right after the prompt, or the content without the calls) and drops the `tool` role (the turn after a
    result would be trained without it in its context). Templates that render them are fine; every other family
    renders tool results (Gemma-3 refuses the role in its own words)."""
    calls = Conversation([U("What is the weather in Paris?"),
                          A("Let me check.", None, [("get_weather", {"city": "Paris"})])])
    result = Conversation([U("What is the weather in Paris?"), A("I will look it up."),
                           {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "c1"}, A("Sunny.")])
    for conv, reason, message in (
            (calls, "tool_calls_not_rendered",
             "assistant turn 1: the chat template does not render its tool calls, so its sample would train the "
             "content without them: set a `chat_template` that renders tool calls, or leave conversations with "
             "tool calls out"),
            (result, "tool_results_not_rendered",
             "message 2 (tool): the chat template does not render tool messages, so the turns after it would be "
             "trained without the tool result in their context: set a `chat_template` that renders them, or leave "
             "conversations with tool messages out")):
        with pytest.raises(TemplateError) as e:
            ChatMasker(make_tokenizer("phi3")).encode(conv)
        assert (str(e.value), e.value.reason) == (message, reason)
    for family in ("qwen3", "glm45", "llama3"):
        tok = make_tokenizer(family)
        (s,) = ChatMasker(tok).encode(calls)
        assert "get_weather" in "".join(trained_segments(s, tok)), family
    assert [f for f in FAMILIES if not ChatMasker(make_tokenizer(f)).renderer.facts().renders_tool_results] == [
        "phi3"]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in REFUSED or "tool" not in REFUSED[f]])
def test_tool_call_arguments_as_a_json_string_render_as_the_object(family):
    """OpenAI-format data writes a call's arguments as a JSON string; SGLang and vLLM parse it before rendering
    (GLM's template iterates the object, Llama's and Qwen's serialise it with `tojson`). The sample is the one
    the object gives; a string that is no JSON object reaches the template as written."""
    tok = make_tokenizer(family)

    def sample(args):
        conv = Conversation([U("What is the weather in Paris?"), A("", "Let me think.", [("get_weather", args)]),
                             {"role": "tool", "content": "21", "tool_call_id": "c1"}, A("Sunny.", "Done.")])
        return [(s.input_ids, s.loss_mask) for s in ChatMasker(tok).encode(conv)]

    assert sample('{"city":"Paris",  "days": 2}') == sample({"city": "Paris", "days": 2})
    if family == "qwen3":  # renders a string argument as it is
        (ids, _), *_ = sample("city=Paris")
        assert "city=Paris" in tok.decode(ids)


CONCATENATING_TEMPLATE = (  # joins a call's arguments to text as a string, as some templates do
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}{%- for c in m.tool_calls or [] -%}\n"
    "<tool_call>{{ '{\"name\": \"' + c.function.name + '\", \"arguments\": ' + c.function.arguments + '}' }}"
    "</tool_call>{%- endfor -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
STRING_ARGUMENTS = (
    "the chat template fails on tool-call arguments given as an object (TypeError: can only concatenate str (not "
    "\"dict\") to str, at template line 3: `<tool_call>{{ '{\"name\": \"' + c.function.name + '\", \"arguments\": ' + "
    "c.function.arguments + '}' }}</tool_call>{%- endfor -%}<|im_end|>`) and renders them given as a JSON string: it "
    "joins them to text as a string. SGLang passes a history tool call's arguments to the template as the object "
    "(serving_chat.normalize_assistant_tool_call_arguments parses a JSON string), as hsextract does, so the server "
    "fails on this conversation as well: set a `chat_template` that serialises them (`arguments | tojson`, or "
    "`arguments if arguments is string else arguments | tojson`)")


@pytest.mark.parametrize("args", ['{"city": "Paris"}', {"city": "Paris"}])
def test_a_template_that_joins_tool_call_arguments_as_a_string_is_refused_saying_why(args):
    """Arguments reach the template as an object (as SGLang passes them): a template that concatenates them
    fails, in Jinja's words; the error gives the template's words and line, the cause and what to do. A
    conversation without tool calls is unaffected."""
    tok = make_tokenizer("qwen3")
    tok.chat_template = CONCATENATING_TEMPLATE
    conv = Conversation([U("What is the weather in Paris?"), A("", None, [("get_weather", args)]),
                         {"role": "tool", "content": "21"}, A("Sunny.")])
    with pytest.raises(TemplateError) as e:
        ChatMasker(tok).encode(conv)
    assert (str(e.value), e.value.reason) == (STRING_ARGUMENTS, "tool_arguments_as_string")
    assert isinstance(e.value.__cause__, TypeError)
    (s,) = ChatMasker(tok).encode(CONVS["single"])
    assert trained_segments(s, tok) == ["\nHow are you today?<|im_end|>"]  # (its prompt strips the newline)


PARTS_TEMPLATE = (  # iterates content parts, trimming each: the list and the joined text render differently
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}:"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- else -%}{%- for part in m['content'] -%}{{ part['text'] | trim }}{%- endfor -%}{%- endif -%}"
    "<|im_end|>{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant:{%- endif -%}")


def test_content_parts_reach_the_template_as_sglang_passes_them():
    """Content given as text parts: a template that takes a string gets their texts joined with a space, one
    that iterates parts gets the list and renders it its own way (SGLang's content format rule); either way
    the sample is the server's rendering, and the assistant turn's mask covers what the template wrote."""
    record = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": " Summarise: "},
                                     {"type": "text", "text": "Two plus two."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Four "}, {"type": "text", "text": "it is."}]}]}
    conv = normalize_record(record)
    tok = make_tokenizer("qwen3")
    assert content_format(tok.chat_template) == "string"
    (s,) = ChatMasker(tok).encode(conv)
    (plain,) = ChatMasker(tok).encode(Conversation([U(" Summarise:  Two plus two."), A("Four  it is.")]))
    assert (s.input_ids, s.loss_mask) == (plain.input_ids, plain.loss_mask)
    tok.chat_template = PARTS_TEMPLATE
    assert content_format(PARTS_TEMPLATE) == "openai"
    (s,) = ChatMasker(tok).encode(conv)
    assert s.input_ids == tok.apply_chat_template(record["messages"], tokenize=True, return_dict=False)
    assert tok.decode(s.input_ids) == ("<|im_start|>user:Summarise:Two plus two.<|im_end|>"
                                       "<|im_start|>assistant:Fourit is.<|im_end|>")
    assert trained_segments(s, tok) == ["Fourit is.<|im_end|>"]


@pytest.mark.parametrize("template,fmt", [
    ("{% for c in message['content'] %}{{ c.text }}{% endfor %}", "openai"),
    ("{% for c in msg.content | selectattr('type', 'equalto', 'text') %}{{ c.text }}{% endfor %}", "openai"),
    ("{% for c in m.content[1:] %}{% generation %}{{ c.text }}{% endgeneration %}{% endfor %}", "openai"),
    ("{{ message['content'] }}{# image placeholders #}", "openai"),
    ("{% for c in messages[0].content %}{{ c }}{% endfor %}", "string"),
    ("{% for message in messages %}{{ message.content }}{% endfor %}", "string"),
    ("{% for c in message.content %}", "string"),  # does not parse: SGLang falls back to the string format
])
def test_content_format_follows_sglangs_rule(template, fmt):
    assert content_format(template) == fmt


def test_gemma4_empty_thought_channel_and_calls_before_the_content():
    """Gemma-4 with thinking off ends the generation prompt with an empty thought channel no rendered turn has:
    each turn is its prompt, channel included, then the turn as rendered. With thinking on, a tool-call turn
    renders its reasoning, then the calls, then the content: the calls are the message (trained whatever
    `train_on_reasoning` says), not filler."""
    tok = make_tokenizer("gemma4")
    conv = Conversation([U("What is the weather in Paris?"), A("Checking.", None, [("get_weather", {"city": "Paris"})]),
                         {"role": "tool", "content": "21", "name": "get_weather"}, A("Sunny.")])
    calls = "<|tool_call>call:get_weather{city:Paris}<tool_call|>"
    samples = ChatMasker(tok).encode(conv)
    assert [marked(s, tok).split("<|turn>model\n")[-1] for s in samples] == [
        f"<|channel>thought\n<channel|>⟦{calls}Checking.<|tool_response>⟧",
        f"{calls}Checking.<|tool_response>response:get_weather{{value:21}}<tool_response|>⟦Sunny.<turn|>⟧"]
    assert tok.decode(samples[0].input_ids).endswith(
        f"<|turn>model\n<|channel>thought\n<channel|>{calls}Checking.<|tool_response>")
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    conv.messages[1]["reasoning_content"] = "Look it up."
    for flags, first in (({}, f"<|channel>thought\nLook it up.\n<channel|>{calls}Checking.<|tool_response>"),
                         ({"train_on_reasoning": False}, f"{calls}Checking.<|tool_response>")):
        (s,) = ChatMasker(tok, **thinking, **flags).encode(conv)
        assert trained_segments(s, tok) == [first, "Sunny.<turn|>"], flags


def test_prompt_closing_an_empty_block_the_history_renders_as_its_closer():
    """A template whose generation prompt closes an empty think block (`<think></think>`) while a rendered turn
    writes only the closer (`</think>` + content, as DeepSeek-V3.2-style templates do): the turn follows the
    prompt's block, the closer is not written twice."""
    tok = make_tokenizer("deepseek_v31")
    tok.chat_template = (
        "{{ bos_token }}{%- for m in messages -%}{%- if m['role'] == 'user' -%}<｜User｜>{{ m['content'] }}"
        "{%- else -%}<｜Assistant｜></think>{{ m['content'] }}<｜end▁of▁sentence｜>{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}<｜Assistant｜><think></think>{%- endif -%}")
    samples = ChatMasker(tok).encode(CONVS["multi"])
    assert [marked(s, tok) for s in samples] == [
        "<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜><think></think>⟦How are you today?"
        "<｜end▁of▁sentence｜>⟧",
        "<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜></think>How are you today?<｜end▁of▁sentence｜>"
        "<｜User｜>What is two plus two?<｜Assistant｜><think></think>⟦Two plus two is four.<｜end▁of▁sentence｜>⟧"]


def test_turn_is_never_found_inside_the_context():
    """A template whose prompt is no prefix of the turn's rendering, and whose rendering without a generation
    prompt is no prefix of the prompt (Cohere's tool-use template): the turn is looked for after the longest tail
    of the prompt, which here matches a word of the preamble. A turn found before the end of the previous message
    would train the context: refused instead."""
    tok = make_tokenizer("qwen3")
    tok.chat_template = (
        "Rules: answer after the word Reply.{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
        "<|im_start|>{{ m['content'] }}{%- else -%}<think>{{ m['content'] }}<|im_end|>{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}<think>Reply{%- else -%}</think>{%- endif -%}")
    with pytest.raises(TemplateError) as e:
        ChatMasker(tok).encode(CONVS["single"])
    assert e.value.reason == "not_prefix_stable"


def test_tool_calls_rendered_after_the_stop_token_are_refused():
    """A template that renders a turn's tool calls as a message of its own after the turn's stop token
    (GigaChat-3's `function call` role): the turn's sample would train an empty turn, not the calls."""
    tok = make_tokenizer("qwen3")
    tok.chat_template = (
        "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"
        "{%- for c in m.get('tool_calls') or [] -%}<|im_start|>function call\n{{ c['function'] | tojson }}<|im_end|>"
        "{%- endfor -%}{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
    conv = Conversation([U("What is the weather in Paris?"), A("", None, [("get_weather", {"city": "Paris"})]),
                         {"role": "tool", "content": "21"}, A("Sunny.")])
    with pytest.raises(TemplateError) as e:
        ChatMasker(tok).encode(conv)
    assert str(e.value) == ("assistant turn 1: the chat template renders its tool calls after the turn's stop token, "
                            "as a message of their own, so its sample would train a turn without them: set a "
                            "`chat_template` that renders tool calls in the assistant turn, or leave conversations "
                            "with tool calls out")
    assert e.value.reason == "tool_calls_after_stop"


def test_prompt_opener_with_whitespace_a_turn_without_reasoning_renders_closed():
    """Nemotron-3's prompt ends `<think>\\n`; a turn without reasoning is rendered `<think></think>` + content:
    that turn is the prompt's open block closed at once (`</think>`, the model's: trained as reasoning) and the
    content, in its own sample as in the whole rendering."""
    tok = make_tokenizer("qwen3")
    tok.chat_template = (
        "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}{%- if m['role'] == 'assistant' -%}"
        "{%- if m.get('reasoning_content') -%}{{ '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n' }}"
        "{%- else -%}<think></think>{%- endif -%}{%- endif -%}{{ m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}")
    (s,) = ChatMasker(tok).encode(CONVS["single"])
    assert marked(s, tok) == ("<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n<think>\n"
                              "⟦</think>How are you today?<|im_end|>⟧")
    (s,) = ChatMasker(tok, split_turns="never").encode(CONVS["single"])  # the rendering's <think> is the prompt's
    assert marked(s, tok) == ("<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n<think>"
                              "⟦</think>How are you today?<|im_end|>⟧\n")
    (s,) = ChatMasker(tok).encode(CONVS["system"])  # with reasoning: as rendered
    assert trained_segments(s, tok) == ["The user greets.\n</think>\nHow are you today?<|im_end|>"]


def test_a_template_that_writes_the_time_writes_one_time_per_renderer():
    """Templates write today's date or the time with `strftime_now` (gpt-oss, Llama-3.2; Hunyuan to the second):
    a prompt and its turn, rendered a moment apart, must write the same time, or the turn is no longer found
    after its prompt. Microseconds make every rendering differ unless one clock is held for the renderer."""
    tok = make_tokenizer("qwen3")
    tok.chat_template = "{{ strftime_now('%H:%M:%S.%f') }}" + tok.chat_template
    for name in ("single", "multi", "tool"):
        samples = ChatMasker(tok).encode(CONVS[name])
        assert len({tok.decode(s.input_ids[:12]) for s in samples}) == 1
    assert hf_templates.datetime is datetime.datetime  # the real clock again, outside the renderings


def test_a_reasoning_block_the_template_leaves_open_is_refused():
    """A template that opens `<think>` in the prompt and renders the content right after it, reading no reasoning
    field (vLLM's Nemotron-Nano-v2 example): the sample would train the answer as reasoning. Raw text holding
    the closer is what such a template expects, and is trained as written."""
    tok = make_tokenizer("qwen3")
    tok.chat_template = (
        "{#- the content holds the reasoning, then </think>, then the answer -#}"
        "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}{%- if m['role'] == 'assistant' -%}"
        "{{ '<think>\\n' }}{%- endif -%}{{ m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}")
    for name in ("single", "system"):
        with pytest.raises(TemplateError) as e:
            ChatMasker(tok).encode(CONVS[name])
        assert str(e.value) == (
            f"assistant turn {len(CONVS[name].messages) - 1}: the generation prompt opens a reasoning block "
            "('<think>') that the template does not close in this turn, so its sample would train the answer as "
            "reasoning: give the turn its raw text in `content` (reasoning, '</think>', answer), or turn thinking "
            "off with `chat_template_kwargs`")
        assert e.value.reason == "reasoning_left_open"
    (s,) = ChatMasker(tok).encode(Conversation([U("Hello there!"), A("The user greets.\n</think>\n\nHi.")]))
    assert trained_segments(s, tok) == ["The user greets.\n</think>\n\nHi.<|im_end|>"]


def test_the_locator_chain_finds_each_familys_turns_by_its_own_case(monkeypatch):
    """Each locator of the chain is the one that finds some fixture family's turns, in a turn's own sample and in
    the whole rendering alike (the same locator: one chain for both paths); no case of it is dead code. A family
    that moves to another locator, or a new locator that takes turns from one, shows here."""
    used: dict[tuple[str, str], set[str]] = {}
    refused: set[tuple[str, str, str]] = set()
    now = [""]

    def spy(real, path):
        def located(self, rd, turn, frame, found):
            out = real(self, rd, turn, frame, found)
            if out is not None:
                used.setdefault((self.name, path), set()).add(now[0])
            return out
        return located

    for loc in LOCATORS:
        for path in ("own_sample", "in_rendering"):
            monkeypatch.setattr(type(loc), path, spy(getattr(type(loc), path), path))
    cases = [(f, {}) for f in FAMILIES] + [("kimi_k25", {"thinking": False}), ("deepseek_v31", {"thinking": True}),
                                           ("gemma4", {"enable_thinking": True}), ("qwen3", {"enable_thinking": False})]
    for family, kwargs in cases:
        now[0] = family + "".join(f" {k}={v}" for k, v in kwargs.items())
        for split in ("auto", "never"):
            for name, conv in CONVS.items():
                try:
                    ChatMasker(make_tokenizer(family), chat_template_kwargs=kwargs, split_turns=split).encode(conv)
                except Exception as e:  # noqa: BLE001 - a template's own raise_exception (Gemma: no tool role) or ours
                    refused.add((now[0], name, getattr(e, "reason", type(e).__name__)))
    rewritten = {"harmony", "kimi_k25", "mistral"}
    opened = {"deepseek_r1", "deepseek_v31 thinking=True", "glm47", "qwq"}
    # REFUSED's conversations, and thinking off with reasoning in the data
    unstable = [("deepseek_r1", "empty"), ("deepseek_r1", "single"), ("qwq", "empty"), ("qwq", "single"),
                ("gemma4", "tool"), ("kimi_k25 thinking=False", "tool")] + [
        ("qwen3 enable_thinking=False", name) for name in ("empty", "multi", "system", "tool", "unicode")]
    assert refused == {(f, name, "not_prefix_stable") for f, name in unstable} | {
        (f, "tool", "tool_calls_not_rendered") for f in ("gemma3", "phi3")}
    assert [loc.name for loc in LOCATORS] == ["prefix", "rewritten_history", "closed_block", "opened_block"]
    assert used == {
        ("prefix", "own_sample"): {"deepseek_r1", "deepseek_v31", "deepseek_v31 thinking=True", "gemma3",
                                   "gemma4 enable_thinking=True", "glm45", "glm47", "harmony", "kimi_k25",
                                   "kimi_k25 thinking=False", "llama3", "mistral", "phi3", "qwen3",
                                   "qwen3 enable_thinking=False"},
        ("prefix", "in_rendering"): {"glm45", "harmony", "kimi_k25", "qwen3"},
        ("rewritten_history", "own_sample"): rewritten, ("rewritten_history", "in_rendering"): rewritten,
        ("closed_block", "own_sample"): {"gemma4"}, ("closed_block", "in_rendering"): {"gemma4"},
        ("opened_block", "own_sample"): opened, ("opened_block", "in_rendering"): opened}


def test_a_template_of_another_tokenizer_is_refused_naming_its_markers() -> None:
    """Qwen3's template over Llama 3's tokenizer: `<|im_start|>` and `<|im_end|>` are no tokens of it, so every turn
    would be trained without a stop token (prepare ran to the end, no word said). Refused, naming them; each family
    with its own tokens still renders (the sweep above)."""
    from hsextract.errors import ConfigError

    template = (TEMPLATES / "qwen3.jinja").read_text()
    tok = tokenizer_with(template, SPECIALS["llama3"], EOS["llama3"], BOS["llama3"])
    with pytest.raises(ConfigError, match=r"^the chat template writes <\|im_end\|>, <\|im_start\|>, which the "
                                          r"tokenizer does not have as tokens \(it cuts each into plain pieces\): a "
                                          r"template of another model's tokenizer, whose turns would end in no stop "
                                          r"token\. Use this model's own template"):
        ChatMasker(tok)
    for name in FAMILIES:
        ChatMasker(make_tokenizer(name))


def test_a_reasoning_block_written_into_the_content_is_refused_where_the_template_adds_its_own():
    """R1-style data: `<think>...</think>` + answer in `content`. Kimi-K2.5's template writes a block of its own
    from the reasoning field before the content, so the sample would train two (with thinking off, one after the
    prompt's closed block): refused, naming the tag. A template that cuts the block out of the content itself (as
    Qwen3's own does) gets the same masks as with the reasoning in its field; DeepSeek-R1's, which renders no
    reasoning field, the raw text as written (also where the reasoning's words recur in the answer); a closer
    alone in answer text is refused beside Kimi's own block, and left as written where the template writes none."""
    inline = Conversation([U("Hello there!"), A("<think>The user greets.</think>How are you today?")])
    for kwargs in ({}, {"thinking": False}):
        with pytest.raises(TemplateError) as e:
            ChatMasker(make_tokenizer("kimi_k25"), chat_template_kwargs=kwargs).encode(inline)
        assert str(e.value) == (
            "assistant turn 1: its content holds a reasoning block (`<think>` ... `</think>` at character 23), which "
            "the chat template renders as answer text beside a reasoning block of its own: the sample would train "
            "two blocks. Move the reasoning to `reasoning_content` and keep the answer in `content` (as SGLang's "
            "reasoning parser returns a generation)") and e.value.reason == "reasoning_in_content"
    # a template that refuses an empty assistant content (the probe of its reasoning field fails): refused still
    guarded = tokenizer_with("{%- for m in messages %}{% if m.role == 'assistant' and not m.content %}"
                             "{{ raise_exception('empty') }}{% endif %}{% endfor %}"
                             + (TEMPLATES / "kimi_k25.jinja").read_text(), SPECIALS["kimi_k25"], EOS["kimi_k25"],
                             BOS["kimi_k25"])
    with pytest.raises(TemplateError, match="reasoning block") as e:
        ChatMasker(guarded).encode(inline)
    assert e.value.reason == "reasoning_in_content"
    # a closer alone, beside Kimi's own block: an R1-style export that cut the prompt's opener (its reasoning would
    # be trained as answer), or an answer naming the tag (read as the added token): a second closer either way
    tok = make_tokenizer("kimi_k25")
    for content, at in (("I reason here.</think>The answer.", 14), ("To end it, write </think> and then answer.", 17)):
        for kwargs in ({}, {"thinking": False}):
            with pytest.raises(TemplateError) as e:
                ChatMasker(tok, chat_template_kwargs=kwargs).encode(Conversation([U("Hello there!"), A(content)]))
            assert str(e.value) == (
                f"assistant turn 1: its content holds `</think>` (at character {at}), which the tokenizer reads as "
                "the added token that ends the reasoning block the chat template writes of its own before the "
                "content: the sample would train a second closer, and the text before it as answer. If that text "
                "is reasoning (a raw generation, which goes on from the prompt's `<think>`), move it to "
                "`reasoning_content` and keep the rest in `content`; an answer that only names the tag cannot be "
                "trained with this tokenizer, which reads it as the added token: leave such records out") \
                and e.value.reason == "reasoning_in_content"
    # an opener the content never closes (a generation cut off in its reasoning), beside Kimi's own block: refused
    for kwargs in ({}, {"thinking": False}):
        with pytest.raises(TemplateError) as e:
            ChatMasker(tok, chat_template_kwargs=kwargs).encode(
                Conversation([U("Hello there!"), A("<think>Greet. never closed")]))
        assert str(e.value) == (
            "assistant turn 1: its content opens a reasoning block (`<think>` at character 0) that it never closes, "
            "beside the reasoning block the chat template writes of its own: a generation cut off in its "
            "reasoning, whose sample would train that reasoning as answer text, or an answer that names the tag, "
            "which the tokenizer reads as the added token. Leave the record out, or give it whole (reasoning in "
            "`reasoning_content`, the answer in `content`)") \
            and e.value.reason == "reasoning_left_open"
    # where the template writes no block of its own, a closer alone in answer text is the turn as written; closers
    # the template writes elsewhere (a default system prompt's words, tool-call arguments) are no block of its own
    named = Conversation([U("Hello there!"), A("To end it, write </think> and then answer.")])
    tok = make_tokenizer("llama3")
    (s,) = ChatMasker(tok).encode(named)
    assert "⟦To end it, write </think> and then answer." in marked(s, tok), marked(s, tok)
    phi4 = ("{%- if messages[0].role != 'system' %}<|im_start|>system\nAnswer as <think> {Thought} </think> "
            "{Solution}<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
            "<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = tokenizer_with(phi4, SPECIALS["qwen3"], EOS["qwen3"], BOS["qwen3"])
    (s,) = ChatMasker(tok).encode(Conversation([U("Hello there!"), A("I reason.</think>The answer.")]))
    assert marked(s, tok).endswith("<|im_start|>assistant\n⟦I reason.</think>The answer.<|im_end|>⟧\n")
    tok = make_tokenizer("deepseek_r1")
    calls = [("write", json.dumps({"text": "a </think> b </think>"}))]
    conv = Conversation([U("Hello there!"), A("I reason.</think>Ok.", calls=calls),
                         {"role": "tool", "content": "done"}, A("Written.")])
    assert len(ChatMasker(tok).encode(conv)) == 2  # a sample per turn: R1 drops the reasoning from history
    with pytest.raises(TemplateError, match="reasoning block"):  # this Qwen3-shaped template does not cut it
        ChatMasker(make_tokenizer("qwen3")).encode(inline)
    # Qwen3's own template does: the reasoning field, or else the content cut at `</think>`
    cut = "{%- if not reasoning_content and '</think>' in content %}{%- set reasoning_content = content.split(" \
          "'</think>')[0].split('<think>')[-1] %}{%- set content = content.split('</think>')[-1] %}{%- endif %}\n"
    template = (TEMPLATES / "qwen3.jinja").read_text().replace("{%- if loop.index0 > ns2.idx %}\n",
                                                              cut + "{%- if loop.index0 > ns2.idx %}\n", 1)
    assert cut in template
    tok = tokenizer_with(template, SPECIALS["qwen3"], EOS["qwen3"], BOS["qwen3"])
    field = Conversation([U("Hello there!"), A("How are you today?", "The user greets.")])
    assert [marked(s, tok) for s in ChatMasker(tok).encode(inline)] == [
        marked(s, tok) for s in ChatMasker(tok).encode(field)] == [
        "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n⟦<think>\nThe user greets.\n</think>"
        "\n\nHow are you today?<|im_end|>⟧\n"]
    # DeepSeek-R1's template drops the block from the content and prompts `<think>\n`: the raw text is what it
    # expects (the model wrote the reasoning, the closer and the answer after that opener), as written
    tok = make_tokenizer("deepseek_r1")
    m = ChatMasker(tok)
    for content, trained in [("<think>The user greets.</think>How are you today?",
                              "⟦The user greets.</think>How are you today?<｜end▁of▁sentence｜>⟧"),
                             ("<think>\nParis\n</think>\n\nParis", "⟦Paris\n</think>\n\nParis<｜end▁of▁sentence｜>⟧")]:
        conv = Conversation([U("Hello there!"), A(content)])
        (s,) = m.encode(conv)
        assert marked(s, tok).endswith("<think>\n" + trained), marked(s, tok)
        assert s.input_ids == m.turn_ids(conv, 1)  # the ids regenerate's round trip compares
