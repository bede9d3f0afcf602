"""IBM's Granite chat format (`<|start_of_role|>role<|end_of_role|>content<|end_of_text|>\\n`)."""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate

# Granite 3.x / 4.x Instruct, plain chat: every message `<|start_of_role|>role<|end_of_role|>content<|end_of_text|>\n`,
# the generation prompt `<|start_of_role|>assistant<|end_of_role|>`. Without a system message no system turn is
# written: the Granite 3.1-3.3 hub templates add a default one holding today's date, which would change the
# training text from day to day.
GRANITE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)

TEMPLATES = {
    "granite": NamedTemplate(GRANITE_TEMPLATE, ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>")),
}
