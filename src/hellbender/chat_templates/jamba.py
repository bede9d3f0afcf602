"""AI21's Jamba chat format (`<|bom|><|role|> content<|eom|>`)."""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate

# Jamba 1.5 / 1.6 / 1.7 Instruct: `<|startoftext|>`, then every message `<|bom|><|role|> content` (the role token
# followed by a space) and `<|eom|>` after each, the first always a system message (empty without one). The
# generation prompt `<|bom|><|assistant|>` has no space: the answer's first token carries it.
JAMBA_TEMPLATE = (
    "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
    "{{- '<|startoftext|><|bom|><|system|> ' + (messages[0]['content'] if has_system else '') + '<|eom|>' }}"
    "{%- for message in (messages[1:] if has_system else messages) %}"
    "{{- '<|bom|><|' + message['role'] + '|> ' + message['content'] + '<|eom|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|bom|><|assistant|>' }}{%- endif %}"
)

TEMPLATES = {
    # The role tokens are left out of the markers: the turn boundaries are `<|bom|>` and `<|eom|>`.
    "jamba": NamedTemplate(JAMBA_TEMPLATE, ("<|startoftext|>", "<|bom|>", "<|eom|>")),
}
