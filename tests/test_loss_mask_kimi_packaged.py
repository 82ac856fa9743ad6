"""Loss masks through the Kimi-packaged tiny model's tokenizer (custom code, tiktoken, slow: no offsets)."""

from __future__ import annotations

import pytest

# test_kimi_tokenizer, imported below, needs tiktoken: skip the module without it
pytest.importorskip("tiktoken")

from test_kimi_tokenizer import CONV, model_dir, tok  # noqa: F401 - module fixtures reused

from hsextract.masks.explain import marked
from hsextract.masks.masker import ChatMasker
from hsextract.masks.refusals import TemplateError
from hsextract.prepare.conversations import Conversation

DONE = Conversation([*CONV, {"role": "assistant", "content": "21 C in Rome.", "reasoning_content": "Report."}])


def test_kimi_packaged_tokenizer_masks(tok) -> None:  # noqa: F811 - the fixture
    assert tok.is_fast is False
    samples = ChatMasker(tok).encode(DONE)
    # One sample per assistant turn (the template drops earlier reasoning); each final answer's reasoning,
    # never rendered by the template, is put back after the generation prompt's <think>.
    assert [s.turn for s in samples] == [1, 3, 5]
    tails = [marked(s, tok).rsplit("<|im_assistant|>assistant<|im_middle|>", 1)[1] for s in samples]
    assert tails == [
        "<think>⟦Look it up.</think>Sunny.<|im_end|>⟧",
        "<think>⟦Call the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>⟧',
        "<think>⟦Report.</think>21 C in Rome.<|im_end|>⟧"]
    for s in samples:  # ids are what the tokenizer makes of the text
        text = tok.decode(s.input_ids, skip_special_tokens=False)
        assert s.input_ids == tok(text, add_special_tokens=False)["input_ids"]
    # the whole rendering drops the last turn's reasoning too (`never`: trained as rendered): its `</think>`, which
    # the model wrote after that reasoning, not right after the prompt's `<think>`, is not trained there
    (whole,) = ChatMasker(tok, split_turns="never", train_on_eot=False).encode(DONE)
    assert marked(whole, tok).endswith("<think></think>⟦21 C in Rome.⟧<|im_end|>")


PLAIN = Conversation([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}])


def test_kimi_packaged_turns_without_reasoning(tok) -> None:  # noqa: F811 - the fixture
    """Thinking on, the prompt ends `<think>` and a turn without reasoning is rendered `<think></think>` + answer:
    the model wrote that `</think>`, trained iff `train_on_reasoning`, the same in every split mode (the prompt's
    `<think>` never). Thinking off, the prompt holds `<think></think>`: nothing of it is trained."""
    head, user = "<|im_assistant|>assistant<|im_middle|>", "<|im_user|>user<|im_middle|>Weather?<|im_end|>"
    for kwargs, reasoning, block in (({}, True, "<think>⟦</think>"), ({"thinking": True}, True, "<think>⟦</think>"),
                                     ({"thinking": True}, False, "<think></think>⟦"),
                                     ({"thinking": False}, True, "<think></think>⟦"),
                                     ({"thinking": False}, False, "<think></think>⟦")):
        first, second = block + "Hello.<|im_end|>⟧", block + "Sunny.<|im_end|>⟧"
        trained = "</think>Hello.<|im_end|></think>Sunny.<|im_end|>" if "⟦</think>" in block else \
            "Hello.<|im_end|>Sunny.<|im_end|>"
        for split, tails in (("auto", [[first + user, second]]), ("never", [[first + user, second]]),
                             ("always", [[first], ["<think></think>Hello.<|im_end|>" + user, second]])):
            samples = ChatMasker(tok, chat_template_kwargs=kwargs, train_on_reasoning=reasoning,
                                 split_turns=split).encode(PLAIN)
            assert [marked(s, tok).split(head)[1:] for s in samples] == tails, (kwargs, reasoning, split)
            ids = [i for s in samples for i, t in zip(s.input_ids, s.loss_mask, strict=True) if t]
            assert tok.decode(ids, skip_special_tokens=False) == trained, (kwargs, reasoning, split)


def test_masks_explain_needs_trust_remote_code_for_custom_code(model_dir, tmp_path, capsys) -> None:  # noqa: F811 - the fixture
    import json

    from hsextract.cli import main

    conv = tmp_path / "conv.jsonl"
    conv.write_text(json.dumps({"messages": DONE.messages[:2]}) + "\n")
    assert main(["masks", "--explain", str(conv), "--model", str(model_dir)]) == 2
    assert "trust_remote_code" in capsys.readouterr().err
    assert main(["masks", "--explain", str(conv), "--model", str(model_dir), "--trust-remote-code"]) == 0
    assert "<think>⟦Look it up.</think>Sunny.<|im_end|>⟧" in capsys.readouterr().out


def test_an_assistant_name_the_template_writes_in_the_header_is_named_as_the_cause(tok) -> None:  # noqa: F811
    conv = Conversation([{"role": "user", "content": "Hi."}, {"role": "assistant", "name": "bot", "content": "b"}])
    with pytest.raises(TemplateError) as e:
        ChatMasker(tok).encode(conv)
    assert e.value.reason == "not_prefix_stable" and str(e.value).startswith(
        "assistant turn 1: the template writes its `name` field ('bot') where the generation prompt the server saw "
        "has the plain assistant header (first difference at token ")
    assert str(e.value).endswith("the model never wrote a turn after that header. Remove `name` from assistant "
                                 "messages")


def test_tool_call_ids_are_trained_as_kimi_writes_them(tok) -> None:  # noqa: F811 - the fixture
    """OpenAI-style ids (`call_...`, or none) in data from another API: Kimi's template renders a call's id in the
    turn, where Kimi-K2.5 writes `functions.NAME:IDX` (IDX counting the conversation's calls, as SGLang's Kimi-K2
    serving numbers them). Trained as Kimi writes them, each tool message's tool_call_id following its call;
    Kimi's own ids are kept; counted in the masks' stats."""
    def call(name: str, id_: str | None) -> dict:
        return {"type": "function", "function": {"name": name, "arguments": {"q": 1}}, **({"id": id_} if id_ else {})}

    def conv(ids: list[str | None]) -> Conversation:
        return Conversation([
            {"role": "user", "content": "Look twice."},
            {"role": "assistant", "content": "", "reasoning_content": "Two calls.",
             "tool_calls": [call("search", ids[0]), call("open", ids[1])]},
            {"role": "tool", "content": "r1", **({"tool_call_id": ids[0]} if ids[0] else {})},
            {"role": "tool", "content": "r2", **({"tool_call_id": ids[1]} if ids[1] else {})},
            {"role": "assistant", "content": "", "reasoning_content": "Once more.",
             "tool_calls": [call("search", ids[2])]},
            {"role": "tool", "content": "r3", **({"tool_call_id": ids[2]} if ids[2] else {})},
            {"role": "assistant", "content": "Done.", "reasoning_content": "Enough."}])

    kimi = ["functions.search:0", "functions.open:1", "functions.search:2"]
    masker = ChatMasker(tok)
    want = [marked(s, tok) for s in masker.encode(conv(kimi))]
    assert "tool_call_ids_given" not in masker.stats
    assert "<|tool_call_begin|>functions.search:2<|tool_call_argument_begin|>" in want[-1]
    for other in (["call_abc", "call_def", "call_ghi"], [None, None, None], ["functions.search:0", "x", None]):
        masker = ChatMasker(tok)
        assert [marked(s, tok) for s in masker.encode(conv(other))] == want
        assert masker.stats["tool_call_ids_given"] == sum(a != b for a, b in zip(other, kimi, strict=True))
        # every rendering agrees: a prompt regenerate sends, and the turn's own sample its round trip compares
        assert masker.render(conv(other).messages[:4], add_generation_prompt=True) == \
            masker.render(conv(kimi).messages[:4], add_generation_prompt=True)
        assert masker.turn_ids(conv(other), 4) == masker.encode(conv(other))[1].input_ids


def test_tool_results_follow_their_calls_through_the_renaming() -> None:
    """Two calls of one id answered in order; a result naming an id an earlier turn's call has after renaming
    (`functions.f:0`) answers this turn's call written with it; a result without an id takes the turn's call still
    unanswered; one naming no call is left as it is."""
    from hsextract.masks.tool_ids import kimi_call_ids

    def asst(*calls: tuple[str, str | None]) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": {}}, **({"id": i} if i else {})}
            for n, i in calls]}

    def tool(i: str | None) -> dict:
        return {"role": "tool", "content": "r", **({"tool_call_id": i} if i else {})}

    msgs = [{"role": "user", "content": "go"}, asst(("f", "x"), ("g", "x")), tool("x"), tool("x"),
            asst(("f", "functions.f:0")), tool("functions.f:0"),
            asst(("f", "functions.f:3"), ("h", None)), tool("functions.f:3"), tool(None), tool("zzz"), tool("x")]
    out, given = kimi_call_ids(msgs)
    assert [c["id"] for m in out if m.get("tool_calls") for c in m["tool_calls"]] == [
        "functions.f:0", "functions.g:1", "functions.f:2", "functions.f:3", "functions.h:4"]
    assert [m.get("tool_call_id") for m in out if m["role"] == "tool"] == [
        "functions.f:0", "functions.g:1", "functions.f:2", "functions.f:3", "functions.h:4", "zzz",
        "functions.g:1"]  # an earlier turn's id answered already: its last call of that id
    assert given == 4  # x, x, functions.f:0 (now the third call), none


def test_a_function_name_holding_a_token_of_the_tokenizer_is_refused(tok) -> None:  # noqa: F811 - the fixture
    """Kimi's id holds the name: `<|tool_call_end|>` there would end the call early in the trained turn."""
    call = {"type": "function", "function": {"name": "a<|tool_call_end|>b", "arguments": {}}, "id": "call_1"}
    conv = Conversation([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": "r", "tool_call_id": "call_1"},
                         {"role": "assistant", "content": "Done."}])
    with pytest.raises(TemplateError) as e:
        ChatMasker(tok).encode(conv)
    assert str(e.value) == (
        "assistant turn 1: the function name 'a<|tool_call_end|>b' holds <|tool_call_end|>, a token of the "
        "tokenizer's own: the template writes the name in the call's id, where that token would end the call "
        "early. Rename the function") and e.value.reason == "markup_in_turn"
