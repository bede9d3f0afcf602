"""NVIDIA's Nemotron 3 chat format (`nemotron_h` models: ChatML with a think block in every assistant turn)."""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate
from hellbender.chat_templates.chatml import CHATML_MARKERS

# Nemotron 3 (NVIDIA-Nemotron-3-Nano / -Super, model type `nemotron_h`): ChatML that always opens with a system turn
# (empty without a system message). An assistant content without think tags gets an empty `<think></think>` in
# front, then is trimmed; with `truncate_history_thinking` (on by default) an assistant turn before the last user
# message keeps only `<think></think>` and the text after its `</think>`. User and system contents are written as
# is. Consecutive tool results share one user turn, each `<tool_response>\n...\n</tool_response>\n`. The
# generation prompt opens a think block, `<think>\n`, or with `enable_thinking=false` writes an empty one.
# (Nemotron-H-*-Reasoning and Nemotron Nano 2 share the model type but use another format.)
NEMOTRON_H_TEMPLATE = (
    "{%- set truncate = truncate_history_thinking if truncate_history_thinking is defined else true %}"
    "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
    "{%- set turns = messages[1:] if has_system else messages %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in turns %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|im_start|>system\n' + (messages[0]['content'] if has_system else '') + '<|im_end|>\n' }}"
    "{%- for message in turns %}"
    "{%- if message['role'] == 'assistant' %}{%- set content = message['content'] %}"
    "{%- if '<think>' not in content and '</think>' not in content %}{%- set content = '<think></think>' + content %}"
    "{%- endif %}"
    "{%- if truncate and loop.index0 < ns.last_user and '<think>' in content and '</think>' in content %}"
    "{%- set content = '<think></think>' + content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<|im_start|>assistant\n' + content | trim + '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if not loop.first and turns[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user\n' }}{%- endif %}"
    "{{- '<tool_response>\n' + message['content'] + '\n</tool_response>\n' }}"
    "{%- if loop.last or turns[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think></think>' }}"
    "{%- else %}{{- '<think>\n' }}{%- endif %}"
    "{%- endif %}"
)

TEMPLATES = {
    "nemotron_h": NamedTemplate(NEMOTRON_H_TEMPLATE, (*CHATML_MARKERS, "<think>", "</think>")),
}
