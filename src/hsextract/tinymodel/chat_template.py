"""The Kimi-K2-style chat template of the tiny model, and the hash recorded in shards.

Kimi-K2's format, reproduced for the tiny model so that prepare/extract see the same
token structure as production:

    <|im_system|>system<|im_middle|>{content}<|im_end|>
    <|im_user|>user<|im_middle|>{content}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>{content}<|im_end|>

with no separators between turns and no BOS/EOS emitted by the template. The segment
between the role marker and `<|im_middle|>` is `message.name` if given, else the role.
Like Kimi-K2, a conversation that does not start with a system message gets a default
system turn (`DEFAULT_SYSTEM_PROMPT`). The generation prompt is
`<|im_assistant|>assistant<|im_middle|>`.
"""

from __future__ import annotations

IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
ROLE_TOKENS = (IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END)
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Whitespace control (`{%-`, `-%}`) keeps the template's own newlines out of the output.
KIMI_STYLE_TEMPLATE = (
    "{%- if messages | length > 0 and messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>"
    "{%- endif -%}"
    "{{- message['name'] if message.get('name') else message['role'] -}}"
    "<|im_middle|>{{- message['content'] -}}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
