"""Chat templates hellbender knows by name, and how a config's choice becomes a Jinja string.

Each family's templates live in their own module as Jinja text written to render the family's published
format for text conversations (system, user, assistant and, where the family has one, tool turns) and the
generation prompt. Every message's content is written as is (a family whose format trims contents says so),
because training labels are found by locating each content in the rendered text.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hellbender.chat_templates import (
    chatml,
    cohere,
    deepseek,
    exaone,
    gemma,
    granite,
    jamba,
    llama,
    mistral,
    nemotron,
    phi,
)
from hellbender.chat_templates.base import NamedTemplate, refusing_parts
from hellbender.chat_templates.chatml import CHATML_TEMPLATE
from hellbender.errors import ConfigError

__all__ = [
    "CHATML_TEMPLATE",
    "FALLBACK_PREFIX",
    "NAMED_TEMPLATES",
    "TEMPLATE_NAMES",
    "NamedTemplate",
    "is_known_template",
    "known_names_text",
    "named_template_text",
    "not_shipped_reason",
    "resolve_chat_template",
]

NAMED_TEMPLATES: dict[str, NamedTemplate] = {
    **chatml.TEMPLATES,
    **llama.TEMPLATES,
    **gemma.TEMPLATES,
    **mistral.TEMPLATES,
    **phi.TEMPLATES,
    **deepseek.TEMPLATES,
    **cohere.TEMPLATES,
    **exaone.TEMPLATES,
    **granite.TEMPLATES,
    **jamba.TEMPLATES,
    **nemotron.TEMPLATES,
}
_VISION = sorted(name for name, template in NAMED_TEMPLATES.items() if template.images)
NAMED_TEMPLATES = {
    name: template if template.images else replace(template, jinja=refusing_parts(name, template.jinja, _VISION))
    for name, template in NAMED_TEMPLATES.items()
}
TEMPLATE_NAMES = ("tokenizer_default", "jinja", *NAMED_TEMPLATES)
# `tokenizer_default_fallback_<name>`: the tokenizer's own template when it has one, else the named template.
FALLBACK_PREFIX = "tokenizer_default_fallback_"


_OWN = "use `tokenizer_default`, which renders with the model's own template"
_COMMAND_A = (
    "Command A's format opens every conversation with Cohere's long default preamble (several fixed paragraphs; "
    "a system message only joins it as a developer preamble), text hellbender does not ship; " + _OWN
)
# Axolotl's template names that hellbender does not ship, and why.
NOT_SHIPPED = {
    "alpaca": "Alpaca is a row format here: use `type: alpaca` on the dataset",
    "llava": "the LLaVA-1.5 format (llava-hf's template) follows each answer with a space and no end-of-turn token "
    "of its own (no EOS either), so a model trained on it never learns where its turn stops; write a template whose "
    "answers end with a special token (EOS) in `chat_template_jinja`, or use `tokenizer_default` if your LLaVA "
    "checkpoint's own template ends its answers with one",
    "metharme": "the Metharme format closes only the conversation's last answer with EOS: every earlier answer runs "
    "straight into the next `<|user|>` tag, which Metharme models spell as ordinary text, so those answers have no "
    "end-of-turn token of their own; write a template whose answers end with a special token in "
    "`chat_template_jinja`",
    "command_a": _COMMAND_A,
    "command_a_tool_use": _COMMAND_A,
    "command_a_rag": _COMMAND_A,
}


def not_shipped_reason(name: str) -> str | None:
    """Why an Axolotl template name (or its fallback form) is not available here; None for other names."""
    return NOT_SHIPPED.get(name.removeprefix(FALLBACK_PREFIX))


def is_known_template(name: str) -> bool:
    return name in TEMPLATE_NAMES or (
        name.startswith(FALLBACK_PREFIX) and name[len(FALLBACK_PREFIX) :] in NAMED_TEMPLATES
    )


def named_template_text(name: str) -> str | None:
    """The Jinja text a name stands for (a fallback name's named template), for cache keys; None for other names."""
    named = NAMED_TEMPLATES.get(name.removeprefix(FALLBACK_PREFIX))
    return named.jinja if named else None


def known_names_text() -> str:
    """The accepted values of `chat_template`, for error messages and docs."""
    return ", ".join(f"`{n}`" for n in TEMPLATE_NAMES) + f", and `{FALLBACK_PREFIX}<name>` for any of the named ones"


def resolve_chat_template(name: str | None, jinja: str | None, tokenizer: Any) -> str:
    """The Jinja template for a config's `chat_template` / `chat_template_jinja` pair."""
    if name == "jinja" or (name is None and jinja):
        return jinja  # presence checked by config validation
    if name is None or name == "tokenizer_default":
        return _tokenizer_template(tokenizer)
    if name.startswith(FALLBACK_PREFIX) and getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    named = NAMED_TEMPLATES.get(name.removeprefix(FALLBACK_PREFIX))
    if named is None:  # config validation refuses unknown names first; this guards direct callers
        raise ConfigError(f"`chat_template: {name}` is not a known chat template. Known: {known_names_text()}.")
    _check_markers(name, named, tokenizer)
    return named.jinja


def _tokenizer_template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError(
            "The tokenizer has no chat template, so `chat_template: tokenizer_default` cannot render "
            "conversations. Set `chat_template` to a named template for the model's family (e.g. `chatml`, "
            "`llama3`), or `chat_template: jinja` with `chat_template_jinja`."
        )
    return template


def _check_markers(name: str, named: NamedTemplate, tokenizer: Any) -> None:
    """Refuse a template whose marker tokens the tokenizer would split into ordinary text pieces."""
    known = set(tokenizer.get_added_vocab()) | set(getattr(tokenizer, "all_special_tokens", ()))
    missing = [marker for marker in named.markers if marker not in known]
    if missing:
        raise ConfigError(
            f"`chat_template: {name}` writes the marker tokens {', '.join(f'`{m}`' for m in missing)}, which this "
            "tokenizer does not have as single tokens: training would see them as pieces of ordinary text and "
            "the end of each turn could not be found. Use the model's own template (`chat_template: "
            "tokenizer_default`), choose the named template of the model's family, or load a tokenizer that has "
            "these tokens (`tokenizer_config`)."
        )
