"""Expected samples of tests/test_loss_mask_families.py: each conversation's samples as text, every run of trained
tokens between ⟦ and ⟧ (`hsextract.masks.explain.marked`). Keyed by template family, then (flags, conversation):
flags `default` is train_on_eot and train_on_reasoning true, `neither` both false. Checked by eye against the
rule in config/README.md ("Loss masks"); a sample per list entry (several when the conversation is split).
"""

EXPECTED = {
    'harmony': {
        ('default', 'single'): [
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>'
            'Hello there!<|end|><|start|>assistant⟦<|channel|>final<|message|>'
            'How are you today?<|return|>⟧',
        ],
        ('default', 'system'): [
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>'
            'developer<|message|># Instructions\n\nYou are a helpful assistant.<|end|>'
            '<|start|>user<|message|>Hello there!<|end|><|start|>assistant⟦<|channel|>'
            'analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>'
            'final<|message|>How are you today?<|return|>⟧',
        ],
        ('default', 'multi'): [
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>'
            'Hello there!<|end|><|start|>assistant⟦<|channel|>analysis<|message|>'
            'The user greets.<|end|><|start|>assistant<|channel|>final<|message|>'
            'How are you today?<|return|>⟧',
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>'
            'Hello there!<|end|><|start|>assistant<|channel|>final<|message|>'
            'How are you today?<|end|><|start|>user<|message|>'
            'What is two plus two?<|end|><|start|>assistant⟦<|channel|>'
            'analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>'
            'final<|message|>Two plus two is four.<|return|>⟧',
        ],
        ('default', 'tool'): [
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>'
            'developer<|message|># Instructions\n\nYou are a helpful assistant.<|end|>'
            '<|start|>user<|message|>What is the weather in Paris?<|end|><|start|>'
            'assistant⟦<|channel|>analysis<|message|>Let me think.<|end|><|start|>'
            'assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris"}<|call|>⟧',
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>'
            'developer<|message|># Instructions\n\nYou are a helpful assistant.<|end|>'
            '<|start|>user<|message|>What is the weather in Paris?<|end|><|start|>'
            'assistant<|channel|>analysis<|message|>Let me think.<|end|><|start|>'
            'assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris"}<|call|><|start|>'
            'functions.get_weather to=assistant<|channel|>commentary<|message|>'
            '{"temperature": 21}<|end|><|start|>assistant⟦<|channel|>'
            'analysis<|message|>21 degrees.<|end|><|start|>assistant<|channel|>'
            'final<|message|>The weather in Paris is sunny.<|return|>⟧',
        ],
        ('default', 'empty'): [
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>'
            'Hello there!<|end|><|start|>assistant⟦<|channel|>analysis<|message|>'
            'Nothing to say.<|end|><|start|>assistant<|channel|>final<|message|>'
            '<|return|>⟧',
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>'
            'Hello there!<|end|><|start|>assistant<|channel|>final<|message|><|end|>'
            '<|start|>user<|message|>What is two plus two?<|end|><|start|>assistant'
            '⟦<|channel|>final<|message|>Four.<|return|>⟧',
        ],
        ('default', 'unicode'): [
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>'
            'Ça va? 日本語<|end|><|start|>assistant⟦<|channel|>analysis<|message|>'
            'Répondre poliment.<|end|><|start|>assistant<|channel|>final<|message|>'
            'Très bien ✓ 日本<|return|>⟧',
        ],
        ('neither', 'single'): [
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>'
            'Hello there!<|end|><|start|>assistant⟦<|channel|>final<|message|>'
            'How are you today?⟧<|return|>',
        ],
        ('neither', 'system'): [
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>'
            'developer<|message|># Instructions\n\nYou are a helpful assistant.<|end|>'
            '<|start|>user<|message|>Hello there!<|end|><|start|>assistant<|channel|>'
            'analysis<|message|>The user greets.<|end|>⟦<|start|>assistant<|channel|>'
            'final<|message|>How are you today?⟧<|return|>',
        ],
        ('neither', 'multi'): [
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>'
            'Hello there!<|end|><|start|>assistant<|channel|>analysis<|message|>'
            'The user greets.<|end|>⟦<|start|>assistant<|channel|>final<|message|>'
            'How are you today?⟧<|return|>',
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>'
            'Hello there!<|end|><|start|>assistant<|channel|>final<|message|>'
            'How are you today?<|end|><|start|>user<|message|>'
            'What is two plus two?<|end|><|start|>assistant<|channel|>'
            'analysis<|message|>Add them.<|end|>⟦<|start|>assistant<|channel|>'
            'final<|message|>Two plus two is four.⟧<|return|>',
        ],
        ('neither', 'tool'): [
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>'
            'developer<|message|># Instructions\n\nYou are a helpful assistant.<|end|>'
            '<|start|>user<|message|>What is the weather in Paris?<|end|><|start|>'
            'assistant<|channel|>analysis<|message|>Let me think.<|end|>⟦<|start|>'
            'assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris"}⟧<|call|>',
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>'
            'developer<|message|># Instructions\n\nYou are a helpful assistant.<|end|>'
            '<|start|>user<|message|>What is the weather in Paris?<|end|><|start|>'
            'assistant<|channel|>analysis<|message|>Let me think.<|end|><|start|>'
            'assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris"}<|call|><|start|>'
            'functions.get_weather to=assistant<|channel|>commentary<|message|>'
            '{"temperature": 21}<|end|><|start|>assistant<|channel|>analysis<|message|>'
            '21 degrees.<|end|>⟦<|start|>assistant<|channel|>final<|message|>'
            'The weather in Paris is sunny.⟧<|return|>',
        ],
        ('neither', 'empty'): [
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>'
            'Hello there!<|end|><|start|>assistant<|channel|>analysis<|message|>'
            'Nothing to say.<|end|>⟦<|start|>assistant<|channel|>final<|message|>⟧'
            '<|return|>',
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>'
            'Hello there!<|end|><|start|>assistant<|channel|>final<|message|><|end|>'
            '<|start|>user<|message|>What is two plus two?<|end|><|start|>assistant'
            '⟦<|channel|>final<|message|>Four.⟧<|return|>',
        ],
        ('neither', 'unicode'): [
            '<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>'
            'Ça va? 日本語<|end|><|start|>assistant<|channel|>analysis<|message|>'
            'Répondre poliment.<|end|>⟦<|start|>assistant<|channel|>final<|message|>'
            'Très bien ✓ 日本⟧<|return|>',
        ],
    },
    'llama3': {
        ('default', 'single'): [
            '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n'
            'Hello there!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
            '⟦How are you today?<|eot_id|>⟧',
        ],
        ('default', 'system'): [
            '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n'
            'You are a helpful assistant.<|eot_id|><|start_header_id|>'
            'user<|end_header_id|>\n\nHello there!<|eot_id|><|start_header_id|>'
            'assistant<|end_header_id|>\n\n⟦How are you today?<|eot_id|>⟧',
        ],
        ('default', 'multi'): [
            '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n'
            'Hello there!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
            '⟦How are you today?<|eot_id|>⟧<|start_header_id|>user<|end_header_id|>\n\n'
            'What is two plus two?<|eot_id|><|start_header_id|>'
            'assistant<|end_header_id|>\n\n⟦Two plus two is four.<|eot_id|>⟧',
        ],
        ('default', 'tool'): [
            '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n'
            'You are a helpful assistant.<|eot_id|><|start_header_id|>'
            'user<|end_header_id|>\n\nWhat is the weather in Paris?<|eot_id|>'
            '<|start_header_id|>assistant<|end_header_id|>\n\n'
            '⟦{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>⟧'
            '<|start_header_id|>ipython<|end_header_id|>\n\n'
            '{"temperature": 21}<|eot_id|><|start_header_id|>assistant<|end_header_id|>'
            '\n\n⟦The weather in Paris is sunny.<|eot_id|>⟧',
        ],
        ('default', 'unicode'): [
            '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n'
            'Ça va? 日本語<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
            '⟦Très bien ✓ 日本<|eot_id|>⟧',
        ],
        ('neither', 'single'): [
            '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n'
            'Hello there!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
            '⟦How are you today?⟧<|eot_id|>',
        ],
        ('neither', 'system'): [
            '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n'
            'You are a helpful assistant.<|eot_id|><|start_header_id|>'
            'user<|end_header_id|>\n\nHello there!<|eot_id|><|start_header_id|>'
            'assistant<|end_header_id|>\n\n⟦How are you today?⟧<|eot_id|>',
        ],
        ('neither', 'multi'): [
            '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n'
            'Hello there!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
            '⟦How are you today?⟧<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n'
            'What is two plus two?<|eot_id|><|start_header_id|>'
            'assistant<|end_header_id|>\n\n⟦Two plus two is four.⟧<|eot_id|>',
        ],
        ('neither', 'tool'): [
            '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n'
            'You are a helpful assistant.<|eot_id|><|start_header_id|>'
            'user<|end_header_id|>\n\nWhat is the weather in Paris?<|eot_id|>'
            '<|start_header_id|>assistant<|end_header_id|>\n\n'
            '⟦{"name": "get_weather", "parameters": {"city": "Paris"}}⟧<|eot_id|>'
            '<|start_header_id|>ipython<|end_header_id|>\n\n'
            '{"temperature": 21}<|eot_id|><|start_header_id|>assistant<|end_header_id|>'
            '\n\n⟦The weather in Paris is sunny.⟧<|eot_id|>',
        ],
        ('neither', 'unicode'): [
            '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n'
            'Ça va? 日本語<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
            '⟦Très bien ✓ 日本⟧<|eot_id|>',
        ],
        ('default', 'empty'): [
            '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello there!<|eot_id|><|start'
            '_header_id|>assistant<|end_header_id|>\n\n<|eot_id|><|start_header_id|>user<|end_header_id'
            '|>\n\nWhat is two plus two?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n⟦Fou'
            'r.<|eot_id|>⟧',
        ],
        ('neither', 'empty'): [
            '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello there!<|eot_id|><|start'
            '_header_id|>assistant<|end_header_id|>\n\n<|eot_id|><|start_header_id|>user<|end_header_id'
            '|>\n\nWhat is two plus two?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n⟦Fou'
            'r.⟧<|eot_id|>',
        ],
    },
    'qwen3': {
        ('default', 'single'): [
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n<think>\n'
            '\n</think>\n\n⟦How are you today?<|im_end|>⟧\n',
        ],
        ('default', 'system'): [
            '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>'
            'user\nHello there!<|im_end|>\n<|im_start|>assistant\n⟦<think>\n'
            'The user greets.\n</think>\n\nHow are you today?<|im_end|>⟧\n',
        ],
        ('default', 'multi'): [
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n'
            '⟦<think>\nThe user greets.\n</think>\n\nHow are you today?<|im_end|>⟧',
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n'
            'How are you today?<|im_end|>\n<|im_start|>user\n'
            'What is two plus two?<|im_end|>\n<|im_start|>assistant\n⟦<think>\n'
            'Add them.\n</think>\n\nTwo plus two is four.<|im_end|>⟧',
        ],
        ('default', 'tool'): [
            '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>'
            'user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n'
            '⟦<think>\nLet me think.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>⟧\n<|im_start|>user\n<tool_response>\n'
            '{"temperature": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
            '⟦<think>\n21 degrees.\n</think>\n\n'
            'The weather in Paris is sunny.<|im_end|>⟧\n',
        ],
        ('default', 'empty'): [
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n'
            '⟦<think>\nNothing to say.\n</think>\n\n<|im_end|>⟧',
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n'
            '<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n'
            '<|im_start|>assistant\n<think>\n\n</think>\n\n⟦Four.<|im_end|>⟧',
        ],
        ('default', 'unicode'): [
            '<|im_start|>user\nÇa va? 日本語<|im_end|>\n<|im_start|>assistant\n⟦<think>\n'
            'Répondre poliment.\n</think>\n\nTrès bien ✓ 日本<|im_end|>⟧\n',
        ],
        ('neither', 'single'): [
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n<think>\n'
            '\n</think>\n\n⟦How are you today?⟧<|im_end|>\n',
        ],
        ('neither', 'system'): [
            '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>'
            'user\nHello there!<|im_end|>\n<|im_start|>assistant\n<think>\n'
            'The user greets.\n</think>\n\n⟦How are you today?⟧<|im_end|>\n',
        ],
        ('neither', 'multi'): [
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n<think>\n'
            'The user greets.\n</think>\n\n⟦How are you today?⟧<|im_end|>',
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n'
            'How are you today?<|im_end|>\n<|im_start|>user\n'
            'What is two plus two?<|im_end|>\n<|im_start|>assistant\n<think>\n'
            'Add them.\n</think>\n\n⟦Two plus two is four.⟧<|im_end|>',
        ],
        ('neither', 'tool'): [
            '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>'
            'user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n'
            '<think>\nLet me think.\n</think>\n\n⟦<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>⟧'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n{"temperature": 21}\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n21 degrees.\n'
            '</think>\n\n⟦The weather in Paris is sunny.⟧<|im_end|>\n',
        ],
        ('neither', 'empty'): [
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n<think>\n'
            'Nothing to say.\n</think>\n\n<|im_end|>',
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n'
            '<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n'
            '<|im_start|>assistant\n<think>\n\n</think>\n\n⟦Four.⟧<|im_end|>',
        ],
        ('neither', 'unicode'): [
            '<|im_start|>user\nÇa va? 日本語<|im_end|>\n<|im_start|>assistant\n<think>\n'
            'Répondre poliment.\n</think>\n\n⟦Très bien ✓ 日本⟧<|im_end|>\n',
        ],
    },
    'kimi_k25': {
        ('default', 'single'): [
            '<|im_system|>system<|im_middle|>'
            'You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>'
            'user<|im_middle|>Hello there!<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think>⟦</think>How are you today?<|im_end|>⟧',
        ],
        ('default', 'system'): [
            '<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>'
            '<|im_user|>user<|im_middle|>Hello there!<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think>'
            '⟦The user greets.</think>How are you today?<|im_end|>⟧',
        ],
        ('default', 'multi'): [
            '<|im_system|>system<|im_middle|>'
            'You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>'
            'user<|im_middle|>Hello there!<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think>'
            '⟦The user greets.</think>How are you today?<|im_end|>⟧',
            '<|im_system|>system<|im_middle|>'
            'You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>'
            'user<|im_middle|>Hello there!<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think></think>How are you today?<|im_end|>'
            '<|im_user|>user<|im_middle|>What is two plus two?<|im_end|>'
            '<|im_assistant|>assistant<|im_middle|><think>'
            '⟦Add them.</think>Two plus two is four.<|im_end|>⟧',
        ],
        ('default', 'tool'): [
            '<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>'
            '<|im_user|>user<|im_middle|>What is the weather in Paris?<|im_end|>'
            '<|im_assistant|>assistant<|im_middle|><think>'
            '⟦Let me think.</think><|tool_calls_section_begin|><|tool_call_begin|>'
            'functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>⟧',
            '<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>'
            '<|im_user|>user<|im_middle|>What is the weather in Paris?<|im_end|>'
            '<|im_assistant|>assistant<|im_middle|>'
            '<think>Let me think.</think><|tool_calls_section_begin|>'
            '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
            '<|im_system|>tool<|im_middle|>## Return of c1\n'
            '{"temperature": 21}<|im_end|><|im_assistant|>assistant<|im_middle|><think>'
            '⟦21 degrees.</think>The weather in Paris is sunny.<|im_end|>⟧',
        ],
        ('default', 'empty'): [
            '<|im_system|>system<|im_middle|>'
            'You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>'
            'user<|im_middle|>Hello there!<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think>⟦Nothing to say.</think><|im_end|>⟧',
            '<|im_system|>system<|im_middle|>'
            'You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>'
            'user<|im_middle|>Hello there!<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think></think><|im_end|><|im_user|>'
            'user<|im_middle|>What is two plus two?<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think>⟦</think>Four.<|im_end|>⟧',
        ],
        ('default', 'unicode'): [
            '<|im_system|>system<|im_middle|>'
            'You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>'
            'user<|im_middle|>Ça va? 日本語<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think>'
            '⟦Répondre poliment.</think>Très bien ✓ 日本<|im_end|>⟧',
        ],
        ('neither', 'single'): [
            '<|im_system|>system<|im_middle|>'
            'You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>'
            'user<|im_middle|>Hello there!<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think></think>⟦How are you today?⟧<|im_end|>',
        ],
        ('neither', 'system'): [
            '<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>'
            '<|im_user|>user<|im_middle|>Hello there!<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think>The user greets.</think>⟦How are you today?⟧'
            '<|im_end|>',
        ],
        ('neither', 'multi'): [
            '<|im_system|>system<|im_middle|>'
            'You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>'
            'user<|im_middle|>Hello there!<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think>The user greets.</think>⟦How are you today?⟧'
            '<|im_end|>',
            '<|im_system|>system<|im_middle|>'
            'You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>'
            'user<|im_middle|>Hello there!<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think></think>How are you today?<|im_end|>'
            '<|im_user|>user<|im_middle|>What is two plus two?<|im_end|>'
            '<|im_assistant|>assistant<|im_middle|><think>Add them.</think>'
            '⟦Two plus two is four.⟧<|im_end|>',
        ],
        ('neither', 'tool'): [
            '<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>'
            '<|im_user|>user<|im_middle|>What is the weather in Paris?<|im_end|>'
            '<|im_assistant|>assistant<|im_middle|><think>Let me think.</think>'
            '⟦<|tool_calls_section_begin|><|tool_call_begin|>'
            'functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>⟧<|im_end|>',
            '<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>'
            '<|im_user|>user<|im_middle|>What is the weather in Paris?<|im_end|>'
            '<|im_assistant|>assistant<|im_middle|>'
            '<think>Let me think.</think><|tool_calls_section_begin|>'
            '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
            '<|im_system|>tool<|im_middle|>## Return of c1\n'
            '{"temperature": 21}<|im_end|><|im_assistant|>assistant<|im_middle|>'
            '<think>21 degrees.</think>⟦The weather in Paris is sunny.⟧<|im_end|>',
        ],
        ('neither', 'empty'): [
            '<|im_system|>system<|im_middle|>'
            'You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>'
            'user<|im_middle|>Hello there!<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think>Nothing to say.</think><|im_end|>',
            '<|im_system|>system<|im_middle|>'
            'You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>'
            'user<|im_middle|>Hello there!<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think></think><|im_end|><|im_user|>'
            'user<|im_middle|>What is two plus two?<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think></think>⟦Four.⟧<|im_end|>',
        ],
        ('neither', 'unicode'): [
            '<|im_system|>system<|im_middle|>'
            'You are Kimi, an AI assistant created by Moonshot AI.<|im_end|><|im_user|>'
            'user<|im_middle|>Ça va? 日本語<|im_end|><|im_assistant|>'
            'assistant<|im_middle|><think>Répondre poliment.</think>⟦Très bien ✓ 日本⟧'
            '<|im_end|>',
        ],
    },
    'deepseek_v31': {
        ('default', 'single'): [
            '<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜></think>'
            '⟦How are you today?<｜end▁of▁sentence｜>⟧',
        ],
        ('default', 'system'): [
            '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>'
            'Hello there!<｜Assistant｜></think>⟦How are you today?<｜end▁of▁sentence｜>⟧',
        ],
        ('default', 'multi'): [
            '<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜></think>'
            '⟦How are you today?<｜end▁of▁sentence｜>⟧<｜User｜>'
            'What is two plus two?<｜Assistant｜></think>'
            '⟦Two plus two is four.<｜end▁of▁sentence｜>⟧',
        ],
        ('default', 'tool'): [
            '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>'
            'What is the weather in Paris?<｜Assistant｜></think>⟦<｜tool▁calls▁begin｜>'
            '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
            '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>⟧'
            '<｜tool▁output▁begin｜>{"temperature": 21}<｜tool▁output▁end｜>'
            '⟦The weather in Paris is sunny.<｜end▁of▁sentence｜>⟧',
        ],
        ('default', 'unicode'): [
            '<｜begin▁of▁sentence｜><｜User｜>Ça va? 日本語<｜Assistant｜></think>'
            '⟦Très bien ✓ 日本<｜end▁of▁sentence｜>⟧',
        ],
        ('neither', 'single'): [
            '<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜></think>'
            '⟦How are you today?⟧<｜end▁of▁sentence｜>',
        ],
        ('neither', 'system'): [
            '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>'
            'Hello there!<｜Assistant｜></think>⟦How are you today?⟧<｜end▁of▁sentence｜>',
        ],
        ('neither', 'multi'): [
            '<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜></think>'
            '⟦How are you today?⟧<｜end▁of▁sentence｜><｜User｜>'
            'What is two plus two?<｜Assistant｜></think>⟦Two plus two is four.⟧'
            '<｜end▁of▁sentence｜>',
        ],
        ('neither', 'tool'): [
            '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>'
            'What is the weather in Paris?<｜Assistant｜></think>⟦<｜tool▁calls▁begin｜>'
            '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
            '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>⟧<｜end▁of▁sentence｜>'
            '<｜tool▁output▁begin｜>{"temperature": 21}<｜tool▁output▁end｜>'
            '⟦The weather in Paris is sunny.⟧<｜end▁of▁sentence｜>',
        ],
        ('neither', 'unicode'): [
            '<｜begin▁of▁sentence｜><｜User｜>Ça va? 日本語<｜Assistant｜></think>'
            '⟦Très bien ✓ 日本⟧<｜end▁of▁sentence｜>',
        ],
        ('default', 'empty'): [
            '<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜></think><｜end▁of▁sentence｜><｜User｜>W'
            'hat is two plus two?<｜Assistant｜></think>⟦Four.<｜end▁of▁sentence｜>⟧',
        ],
        ('neither', 'empty'): [
            '<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜></think><｜end▁of▁sentence｜><｜User｜>W'
            'hat is two plus two?<｜Assistant｜></think>⟦Four.⟧<｜end▁of▁sentence｜>',
        ],
    },
    'mistral': {
        ('default', 'single'): [
            '<s>[INST] Hello there![/INST]⟦ How are you today?</s>⟧',
        ],
        ('default', 'system'): [
            '<s>[INST] You are a helpful assistant.\n\nHello there![/INST]⟦ How are y'
            'ou today?</s>⟧',
        ],
        ('default', 'multi'): [
            '<s>[INST] Hello there![/INST]⟦ How are you today?</s>⟧[INST] What is t'
            'wo plus two?[/INST]⟦ Two plus two is four.</s>⟧',
        ],
        ('default', 'tool'): [
            '<s>[INST] You are a helpful assistant.\n\nWhat is the weather in Paris?['
            '/INST]⟦[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa'
            'ris"}}]</s>⟧',
            '<s>[INST] What is the weather in Paris?[/INST][TOOL_CALLS] [{"name": "'
            'get_weather", "arguments": {"city": "Paris"}}]</s>[TOOL_RESULTS] {"con'
            'tent": {"temperature": 21}, "call_id": "c1"}[/TOOL_RESULTS]⟦ The weath'
            'er in Paris is sunny.</s>⟧',
        ],
        ('default', 'empty'): [
            '<s>[INST] Hello there![/INST]⟦ </s>⟧[INST] What is two plus two?[/INST'
            ']⟦ Four.</s>⟧',
        ],
        ('default', 'unicode'): [
            '<s>[INST] Ça va? 日本語[/INST]⟦ Très bien ✓ 日本</s>⟧',
        ],
        ('neither', 'single'): [
            '<s>[INST] Hello there![/INST]⟦ How are you today?⟧</s>',
        ],
        ('neither', 'system'): [
            '<s>[INST] You are a helpful assistant.\n\nHello there![/INST]⟦ How are y'
            'ou today?⟧</s>',
        ],
        ('neither', 'multi'): [
            '<s>[INST] Hello there![/INST]⟦ How are you today?⟧</s>[INST] What is t'
            'wo plus two?[/INST]⟦ Two plus two is four.⟧</s>',
        ],
        ('neither', 'tool'): [
            '<s>[INST] You are a helpful assistant.\n\nWhat is the weather in Paris?['
            '/INST]⟦[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa'
            'ris"}}]⟧</s>',
            '<s>[INST] What is the weather in Paris?[/INST][TOOL_CALLS] [{"name": "'
            'get_weather", "arguments": {"city": "Paris"}}]</s>[TOOL_RESULTS] {"con'
            'tent": {"temperature": 21}, "call_id": "c1"}[/TOOL_RESULTS]⟦ The weath'
            'er in Paris is sunny.⟧</s>',
        ],
        ('neither', 'empty'): [
            '<s>[INST] Hello there![/INST]⟦ ⟧</s>[INST] What is two plus two?[/INST'
            ']⟦ Four.⟧</s>',
        ],
        ('neither', 'unicode'): [
            '<s>[INST] Ça va? 日本語[/INST]⟦ Très bien ✓ 日本⟧</s>',
        ],
    },
    'gemma3': {
        ('default', 'single'): [
            '<bos><start_of_turn>user\nHello there!<end_of_turn>\n<start_of_turn>mode'
            'l\n⟦How are you today?<end_of_turn>⟧\n',
        ],
        ('default', 'system'): [
            '<bos><start_of_turn>user\nYou are a helpful assistant.\n\nHello there!<en'
            'd_of_turn>\n<start_of_turn>model\n⟦How are you today?<end_of_turn>⟧\n',
        ],
        ('default', 'multi'): [
            '<bos><start_of_turn>user\nHello there!<end_of_turn>\n<start_of_turn>mode'
            'l\n⟦How are you today?<end_of_turn>⟧\n<start_of_turn>user\nWhat is two pl'
            'us two?<end_of_turn>\n<start_of_turn>model\n⟦Two plus two is four.<end_o'
            'f_turn>⟧\n',
        ],
        ('default', 'unicode'): [
            '<bos><start_of_turn>user\nÇa va? 日本語<end_of_turn>\n<start_of_turn>model\n'
            '⟦Très bien ✓ 日本<end_of_turn>⟧\n',
        ],
        ('neither', 'single'): [
            '<bos><start_of_turn>user\nHello there!<end_of_turn>\n<start_of_turn>mode'
            'l\n⟦How are you today?⟧<end_of_turn>\n',
        ],
        ('neither', 'system'): [
            '<bos><start_of_turn>user\nYou are a helpful assistant.\n\nHello there!<en'
            'd_of_turn>\n<start_of_turn>model\n⟦How are you today?⟧<end_of_turn>\n',
        ],
        ('neither', 'multi'): [
            '<bos><start_of_turn>user\nHello there!<end_of_turn>\n<start_of_turn>mode'
            'l\n⟦How are you today?⟧<end_of_turn>\n<start_of_turn>user\nWhat is two pl'
            'us two?<end_of_turn>\n<start_of_turn>model\n⟦Two plus two is four.⟧<end_'
            'of_turn>\n',
        ],
        ('neither', 'unicode'): [
            '<bos><start_of_turn>user\nÇa va? 日本語<end_of_turn>\n<start_of_turn>model\n'
            '⟦Très bien ✓ 日本⟧<end_of_turn>\n',
        ],
        ('default', 'empty'): [
            '<bos><start_of_turn>user\nHello there!<end_of_turn>\n<start_of_turn>model\n<end_of_turn>\n'
            '<start_of_turn>user\nWhat is two plus two?<end_of_turn>\n<start_of_turn>model\n⟦Four.<end_'
            'of_turn>⟧\n',
        ],
        ('neither', 'empty'): [
            '<bos><start_of_turn>user\nHello there!<end_of_turn>\n<start_of_turn>model\n<end_of_turn>\n'
            '<start_of_turn>user\nWhat is two plus two?<end_of_turn>\n<start_of_turn>model\n⟦Four.⟧<end'
            '_of_turn>\n',
        ],
    },
    'deepseek_r1': {
        ('default', 'system'): [
            '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello there!<'
            '｜Assistant｜><think>\n⟦The user greets.\n</think>\n\nHow are you today?<｜en'
            'd▁of▁sentence｜>⟧',
        ],
        ('default', 'multi'): [
            '<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜><think>\n⟦The use'
            'r greets.\n</think>\n\nHow are you today?<｜end▁of▁sentence｜>⟧',
            '<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜>How are you toda'
            'y?<｜end▁of▁sentence｜><｜User｜>What is two plus two?<｜Assistant｜><think>'
            '\n⟦Add them.\n</think>\n\nTwo plus two is four.<｜end▁of▁sentence｜>⟧',
        ],
        ('default', 'tool'): [
            '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is the w'
            'eather in Paris?<｜Assistant｜><think>\n⟦Let me think.\n</think>\n\n<｜tool▁c'
            'alls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json'
            '\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sent'
            'ence｜>⟧',
            '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is the w'
            'eather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>fu'
            'nction<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call'
            '▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜too'
            'l▁output▁begin｜>{"temperature": 21}<｜tool▁output▁end｜>⟦<｜tool▁outputs▁'
            'end｜>The weather in Paris is sunny.<｜end▁of▁sentence｜>⟧',
        ],
        ('default', 'unicode'): [
            '<｜begin▁of▁sentence｜><｜User｜>Ça va? 日本語<｜Assistant｜><think>\n⟦Répondre '
            'poliment.\n</think>\n\nTrès bien ✓ 日本<｜end▁of▁sentence｜>⟧',
        ],
        ('neither', 'system'): [
            '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello there!<'
            '｜Assistant｜><think>\nThe user greets.\n</think>\n\n⟦How are you today?⟧<｜e'
            'nd▁of▁sentence｜>',
        ],
        ('neither', 'multi'): [
            '<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜><think>\nThe user'
            ' greets.\n</think>\n\n⟦How are you today?⟧<｜end▁of▁sentence｜>',
            '<｜begin▁of▁sentence｜><｜User｜>Hello there!<｜Assistant｜>How are you toda'
            'y?<｜end▁of▁sentence｜><｜User｜>What is two plus two?<｜Assistant｜><think>'
            '\nAdd them.\n</think>\n\n⟦Two plus two is four.⟧<｜end▁of▁sentence｜>',
        ],
        ('neither', 'tool'): [
            '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is the w'
            'eather in Paris?<｜Assistant｜><think>\nLet me think.\n</think>\n\n⟦<｜tool▁c'
            'alls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json'
            '\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>⟧<｜end▁of▁sen'
            'tence｜>',
            '<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is the w'
            'eather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>fu'
            'nction<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call'
            '▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜too'
            'l▁output▁begin｜>{"temperature": 21}<｜tool▁output▁end｜>⟦<｜tool▁outputs▁'
            'end｜>The weather in Paris is sunny.⟧<｜end▁of▁sentence｜>',
        ],
        ('neither', 'unicode'): [
            '<｜begin▁of▁sentence｜><｜User｜>Ça va? 日本語<｜Assistant｜><think>\nRépondre p'
            'oliment.\n</think>\n\n⟦Très bien ✓ 日本⟧<｜end▁of▁sentence｜>',
        ],
    },
    'qwq': {
        ('default', 'system'): [
            '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>'
            'user\nHello there!<|im_end|>\n<|im_start|>assistant\n<think>\n⟦The user gr'
            'eets.\n</think>\n\nHow are you today?<|im_end|>⟧',
        ],
        ('default', 'multi'): [
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n<think>\n'
            '⟦The user greets.\n</think>\n\nHow are you today?<|im_end|>⟧',
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\nHow are '
            'you today?<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n'
            '<|im_start|>assistant\n<think>\n⟦Add them.\n</think>\n\nTwo plus two is fou'
            'r.<|im_end|>⟧',
        ],
        ('default', 'tool'): [
            '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>'
            'user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n<th'
            'ink>\n⟦Let me think.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arg'
            'uments": {"city": "Paris"}}\n</tool_call><|im_end|>⟧',
            '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>'
            'user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n<to'
            'ol_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</too'
            'l_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temperature": 21}'
            '\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n⟦21 degrees.'
            '\n</think>\n\nThe weather in Paris is sunny.<|im_end|>⟧',
        ],
        ('default', 'unicode'): [
            '<|im_start|>user\nÇa va? 日本語<|im_end|>\n<|im_start|>assistant\n<think>\n⟦R'
            'épondre poliment.\n</think>\n\nTrès bien ✓ 日本<|im_end|>⟧',
        ],
        ('neither', 'system'): [
            '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>'
            'user\nHello there!<|im_end|>\n<|im_start|>assistant\n<think>\nThe user gre'
            'ets.\n</think>\n\n⟦How are you today?⟧<|im_end|>',
        ],
        ('neither', 'multi'): [
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n<think>\n'
            'The user greets.\n</think>\n\n⟦How are you today?⟧<|im_end|>',
            '<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\nHow are '
            'you today?<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n'
            '<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n⟦Two plus two is fou'
            'r.⟧<|im_end|>',
        ],
        ('neither', 'tool'): [
            '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>'
            'user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n<th'
            'ink>\nLet me think.\n</think>\n\n⟦<tool_call>\n{"name": "get_weather", "arg'
            'uments": {"city": "Paris"}}\n</tool_call>⟧<|im_end|>',
            '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>'
            'user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n<to'
            'ol_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</too'
            'l_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temperature": 21}'
            '\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n21 degrees.\n'
            '</think>\n\n⟦The weather in Paris is sunny.⟧<|im_end|>',
        ],
        ('neither', 'unicode'): [
            '<|im_start|>user\nÇa va? 日本語<|im_end|>\n<|im_start|>assistant\n<think>\nRé'
            'pondre poliment.\n</think>\n\n⟦Très bien ✓ 日本⟧<|im_end|>',
        ],
    },
    'glm45': {
        ('default', 'single'): [
            '[gMASK]<sop><|user|>Hello there!<|assistant|>\n<think></think>\n⟦How are'
            ' you today?⟧',
        ],
        ('default', 'system'): [
            '[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>Hello there'
            '!<|assistant|>⟦\n<think>The user greets.</think>\nHow are you today?⟧',
        ],
        ('default', 'multi'): [
            '[gMASK]<sop><|user|>Hello there!<|assistant|>⟦\n<think>The user greets.'
            '</think>\nHow are you today?<|user|>⟧',
            '[gMASK]<sop><|user|>Hello there!<|assistant|>\n<think></think>\nHow are '
            'you today?<|user|>What is two plus two?<|assistant|>⟦\n<think>Add them.'
            '</think>\nTwo plus two is four.⟧',
        ],
        ('default', 'tool'): [
            '[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>What is the'
            ' weather in Paris?<|assistant|>⟦\n<think>Let me think.</think>\n<tool_ca'
            'll>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</'
            'tool_call><|observation|>⟧\n<tool_response>\n{"temperature": 21}\n</tool_'
            'response><|assistant|>⟦\n<think>21 degrees.</think>\nThe weather in Pari'
            's is sunny.⟧',
        ],
        ('default', 'empty'): [
            '[gMASK]<sop><|user|>Hello there!<|assistant|>⟦\n<think>Nothing to say.<'
            '/think><|user|>⟧',
            '[gMASK]<sop><|user|>Hello there!<|assistant|>\n<think></think><|user|>W'
            'hat is two plus two?<|assistant|>\n<think></think>\n⟦Four.⟧',
        ],
        ('default', 'unicode'): [
            '[gMASK]<sop><|user|>Ça va? 日本語<|assistant|>⟦\n<think>Répondre poliment.'
            '</think>\nTrès bien ✓ 日本⟧',
        ],
        ('neither', 'single'): [
            '[gMASK]<sop><|user|>Hello there!<|assistant|>\n<think></think>\n⟦How are'
            ' you today?⟧',
        ],
        ('neither', 'system'): [
            '[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>Hello there'
            '!<|assistant|>\n<think>The user greets.</think>\n⟦How are you today?⟧',
        ],
        ('neither', 'multi'): [
            '[gMASK]<sop><|user|>Hello there!<|assistant|>\n<think>The user greets.<'
            '/think>\n⟦How are you today?⟧<|user|>',
            '[gMASK]<sop><|user|>Hello there!<|assistant|>\n<think></think>\nHow are '
            'you today?<|user|>What is two plus two?<|assistant|>\n<think>Add them.<'
            '/think>\n⟦Two plus two is four.⟧',
        ],
        ('neither', 'tool'): [
            '[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>What is the'
            ' weather in Paris?<|assistant|>\n<think>Let me think.</think>\n⟦<tool_ca'
            'll>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</'
            'tool_call>⟧<|observation|>\n<tool_response>\n{"temperature": 21}\n</tool_'
            'response><|assistant|>\n<think>21 degrees.</think>\n⟦The weather in Pari'
            's is sunny.⟧',
        ],
        ('neither', 'empty'): [
            '[gMASK]<sop><|user|>Hello there!<|assistant|>\n<think>Nothing to say.</'
            'think><|user|>',
            '[gMASK]<sop><|user|>Hello there!<|assistant|>\n<think></think><|user|>W'
            'hat is two plus two?<|assistant|>\n<think></think>\n⟦Four.⟧',
        ],
        ('neither', 'unicode'): [
            '[gMASK]<sop><|user|>Ça va? 日本語<|assistant|>\n<think>Répondre poliment.<'
            '/think>\n⟦Très bien ✓ 日本⟧',
        ],
    },
    'glm47': {
        ('default', 'single'): [
            '[gMASK]<sop><|user|>Hello there!<|assistant|><think>⟦</think>How are y'
            'ou today?⟧',
        ],
        ('default', 'system'): [
            '[gMASK]<sop><|system|>You are a helpful assistant.<|user|>Hello there!'
            '<|assistant|><think>⟦The user greets.</think>How are you today?⟧',
        ],
        ('default', 'multi'): [
            '[gMASK]<sop><|user|>Hello there!<|assistant|><think>⟦The user greets.<'
            '/think>How are you today?<|user|>⟧',
            '[gMASK]<sop><|user|>Hello there!<|assistant|></think>How are you today'
            '?<|user|>What is two plus two?<|assistant|><think>⟦Add them.</think>Tw'
            'o plus two is four.⟧',
        ],
        ('default', 'tool'): [
            '[gMASK]<sop><|system|>You are a helpful assistant.<|user|>What is the '
            'weather in Paris?<|assistant|><think>⟦Let me think.</think><tool_call>'
            'get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_c'
            'all><|observation|>⟧<tool_response>{"temperature": 21}</tool_response>'
            '<|assistant|><think>⟦21 degrees.</think>The weather in Paris is sunny.'
            '⟧',
        ],
        ('default', 'empty'): [
            '[gMASK]<sop><|user|>Hello there!<|assistant|><think>⟦Nothing to say.</'
            'think><|user|>⟧',
            '[gMASK]<sop><|user|>Hello there!<|assistant|></think><|user|>What is t'
            'wo plus two?<|assistant|><think>⟦</think>Four.⟧',
        ],
        ('default', 'unicode'): [
            '[gMASK]<sop><|user|>Ça va? 日本語<|assistant|><think>⟦Répondre poliment.<'
            '/think>Très bien ✓ 日本⟧',
        ],
        ('neither', 'single'): [
            '[gMASK]<sop><|user|>Hello there!<|assistant|><think></think>⟦How are y'
            'ou today?⟧',
        ],
        ('neither', 'system'): [
            '[gMASK]<sop><|system|>You are a helpful assistant.<|user|>Hello there!'
            '<|assistant|><think>The user greets.</think>⟦How are you today?⟧',
        ],
        ('neither', 'multi'): [
            '[gMASK]<sop><|user|>Hello there!<|assistant|><think>The user greets.</'
            'think>⟦How are you today?⟧<|user|>',
            '[gMASK]<sop><|user|>Hello there!<|assistant|></think>How are you today'
            '?<|user|>What is two plus two?<|assistant|><think>Add them.</think>⟦Tw'
            'o plus two is four.⟧',
        ],
        ('neither', 'tool'): [
            '[gMASK]<sop><|system|>You are a helpful assistant.<|user|>What is the '
            'weather in Paris?<|assistant|><think>Let me think.</think>⟦<tool_call>'
            'get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_c'
            'all>⟧<|observation|><tool_response>{"temperature": 21}</tool_response>'
            '<|assistant|><think>21 degrees.</think>⟦The weather in Paris is sunny.'
            '⟧',
        ],
        ('neither', 'empty'): [
            '[gMASK]<sop><|user|>Hello there!<|assistant|><think>Nothing to say.</t'
            'hink><|user|>',
            '[gMASK]<sop><|user|>Hello there!<|assistant|></think><|user|>What is t'
            'wo plus two?<|assistant|><think></think>⟦Four.⟧',
        ],
        ('neither', 'unicode'): [
            '[gMASK]<sop><|user|>Ça va? 日本語<|assistant|><think>Répondre poliment.</'
            'think>⟦Très bien ✓ 日本⟧',
        ],
    },
    'phi3': {
        ('default', 'single'): [
            '<|user|>\nHello there!<|end|>\n<|assistant|>\n⟦How are you today?<|end|>⟧'
            '\n<|endoftext|>',
        ],
        ('default', 'system'): [
            '<|system|>\nYou are a helpful assistant.<|end|>\n<|user|>\nHello there!<|'
            'end|>\n<|assistant|>\n⟦How are you today?<|end|>⟧\n<|endoftext|>',
        ],
        ('default', 'multi'): [
            '<|user|>\nHello there!<|end|>\n<|assistant|>\n⟦How are you today?<|end|>⟧'
            '\n<|user|>\nWhat is two plus two?<|end|>\n<|assistant|>\n⟦Two plus two is '
            'four.<|end|>⟧\n<|endoftext|>',
        ],
        ('default', 'unicode'): [
            '<|user|>\nÇa va? 日本語<|end|>\n<|assistant|>\n⟦Très bien ✓ 日本<|end|>⟧\n<|end'
            'oftext|>',
        ],
        ('neither', 'single'): [
            '<|user|>\nHello there!<|end|>\n<|assistant|>\n⟦How are you today?⟧<|end|>'
            '\n<|endoftext|>',
        ],
        ('neither', 'system'): [
            '<|system|>\nYou are a helpful assistant.<|end|>\n<|user|>\nHello there!<|'
            'end|>\n<|assistant|>\n⟦How are you today?⟧<|end|>\n<|endoftext|>',
        ],
        ('neither', 'multi'): [
            '<|user|>\nHello there!<|end|>\n<|assistant|>\n⟦How are you today?⟧<|end|>'
            '\n<|user|>\nWhat is two plus two?<|end|>\n<|assistant|>\n⟦Two plus two is '
            'four.⟧<|end|>\n<|endoftext|>',
        ],
        ('neither', 'unicode'): [
            '<|user|>\nÇa va? 日本語<|end|>\n<|assistant|>\n⟦Très bien ✓ 日本⟧<|end|>\n<|end'
            'oftext|>',
        ],
        ('default', 'empty'): [
            '<|user|>\nHello there!<|end|>\n<|assistant|>\n<|end|>\n<|user|>\nWhat is two plus two?<|en'
            'd|>\n<|assistant|>\n⟦Four.<|end|>⟧\n<|endoftext|>',
        ],
        ('neither', 'empty'): [
            '<|user|>\nHello there!<|end|>\n<|assistant|>\n<|end|>\n<|user|>\nWhat is two plus two?<|en'
            'd|>\n<|assistant|>\n⟦Four.⟧<|end|>\n<|endoftext|>',
        ],
    },
    'gemma4': {
        ('default', 'single'): [
            '<bos><|turn>user\nHello there!<turn|>\n<|turn>model\n<|channel>thought\n<c'
            'hannel|>⟦How are you today?<turn|>⟧',
        ],
        ('default', 'system'): [
            '<bos><|turn>system\nYou are a helpful assistant.<turn|>\n<|turn>user\nHel'
            'lo there!<turn|>\n<|turn>model\n<|channel>thought\n<channel|>⟦How are you'
            ' today?<turn|>⟧',
        ],
        ('default', 'multi'): [
            '<bos><|turn>user\nHello there!<turn|>\n<|turn>model\n<|channel>thought\n<c'
            'hannel|>⟦How are you today?<turn|>⟧',
            '<bos><|turn>user\nHello there!<turn|>\n<|turn>model\nHow are you today?<t'
            'urn|>\n<|turn>user\nWhat is two plus two?<turn|>\n<|turn>model\n<|channel>'
            'thought\n<channel|>⟦Two plus two is four.<turn|>⟧',
        ],
        ('default', 'unicode'): [
            '<bos><|turn>user\nÇa va? 日本語<turn|>\n<|turn>model\n<|channel>thought\n<cha'
            'nnel|>⟦Très bien ✓ 日本<turn|>⟧',
        ],
        ('neither', 'single'): [
            '<bos><|turn>user\nHello there!<turn|>\n<|turn>model\n<|channel>thought\n<c'
            'hannel|>⟦How are you today?⟧<turn|>',
        ],
        ('neither', 'system'): [
            '<bos><|turn>system\nYou are a helpful assistant.<turn|>\n<|turn>user\nHel'
            'lo there!<turn|>\n<|turn>model\n<|channel>thought\n<channel|>⟦How are you'
            ' today?⟧<turn|>',
        ],
        ('neither', 'multi'): [
            '<bos><|turn>user\nHello there!<turn|>\n<|turn>model\n<|channel>thought\n<c'
            'hannel|>⟦How are you today?⟧<turn|>',
            '<bos><|turn>user\nHello there!<turn|>\n<|turn>model\nHow are you today?<t'
            'urn|>\n<|turn>user\nWhat is two plus two?<turn|>\n<|turn>model\n<|channel>'
            'thought\n<channel|>⟦Two plus two is four.⟧<turn|>',
        ],
        ('neither', 'unicode'): [
            '<bos><|turn>user\nÇa va? 日本語<turn|>\n<|turn>model\n<|channel>thought\n<cha'
            'nnel|>⟦Très bien ✓ 日本⟧<turn|>',
        ],
        ('default', 'empty'): [
            '<bos><|turn>user\nHello there!<turn|>\n<|turn>model\n<turn|>\n<|turn>user\nWhat is two plu'
            's two?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>⟦Four.<turn|>⟧',
        ],
        ('neither', 'empty'): [
            '<bos><|turn>user\nHello there!<turn|>\n<|turn>model\n<turn|>\n<|turn>user\nWhat is two plu'
            's two?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>⟦Four.⟧<turn|>',
        ],
    },
}
