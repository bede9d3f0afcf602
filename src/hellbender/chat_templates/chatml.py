"""ChatML and the Qwen families built on it (`<|im_start|>role\\n...<|im_end|>\\n`)."""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate, write_content

CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")

# ChatML: each message is `<|im_start|>role\ncontent<|im_end|>\n`; the tokenizer must know both markers.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TURN = "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
# Qwen's tool results: consecutive `tool` messages share one user turn, each wrapped in <tool_response> tags.
_TOOL_TURN = (
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
)
_GENERATION = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
QWEN_VISION = "<|vision_start|><|image_pad|><|vision_end|>"

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2.5-Instruct: ChatML with a default system turn when the conversation has none; tool results as above.
QWEN25_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\n" + QWEN25_DEFAULT_SYSTEM + "<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    + _TOOL_TURN
    + "{%- elif not (loop.first and message['role'] == 'system') %}"
    + _TURN
    + "{%- endif %}"
    "{%- endfor %}" + _GENERATION
)

# Qwen3: ChatML; an assistant turn after the last user query carries a (possibly empty) <think> block when it is
# the conversation's last message, and a `<think>...</think>` written in the content is moved into that block
# (earlier turns drop it), as Qwen3's own template does. With `enable_thinking=false` the generation prompt
# holds an empty think block.
QWEN3_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- set ns = namespace(open_query=true, last_query=messages | length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- if ns.open_query and message['role'] == 'user' and not (message['content'].startswith('<tool_response>')"
    " and message['content'].endswith('</tool_response>')) %}"
    "{%- set ns.open_query = false %}{%- set ns.last_query = messages | length - 1 - loop.index0 %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    + _TOOL_TURN
    + "{%- elif not (loop.first and message['role'] == 'system') %}"
    + _TURN
    + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)

# Falcon-H1 Instruct: BOS, then ChatML; only a leading system message is written (later ones are left out).
FALCON_H1_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] != 'system' or loop.first %}" + _TURN + "{%- endif %}"
    "{%- endfor %}" + _GENERATION
)

# Qwen2-VL / Qwen2.5-VL: ChatML with the default system turn `You are a helpful assistant.` when the conversation
# has none; an image part is `<|vision_start|><|image_pad|><|vision_end|>`.
QWEN2_VL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}" + write_content(QWEN_VISION) + "{{- '<|im_end|>\n' }}"
    "{%- endfor %}" + _GENERATION
)

# Qwen3.5 (Qwen3.5-*, a vision-language family): ChatML whose contents are trimmed (a content of parts is joined,
# `<|vision_start|><|image_pad|><|vision_end|>` for an image, then trimmed); a system message only at the start (no
# default one); every assistant turn after the last user query opens with a think block (empty unless the content
# starts with `<think>...</think>`, which is moved into it; earlier turns drop it); tool results are grouped into
# one user turn as in Qwen3. The generation prompt opens a think block, `<think>\n`, or with `enable_thinking=false`
# writes an empty one. A conversation needs a user query, as the family's format does.
QWEN3_5_TEMPLATE = (
    "{%- macro content_of(message) %}" + write_content(QWEN_VISION) + "{%- endmacro %}"
    "{%- macro system_of(message) %}" + write_content() + "{%- endmacro %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + system_of(messages[0]) | trim + '<|im_end|>\n' }}{%- endif %}"
    "{%- set ns = namespace(open_query=true, last_query=messages | length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- if ns.open_query and message['role'] == 'user' %}{%- set text = content_of(message) | trim %}"
    "{%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) %}"
    "{%- set ns.open_query = false %}{%- set ns.last_query = messages | length - 1 - loop.index0 %}"
    "{%- endif %}{%- endif %}"
    "{%- endfor %}"
    "{%- if ns.open_query %}{{- raise_exception('Qwen3.5 needs a user message in the conversation') }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not loop.first %}"
    "{{- raise_exception('Qwen3.5 takes a system message only at the start of the conversation') }}{%- endif %}"
    "{%- else %}{%- set content = content_of(message) | trim %}"
    "{%- if message['role'] == 'user' %}{{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'assistant' %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning | trim + '\n</think>\n\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{%- if not loop.first and messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}"
    "{%- else %}{{- '<think>\n' }}{%- endif %}"
    "{%- endif %}"
)

TEMPLATES = {
    "chatml": NamedTemplate(CHATML_TEMPLATE, CHATML_MARKERS),
    "qwen_25": NamedTemplate(QWEN25_TEMPLATE, CHATML_MARKERS),
    "qwen2_vl": NamedTemplate(QWEN2_VL_TEMPLATE, CHATML_MARKERS, images=True),
    "falcon_h1": NamedTemplate(FALCON_H1_TEMPLATE, CHATML_MARKERS),
    "qwen3": NamedTemplate(QWEN3_TEMPLATE, (*CHATML_MARKERS, "<think>", "</think>")),
    "qwen3_5": NamedTemplate(QWEN3_5_TEMPLATE, (*CHATML_MARKERS, "<think>", "</think>"), images=True),
}
