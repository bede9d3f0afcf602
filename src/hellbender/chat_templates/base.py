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
