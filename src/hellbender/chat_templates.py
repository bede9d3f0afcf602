"""Chat templates hellbender knows by name, and how a config's choice becomes a Jinja string."""

from __future__ import annotations

from typing import Any

from hellbender.errors import ConfigError

# ChatML: each message is `<|im_start|>role\ncontent<|im_end|>\n`; the tokenizer must know both markers.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEMPLATE_NAMES = ("tokenizer_default", "chatml", "jinja")


def resolve_chat_template(name: str | None, jinja: str | None, tokenizer: Any) -> str:
    """The Jinja template for a config's `chat_template` / `chat_template_jinja` pair."""
    if name == "jinja" or (name is None and jinja):
        return jinja  # presence checked by config validation
    if name == "chatml":
        return CHATML_TEMPLATE
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError(
            "The tokenizer has no chat template, so `chat_template: tokenizer_default` cannot render "
            "conversations. Set `chat_template: chatml`, or `chat_template: jinja` with `chat_template_jinja`."
        )
    return template
