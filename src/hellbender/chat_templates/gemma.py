"""Google's Gemma chat formats (`<start_of_turn>role\\n...<end_of_turn>\\n`, the assistant called `model`)."""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate, alternation_check, leading_system, text_of, write_content

_MARKERS = ("<start_of_turn>", "<end_of_turn>")


def _turns(first_prefix: str, image: str | None = None) -> str:
    # One turn per message of `turns`; `first_prefix` (a Jinja expression) is written before the first content.
    return (
        "{%- for message in turns %}"
        "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
        " + ("
        + first_prefix
        + " if loop.first else '') }}"
        + write_content(image, trim=True)
        + "{{- '<end_of_turn>\n' }}"
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

# Gemma 3 (gemma-3-*-it): as Gemma, with a leading system message (its text parts joined) written at the start
# of the first user turn followed by a blank line (the system text itself is not trimmed, the turns' contents
# are); an image part is `<start_of_image>`.
_SYSTEM_PREFIX = "(" + text_of("messages[0]['content']") + " + '\n\n' if messages[0]['role'] == 'system' else '')"
GEMMA3_TEMPLATE = (
    "{{- bos_token }}" + leading_system() + alternation_check("turns") + _turns(_SYSTEM_PREFIX, "<start_of_image>")
)
# Gemma 3n (gemma-3n-*-it): Gemma 3's turns, an image part written `<image_soft_token>` (audio parts are refused).
GEMMA3N_TEMPLATE = (
    "{{- bos_token }}" + leading_system() + alternation_check("turns") + _turns(_SYSTEM_PREFIX, "<image_soft_token>")
)

TEMPLATES = {
    "gemma": NamedTemplate(GEMMA_TEMPLATE, _MARKERS),
    "gemma3": NamedTemplate(GEMMA3_TEMPLATE, _MARKERS, images=True),
    "gemma3n": NamedTemplate(GEMMA3N_TEMPLATE, _MARKERS, images=True),
}
