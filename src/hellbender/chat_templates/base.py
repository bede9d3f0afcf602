"""What a named chat template is: its Jinja text and the marker tokens the tokenizer must know."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NamedTemplate:
    """A chat template hellbender ships. `markers` are the template's own structural tokens (turn headers,
    end-of-turn): each must be one token of the tokenizer, or the model trains on them as ordinary text pieces
    and the end of a turn cannot be found. Tokens the template takes from the tokenizer (`bos_token`,
    `eos_token`) are not listed: they are the tokenizer's by definition."""

    jinja: str
    markers: tuple[str, ...]
    images: bool = False  # writes image parts (vision-language rows); a text-only template refuses them


def alternation_check(turns: str) -> str:
    """Jinja that refuses a conversation (the messages in variable `turns`) whose roles do not alternate
    user, assistant, user, ... — the families whose format has no other shape raise this themselves."""
    return (
        "{%- for message in " + turns + " %}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{- raise_exception('This chat template needs the turns after the optional first system message to "
        "alternate user, assistant, user, assistant, ... (message ' ~ loop.index0 ~ ' is ' ~ message['role'] "
        "~ ')') }}"
        "{%- endif %}"
        "{%- endfor %}"
    )


def leading_system(default: str = "") -> str:
    """Jinja that sets `system` (the first message's content when it is a system message, else `default`),
    `has_system` and `turns` (the other messages)."""
    return (
        "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
        "{%- if has_system %}"
        "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
        "{%- else %}{%- set system = " + repr(default) + " %}{%- set turns = messages %}{%- endif %}"
    )


def text_of(content: str) -> str:
    """A Jinja expression for the text of `content` (a Jinja expression): a string as is, a list of parts as its
    text parts joined."""
    return (
        "(" + content + " if " + content + " is string else " + content + " | selectattr('type', 'equalto', 'text')"
        " | map(attribute='text') | join(''))"
    )


def write_content(image: str | None = None, trim: bool = False) -> str:
    """Jinja statements writing the current `message`'s content: a string as is, a list of parts (vision-language
    rows) as its text parts in order with `image` for each image part; each text trimmed when the family's
    format trims. A family without images refuses image parts."""
    cut = " | trim" if trim else ""
    on_image = "{%- elif part['type'] == 'image' %}{{- '" + image + "' }}" if image else ""
    return (
        "{%- if message['content'] is string %}{{- message['content']" + cut + " }}"
        "{%- else %}{%- for part in message['content'] %}"
        "{%- if part['type'] == 'text' %}{{- part['text']" + cut + " }}" + on_image + "{%- else %}"
        "{{- raise_exception('This chat template cannot write a message part of type `' ~ part['type'] ~ '`') }}"
        "{%- endif %}{%- endfor %}{%- endif %}"
    )


def refusing_parts(name: str, template: str, vision_names: list[str]) -> str:
    """`template` preceded by a check that every message is plain text, for a template without image support:
    without it a list of parts would be written as its Python repr."""
    return (
        "{%- for message in messages %}{%- if message['content'] is not string %}"
        "{{- raise_exception('chat_template: " + name + " writes text messages only, and this conversation has "
        "content parts (images); use tokenizer_default (the template that comes with the model) or a named "
        "template that writes images: " + ", ".join(vision_names) + "') }}"
        "{%- endif %}{%- endfor %}" + template
    )
