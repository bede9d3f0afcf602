"""Google's Gemma chat formats (`<start_of_turn>role\\n...<end_of_turn>\\n`, the assistant called `model`)."""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate, alternation_check, leading_system

_MARKERS = ("<start_of_turn>", "<end_of_turn>")


def _turns(first_prefix: str) -> str:
    # One turn per message of `turns`; `first_prefix` (a Jinja expression) is written before the first content.
    return (
        "{%- for message in turns %}"
        "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
        " + (" + first_prefix + " if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
    )


# Gemma and Gemma 2 (gemma-*-it): BOS, alternating user/model turns, no system role; contents are trimmed.
GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- raise_exception('Gemma and Gemma 2 have no system role: fold the system text into the first user "
    "message, or use chat_template: gemma3, which does that') }}"
    "{%- endif %}"
    "{%- set turns = messages %}" + alternation_check("turns") + _turns("''")
)

# Gemma 3 (gemma-3-*-it): as Gemma, with a leading system message written at the start of the first user turn
# followed by a blank line (the system text itself is not trimmed, the turns' contents are).
GEMMA3_TEMPLATE = (
    "{{- bos_token }}"
    + leading_system()
    + alternation_check("turns")
    + _turns("(messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '')")
)

TEMPLATES = {
    "gemma": NamedTemplate(GEMMA_TEMPLATE, _MARKERS),
    "gemma3": NamedTemplate(GEMMA3_TEMPLATE, _MARKERS),
    # Gemma 3n writes text turns exactly as Gemma 3 does (it differs only in its image and audio tokens).
    "gemma3n": NamedTemplate(GEMMA3_TEMPLATE, _MARKERS),
}
