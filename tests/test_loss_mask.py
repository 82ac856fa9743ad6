"""Loss masks from chat templates, token by token, on templates shaped like Llama-3, DeepSeek-V3, Qwen3, Kimi-K2.5."""

from __future__ import annotations

import pytest
from chatfix import SYS, A, U, make_tokenizer, trained_segments

from hsextract.errors import ConfigError
from hsextract.masks.masker import ChatMasker
from hsextract.masks.refusals import TemplateError
from hsextract.prepare.conversations import Conversation

TOOL_CONV = Conversation([
    SYS, U("Hello there!"), A("How are you today?", "The user asks."),
    U("What is the weather in Paris?"),
    A("", "Let me think.", [("get_weather", {"city": "Paris"})]),
    {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "c1"},
    A("The weather in Paris is sunny.", "21 degrees."),
])
ONE = Conversation([SYS, U("Hello there!"), A("How are you today?")])
TWO = Conversation([U("Hello there!"), A("How are you today?", "The user greets."),
                    U("What is two plus two?"), A("Two plus two is four.", "Add them.")])


def segs(name, conv, **kw):
    tok = make_tokenizer(name)
    (s,) = ChatMasker(tok, **kw).encode(conv)
    return trained_segments(s, tok)


def test_llama3_single_turn_exact_token_mask():
    tok = make_tokenizer("llama3")
    (s,) = ChatMasker(tok).encode(ONE)
    prompt = tok.apply_chat_template(ONE.messages[:2], add_generation_prompt=True, tokenize=False)
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    n_answer = len(tok("How are you today?", add_special_tokens=False)["input_ids"])
    assert s.input_ids == tok(s.text, add_special_tokens=False)["input_ids"]
    assert s.input_ids[:n_prompt] == tok(prompt, add_special_tokens=False)["input_ids"]
    assert s.loss_mask == [0] * n_prompt + [1] * n_answer + [1]  # + <|eot_id|>
    assert s.input_ids[-1] == tok.convert_tokens_to_ids("<|eot_id|>")
    (s2,) = ChatMasker(tok, train_on_eot=False).encode(ONE)
    assert s2.loss_mask == [0] * n_prompt + [1] * n_answer + [0]


@pytest.mark.parametrize("eot,reasoning,expected", [
    (True, True, ["How are you today?<|eot_id|>", '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                  "The weather in Paris is sunny.<|eot_id|>"]),
    (False, False, ["How are you today?", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    "The weather in Paris is sunny."]),
])
def test_llama3_tool_call(eot, reasoning, expected):
    assert segs("llama3", TOOL_CONV, train_on_eot=eot, train_on_reasoning=reasoning) == expected


def test_deepseek_v3_tool_call_and_outputs_end_generated_by_the_model():
    calls = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}'
             '\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    # This template writes no generation prompt after tool outputs: the server's prompt ends with
    # <｜tool▁output▁end｜>, so the model itself writes <｜tool▁outputs▁end｜> before its answer: trained.
    assert segs("deepseek_v3", TOOL_CONV) == [
        "How are you today?<｜end▁of▁sentence｜>", calls + "<｜end▁of▁sentence｜>",
        "<｜tool▁outputs▁end｜>The weather in Paris is sunny.<｜end▁of▁sentence｜>"]
    # The tool-call closers are generated text: trained even without the end-of-turn token.
    assert segs("deepseek_v3", TOOL_CONV, train_on_eot=False) == [
        "How are you today?", calls, "<｜tool▁outputs▁end｜>The weather in Paris is sunny."]
    tok = make_tokenizer("deepseek_v3")
    prompt = ChatMasker(tok).render(TOOL_CONV.messages[:6], add_generation_prompt=True)
    assert prompt.endswith('{"temperature": 21}<｜tool▁output▁end｜>')


QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_qwen3_history_rewrite_splits_into_one_sample_per_turn():
    tok = make_tokenizer("qwen3")
    samples = ChatMasker(tok).encode(TOOL_CONV)
    # Qwen3 drops reasoning before the last query: each turn becomes the context the server saw, with its own
    # reasoning; the `\n` after <|im_end|> is template text the model never generates.
    assert [s.turn for s in samples] == [2, 4, 6]
    assert [trained_segments(s, tok) for s in samples] == [
        ["<think>\nThe user asks.\n</think>\n\nHow are you today?<|im_end|>"],
        ["<think>\nLet me think.\n</think>\n\n" + QWEN_CALL + "<|im_end|>"],
        ["<think>\n21 degrees.\n</think>\n\nThe weather in Paris is sunny.<|im_end|>"]]
    for s in samples:
        j = s.turn
        prompt = tok.apply_chat_template(TOOL_CONV.messages[:j], add_generation_prompt=True, tokenize=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        assert s.input_ids[:len(p)] == p and s.loss_mask[:len(p)] == [0] * len(p)
        assert s.input_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")  # cut after the stop token
    assert [trained_segments(s, tok) for s in ChatMasker(tok, train_on_reasoning=False, train_on_eot=False)
            .encode(TOOL_CONV)] == [["How are you today?"], [QWEN_CALL], ["The weather in Paris is sunny."]]


def test_qwen3_never_split_trains_turns_as_the_full_rendering_shows_them():
    m = ChatMasker(make_tokenizer("qwen3"), split_turns="never")
    assert segs("qwen3", TOOL_CONV, split_turns="never") == [
        "How are you today?<|im_end|>",  # reasoning dropped by the template (before the last query)
        "<think>\nLet me think.\n</think>\n\n" + QWEN_CALL + "<|im_end|>",
        "<think>\n21 degrees.\n</think>\n\nThe weather in Paris is sunny.<|im_end|>"]
    m.encode(TOOL_CONV)
    assert m.stats["turns_history_fallback"] == 1 and m.stats["split_conversations"] == 0
    assert segs("qwen3", TOOL_CONV, train_on_reasoning=False, train_on_eot=False, split_turns="never") == [
        "How are you today?", QWEN_CALL, "The weather in Paris is sunny."]


def test_qwen3_empty_think_block_not_trained():
    tok = make_tokenizer("qwen3")
    (s,) = ChatMasker(tok).encode(ONE)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nHow are you today?" in s.text
    assert trained_segments(s, tok) == ["How are you today?<|im_end|>"]


def test_qwen3_thinking_disabled_with_reasoning_data_is_not_prefix_stable():
    with pytest.raises(TemplateError, match=r"assistant turn 1: the template is not prefix-stable") as e:
        ChatMasker(make_tokenizer("qwen3"), chat_template_kwargs={"enable_thinking": False}).encode(TWO)
    assert e.value.reason == "not_prefix_stable"
    # Without reasoning in the data the non-thinking prompt is consistent.
    plain = Conversation([U("Hello there!"), A("How are you today?"), U("What is two plus two?"),
                          A("Two plus two is four.")])
    tok = make_tokenizer("qwen3")
    samples = ChatMasker(tok, chat_template_kwargs={"enable_thinking": False}).encode(plain)
    # The empty think block is in the server's prompt; the full rendering drops it from history: split.
    assert [trained_segments(x, tok) for x in samples] == [
        ["How are you today?<|im_end|>"], ["Two plus two is four.<|im_end|>"]]
    assert tok.decode(samples[0].input_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"
                                                     "How are you today?<|im_end|>")


KIMI_CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
             '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')


def test_kimi_history_reasoning_dropped_and_the_prompts_think_not_trained():
    tok = make_tokenizer("kimi_k25")
    never = ChatMasker(tok, split_turns="never")
    (s,) = never.encode(TOOL_CONV)
    assert "Let me think." not in s.text and "21 degrees." not in s.text
    # never: each turn as the rendering has it, `<think></think>`; the model wrote its `</think>` after the
    # reasoning the rendering dropped, not right after the prompt's `<think>`: untrained (a turn without reasoning
    # trains it: test_multi_turn_with_system_prompt_all_templates)
    assert trained_segments(s, tok) == ["How are you today?<|im_end|>", KIMI_CALL + "<|im_end|>",
                                        "The weather in Paris is sunny.<|im_end|>"]
    assert never.stats["reasoning_not_rendered"] == 3
    # Split (auto): each turn stored as the server saw it, its own reasoning present and trained; the template
    # never renders a final answer's reasoning, so it is put back after the `<think>` of the generation prompt.
    m = ChatMasker(tok)
    assert [trained_segments(x, tok) for x in m.encode(TOOL_CONV)] == [
        ["The user asks.</think>How are you today?<|im_end|>"], ["Let me think.</think>" + KIMI_CALL + "<|im_end|>"],
        ["21 degrees.</think>The weather in Paris is sunny.<|im_end|>"]]
    assert m.stats["reasoning_inserted"] == 2 and m.stats["reasoning_not_rendered"] == 0


def test_kimi_reasoning_in_open_tool_loop_kept_or_masked():
    conv = Conversation(TOOL_CONV.messages[:5])  # ends with the tool call: its reasoning is rendered
    assert segs("kimi_k25", conv, split_turns="never") == [
        "How are you today?<|im_end|>", "Let me think.</think>" + KIMI_CALL + "<|im_end|>"]
    assert segs("kimi_k25", conv, train_on_reasoning=False, split_turns="never") == [
        "How are you today?<|im_end|>", KIMI_CALL + "<|im_end|>"]


def test_multi_turn_with_system_prompt_all_templates():
    # Kimi: a turn without reasoning is rendered `<think></think>`, its `</think>` the model's, closing the
    # prompt's `<think>` at once: trained; in the whole rendering (never) TWO's turns lost their reasoning, and
    # their `</think>`, written after it, is not trained there
    for name, eot, c in [("llama3", "<|eot_id|>", ""), ("deepseek_v3", "<｜end▁of▁sentence｜>", ""),
                         ("kimi_k25", "<|im_end|>", "</think>")]:
        assert segs(name, TWO, split_turns="never") == ["How are you today?" + eot, "Two plus two is four." + eot], name
        assert segs(name, ONE, train_on_eot=False) == [c + "How are you today?"], name
        plain = Conversation([U("Hello there!"), A("How are you today?"), U("What is two plus two?"), A("Four.")])
        assert segs(name, plain, split_turns="never") == [c + "How are you today?" + eot, c + "Four." + eot], name


def test_non_assistant_tokens_never_trained():
    tok = make_tokenizer("qwen3")
    trained_text = "".join(t for s in ChatMasker(tok).encode(TOOL_CONV) for t in trained_segments(s, tok))
    for m in TOOL_CONV.messages:
        if m["role"] != "assistant":
            assert m["content"] not in trained_text


def test_template_prefix_unstable_generation_prompt_raises():
    tok = make_tokenizer("llama3")
    # A generation prompt the turns never contain: the engine would see a different prompt than stored.
    tok.chat_template = tok.chat_template.replace(
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}",
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\nSure: ' }}\n{%- endif %}")
    with pytest.raises(TemplateError, match="not prefix-stable"):
        ChatMasker(tok).encode(ONE)


def test_the_piece_cache_is_bounded_by_tokens_and_changes_no_mask(monkeypatch):
    """Pieces are cached by their text: a long tool output each conversation would otherwise stay for good."""
    from hsextract.masks import rendering

    convs = [Conversation([SYS, U(f"Question {k}: " + "many words here " * 40), A(f"Answer {k}. " * 30, "Think.")])
             for k in range(12)]
    want = [[(s.input_ids, s.loss_mask) for s in ChatMasker(make_tokenizer("qwen3")).encode(c)] for c in convs]
    monkeypatch.setattr(rendering, "PIECE_CACHE_TOKENS", 400)
    m = ChatMasker(make_tokenizer("qwen3"))
    for c, w in zip(convs, want, strict=True):
        assert [(s.input_ids, s.loss_mask) for s in m.encode(c)] == w
        assert 0 < m.renderer._cached_tokens <= 400
        assert m.renderer._cached_tokens == sum(map(len, m.renderer._ids.values()))


PLAIN = ("{% for m in messages %}{% if m.role != 'tool' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
         "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]


def test_named_templates_render_a_record_with_tools_with_tool_use():
    """A tokenizer of named templates (Hermes, Command-R): a record with tools is rendered with `tool_use`, as
    transformers and SGLang choose, one without with `default`; a kwarg one of them reads is read."""
    tok = make_tokenizer("qwen3")
    qwen = tok.chat_template
    tok.chat_template = {"default": PLAIN, "tool_use": qwen}
    masker = ChatMasker(tok, chat_template_kwargs={"enable_thinking": False})  # read by tool_use alone
    msgs = [U("What is the weather in Paris?"), A("", calls=[("get_weather", {"city": "Paris"})]),
            {"role": "tool", "content": '{"temperature": 21}'}, A("The weather in Paris is sunny and warm.")]
    call, answer = masker.encode(Conversation(msgs, WEATHER))  # one per turn: Qwen3 rewrites the history
    for sample, upto in ((call, 2), (answer, 4)):
        assert sample.text == tok.apply_chat_template(msgs[:upto], tools=WEATHER, chat_template=qwen, tokenize=False,
                                                      enable_thinking=False)
    assert trained_segments(call, tok) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>']
    assert trained_segments(answer, tok) == ["The weather in Paris is sunny and warm.<|im_end|>"]
    (plain,) = masker.encode(Conversation([U("Hello there!"), A("How are you today?")]))
    assert plain.text == ("<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\nHow are you today?"
                          "<|im_end|>\n")
    assert trained_segments(plain, tok) == ["How are you today?<|im_end|>"]
    with pytest.raises(ConfigError) as e:
        ChatMasker(tok, chat_template_kwargs={"thinking": False})
    assert str(e.value) == (
        "chat_template_kwargs: the chat template never reads `thinking`, so it changes nothing (the data would be "
        "rendered as without it); the template reads `enable_thinking` besides the variables every rendering passes. "
        "Use that name, or remove the key")


def test_a_prompt_the_tokenizer_joins_to_the_turn_is_said_as_such():
    """A byte-level BPE that merges "\\n\\n" and the GPT-2 split: the prompt (Llama 3's, ending in "\\n\\n") is one
    token alone and two ("\\n", "\\n") before the turn's text. Not a reasoning or kwargs mismatch: said as such."""
    tok = make_tokenizer("llama3", extra_corpus=("Para one.\n\nPara two.\n\n",))
    with pytest.raises(TemplateError) as e:
        ChatMasker(tok).encode(Conversation([U("Hello there!"), A("How are you today?")]))
    assert e.value.reason == "not_prefix_stable"
    assert str(e.value).startswith("assistant turn 1: the turn rendered holds the generation prompt the server saw as "
                                   "text, but the tokenizer joins the prompt's last characters to the turn's first "
                                   "ones into other tokens (first difference at token ")
    assert str(e.value).endswith("neither chat_template_kwargs nor the data can change that")
