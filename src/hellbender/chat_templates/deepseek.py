"""DeepSeek's chat formats (`<｜User｜>` / `<｜Assistant｜>` prefixes, the answer closed by EOS)."""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate

_MARKERS = ("<｜User｜>", "<｜Assistant｜>")
_ONLY_TEXT_ROLES = (
    "{{- raise_exception('This DeepSeek chat template renders system, user and assistant messages only, not `' ~ "
    "message['role'] ~ '`') }}"
)

# DeepSeek-V2.5 / V2-Chat-0628: BOS; a system message is its content and a blank line, in place; then
# `<｜User｜>user` and `<｜Assistant｜>answer` + EOS.
DEEPSEEK_V2_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{%- elif message['role'] == 'system' %}{{- message['content'] + '\n\n' }}"
    "{%- else %}" + _ONLY_TEXT_ROLES + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

# DeepSeek-V3: BOS, every system message first (joined by blank lines, no separator after them), then
# `<｜User｜>user` and `<｜Assistant｜>answer<｜end▁of▁sentence｜>`.
DEEPSEEK_V3_TEMPLATE = (
    "{{- bos_token }}"
    "{{- messages | selectattr('role', 'equalto', 'system') | map(attribute='content') | join('\n\n') }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] != 'system' %}" + _ONLY_TEXT_ROLES + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

TEMPLATES = {
    "deepseek_v2": NamedTemplate(DEEPSEEK_V2_TEMPLATE, _MARKERS),
    "deepseek_v3": NamedTemplate(DEEPSEEK_V3_TEMPLATE, (*_MARKERS, "<｜end▁of▁sentence｜>")),
}
