"""Loss masks from the chat template itself, on token ids: which tokens of a rendered conversation are trained.

The rule (config/README.md, "Loss masks"): a token gets loss 1 exactly when the target model generates it in
that assistant turn: everything after the generation prompt up to and including its stop token (content,
tool-call markup, headers it writes itself, reasoning per `train_on_reasoning`, the stop token per
`train_on_eot`); never the generation prompt, never template text after the stop token, never a token of
another message (but for a template that writes no stop token, GLM's: the next message's header the model
wrote to stop, `<|user|>` or `<|observation|>`, is the turn's stop token). Filler a template writes for a
turn whose reasoning it does not render (an empty `<think></think>`) was not generated: not trained; but the
closer of a block the generation prompt opened, where the turn's rendering starts with it (DeepSeek-V3.1
`thinking: true`, GLM-4.7), the model wrote: trained as reasoning, in every `split_turns` mode.

Turn boundaries are found on token ids, never on character offsets, so slow tokenizers (tiktoken,
sentencepiece, custom code) work as fast ones do. The modules, in the order a conversation meets them:

    kwargs      the variables a template reads; a `chat_template_kwargs` key it never reads is an error
    rendering   `TemplateRenderer`: messages to text and ids, passed as the server passes them
    probe       `TemplateFacts`: what the template tells about turns (stop tokens, headers, reasoning slot)
    refusals    `TemplateError`, the reason codes a conversation is dropped under, whole-conversation checks
    turns       `Frame`, `TurnSpan`, `find_turn`: where one turn lies in a rendering
    reasoning   the shapes of reasoning blocks the prompt and the rendering disagree on
    locators    the locator chain: how a turn is found after the prompt the server saw, in its own frame and
                in the whole rendering
    masker      `ChatMasker`: a conversation's samples and loss masks (`split_turns`)
    explain     `hsextract masks --explain`
    ids         common prefix and suffix of id sequences, and occurrences

This file imports nothing: `masks.kwargs` is read by the config check, which must not load transformers.
"""
