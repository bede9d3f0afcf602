"""Mistral's instruct formats: `[INST] ... [/INST]` around user turns, the answer closed by EOS.

A leading system message goes where Mistral's own tokenizer (mistral-common) puts it: v1 before the first user
message, v2/v3 and Tekken v3 before the last user message (the hub templates put it there only when that user
message ends the conversation, which would drop it from a training conversation), v7 in its own
`[SYSTEM_PROMPT]` block.
"""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate, alternation_check, leading_system, text_of, write_content

_ONLY_TEXT_ROLES = (
    "{{- raise_exception('This Mistral chat template renders system, user and assistant messages only, not `' ~ "
    "message['role'] ~ '`') }}"
)


def _instruct(open_: str, close: str, answer: str, system_on: str) -> str:
    """BOS, then user turns as `open_` + content + `close`, assistant turns as the Jinja expression `answer`;
    the system text joins the user message selected by `system_on` (`first` or `last`)."""
    return (
        leading_system() + alternation_check("turns") + "{%- set ns = namespace(first_user=-1, last_user=-1) %}"
        "{%- for message in turns %}{%- if message['role'] == 'user' %}"
        "{%- if ns.first_user < 0 %}{%- set ns.first_user = loop.index0 %}{%- endif %}"
        "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
        "{{- bos_token }}"
        "{%- for message in turns %}"
        "{%- if message['role'] == 'user' %}"
        "{%- if has_system and loop.index0 == ns." + system_on + "_user %}"
        "{{- '" + open_ + "' + system + '\n\n' + message['content'] + '" + close + "' }}"
        "{%- else %}{{- '" + open_ + "' + message['content'] + '" + close + "' }}{%- endif %}"
        "{%- elif message['role'] == 'assistant' %}{{- " + answer + " }}"
        "{%- else %}" + _ONLY_TEXT_ROLES + "{%- endif %}"
        "{%- endfor %}"
    )


# Mistral v1 (Mistral-7B-Instruct-v0.1, Mixtral-8x7B-Instruct): `<s> [INST] user [/INST] answer</s> [INST] ...`.
MISTRAL_V1_TEMPLATE = _instruct(" [INST] ", " [/INST]", "' ' + message['content'] + eos_token", "first")
# Mistral v2/v3 (Mistral-7B-Instruct-v0.2/v0.3, Mixtral-8x22B): `<s>[INST] user[/INST] answer</s>`; the answer is
# trimmed, as in Mistral's format.
MISTRAL_V2V3_TEMPLATE = _instruct("[INST] ", "[/INST]", "' ' + message['content'] | trim + eos_token", "last")
# Mistral v3 Tekken (Mistral-Nemo-Instruct): `<s>[INST]user[/INST]answer</s>`, no spaces around the markers.
MISTRAL_V3_TEKKEN_TEMPLATE = _instruct("[INST]", "[/INST]", "message['content'] + eos_token", "last")

# Mistral v7 Tekken (Mistral-Small-24B-Instruct-2501 and later): `<s>[SYSTEM_PROMPT]system[/SYSTEM_PROMPT]`, then
# `[INST]user[/INST]answer</s>`, an image part written `[IMG]`. Without a system message no system block is
# written: the hub template's default system prompt holds today's date, which would change the training text from
# day to day.
MISTRAL_V7_TEKKEN_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' }}" + write_content() + "{{- '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' }}" + write_content("[IMG]") + "{{- '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}" + write_content() + "{{- eos_token }}"
    "{%- else %}" + _ONLY_TEXT_ROLES + "{%- endif %}"
    "{%- endfor %}"
)

# Pixtral (mistral-community/pixtral-12b): Tekken v3's turns with `[IMG]` for an image part; the system text joins
# the last user message.
PIXTRAL_TEMPLATE = (
    leading_system() + alternation_check("turns") + "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in turns %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{{- bos_token }}"
    "{%- for message in turns %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST]' }}{%- if has_system and loop.index0 == ns.last_user %}{{- " + text_of("system") + " + '\n\n' }}"
    "{%- endif %}" + write_content("[IMG]") + "{{- '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}" + write_content("[IMG]") + "{{- eos_token }}"
    "{%- else %}" + _ONLY_TEXT_ROLES + "{%- endif %}"
    "{%- endfor %}"
)

_TEKKEN = ("[INST]", "[/INST]")
TEMPLATES = {
    # v1 and v2 tokenizers spell `[INST]` as ordinary text pieces: only EOS is a special token there.
    "mistral_v1": NamedTemplate(MISTRAL_V1_TEMPLATE, ()),
    "mistral_v2v3": NamedTemplate(MISTRAL_V2V3_TEMPLATE, ()),
    "mistral_v3_tekken": NamedTemplate(MISTRAL_V3_TEKKEN_TEMPLATE, _TEKKEN),
    "pixtral": NamedTemplate(PIXTRAL_TEMPLATE, (*_TEKKEN, "[IMG]"), images=True),
    "mistral_v7_tekken": NamedTemplate(
        MISTRAL_V7_TEKKEN_TEMPLATE, ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", *_TEKKEN), images=True
    ),
}
