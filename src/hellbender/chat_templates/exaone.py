"""LG AI Research's EXAONE chat format (`[|role|]` tokens, `[|endofturn|]` closing every turn but the user's)."""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate

# EXAONE 3.0 / 3.5 Instruct: a conversation without a leading system message opens with an empty system turn
# `[|system|][|endofturn|]\n`; a user turn is `[|user|]content\n`, any other turn `[|role|]content[|endofturn|]\n`.
EXAONE_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}{{- '[|system|][|endofturn|]\n' }}{%- endif %}"
    "{{- '[|' + message['role'] + '|]' + message['content'] }}"
    "{%- if message['role'] == 'user' %}{{- '\n' }}{%- else %}{{- '[|endofturn|]\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '[|assistant|]' }}{%- endif %}"
)

TEMPLATES = {
    "exaone": NamedTemplate(EXAONE_TEMPLATE, ("[|system|]", "[|user|]", "[|assistant|]", "[|endofturn|]")),
}
