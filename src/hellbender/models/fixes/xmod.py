"""X-MOD (`xmod`): a RoBERTa with one adapter per language in every layer. Its forward needs the language of the
input; without `lang_ids` it takes the config's `default_language`, and a config without one fails inside the first
forward ("Input language unknown"). hellbender passes no `lang_ids`, so the language must be in the config."""

from __future__ import annotations

from typing import Any

from hellbender.errors import ConfigError

MODEL_TYPES = {"xmod"}


def check_language(config: Any) -> None:
    if getattr(config, "model_type", None) not in MODEL_TYPES or config.default_language is not None:
        return
    languages = ", ".join(f"`{language}`" for language in config.languages)
    raise ConfigError(
        "`base_model` is an X-MOD (`xmod`) model, whose layers hold one adapter per language, and its config sets no "
        "`default_language`, so it cannot tell which adapters the training text uses. Set "
        f"`overrides_of_model_config: {{default_language: <language>}}` with one of its languages: {languages}."
    )
