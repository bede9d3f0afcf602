"""Cohere's Command-R chat format (turn tokens around role tokens)."""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate, alternation_check, leading_system

# Command-R (c4ai-command-r-v01): BOS; an optional `<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>system
# <|END_OF_TURN_TOKEN|>`; then alternating user / chatbot turns whose contents the format strips.
COHERE_TEMPLATE = (
    "{{- bos_token }}"
    + leading_system()
    + "{%- if has_system %}{{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + system + '<|END_OF_TURN_TOKEN|>' }}"
    "{%- endif %}" + alternation_check("turns") + "{%- for message in turns %}"
    "{{- '<|START_OF_TURN_TOKEN|>' + ('<|USER_TOKEN|>' if message['role'] == 'user' else '<|CHATBOT_TOKEN|>')"
    " + message['content'] | trim + '<|END_OF_TURN_TOKEN|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif %}"
)

_MARKERS = (
    "<|START_OF_TURN_TOKEN|>",
    "<|END_OF_TURN_TOKEN|>",
    "<|SYSTEM_TOKEN|>",
    "<|USER_TOKEN|>",
    "<|CHATBOT_TOKEN|>",
)
TEMPLATES = {
    "cohere": NamedTemplate(COHERE_TEMPLATE, _MARKERS),
    # Aya-23 and Aya Expanse use Command-R's format unchanged.
    "aya": NamedTemplate(COHERE_TEMPLATE, _MARKERS),
}
