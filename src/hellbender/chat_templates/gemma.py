"""Google's Gemma chat formats: `<start_of_turn>role\\n...<end_of_turn>\\n` (Gemma to Gemma 3n) and
`<|turn>role\\n...<turn|>\\n` (Gemma 4), the assistant called `model`."""

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

# Gemma 4 (gemma-4-*-it): BOS; `<|turn>role\n...<turn|>\n` with the assistant called `model`. A leading system
# message becomes a system turn (a string trimmed; a list of parts written as each text part trimmed and followed by
# a space, as Gemma 4's template does), which `enable_thinking=true` opens with `<|think|>\n`. User contents are
# trimmed part by part, an image part is `<|image|>`; a model content is trimmed after its `<|channel>...<channel|>`
# thought blocks are dropped, on every turn. A model message right after another one continues its turn (no new
# header). The generation prompt is `<|turn>model\n` followed, unless `enable_thinking=true`, by an empty thought
# channel. Tool results live inside the model turn that called the tool (from `tool_calls`, which rows here do not
# carry), so `tool` messages are refused.
_GEMMA4_IMAGE = "<|image|>"
_GEMMA4_MODEL_TEXT = (
    "{%- macro model_text(text) %}{%- set ns = namespace(kept='') %}"
    "{%- for piece in text.split('<channel|>') %}{%- set ns.kept = ns.kept + piece.split('<|channel>')[0] %}"
    "{%- endfor %}{{- ns.kept | trim }}{%- endmacro %}"
)
GEMMA4_TEMPLATE = (
    _GEMMA4_MODEL_TEXT + "{{- bos_token }}"
    "{%- set thinking = enable_thinking is defined and enable_thinking %}"
    "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
    "{%- if thinking or has_system %}{{- '<|turn>system\n' }}{%- if thinking %}{{- '<|think|>\n' }}{%- endif %}"
    "{%- if has_system %}{%- if messages[0]['content'] is string %}{{- messages[0]['content'] | trim }}"
    "{%- else %}{%- for part in messages[0]['content'] %}{%- if part['type'] != 'text' %}"
    "{{- raise_exception('Gemma 4 takes no images in the system message') }}{%- endif %}"
    "{{- part['text'] | trim + ' ' }}{%- endfor %}{%- endif %}{%- endif %}"
    "{{- '<turn|>\n' }}{%- endif %}"
    "{%- set turns = messages[1:] if has_system else messages %}"
    "{%- for message in turns %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- raise_exception('chat_template: gemma4 cannot write a tool message: Gemma 4 puts a tool result inside the "
    "model turn that called the tool, from the tool_calls of that message, which these rows do not carry') }}"
    "{%- endif %}"
    "{%- if not (message['role'] == 'assistant' and not loop.first and turns[loop.index0 - 1]['role'] == 'assistant')"
    " %}{{- '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}{%- endif %}"
    "{%- if message['role'] != 'assistant' %}"
    + write_content(_GEMMA4_IMAGE, trim=True)
    + "{%- elif message['content'] is string %}{{- model_text(message['content']) }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- model_text(part['text']) }}"
    "{%- elif part['type'] == 'image' %}{{- '" + _GEMMA4_IMAGE + "' }}"
    "{%- else %}{{- raise_exception('This chat template cannot write a message part of type `' ~ part['type'] ~ '`') }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<turn|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|turn>model\n' }}"
    "{%- if not thinking %}{{- '<|channel>thought\n<channel|>' }}{%- endif %}{%- endif %}"
)

TEMPLATES = {
    "gemma": NamedTemplate(GEMMA_TEMPLATE, _MARKERS),
    "gemma3": NamedTemplate(GEMMA3_TEMPLATE, _MARKERS, images=True),
    "gemma3n": NamedTemplate(GEMMA3N_TEMPLATE, _MARKERS, images=True),
    "gemma4": NamedTemplate(GEMMA4_TEMPLATE, ("<|turn>", "<turn|>"), images=True),
    # Gemma 4 Unified (the encoder-free Gemma 4 checkpoints) uses Gemma 4's chat format unchanged.
    "gemma4_unified": NamedTemplate(GEMMA4_TEMPLATE, ("<|turn>", "<turn|>"), images=True),
}
