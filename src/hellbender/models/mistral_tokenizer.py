"""Mistral's own tokenizer (`tokenizer_use_mistral_common`): transformers' `MistralCommonBackend` over the model's
`tekken.json` or `tokenizer.model.v*` file, read by the mistral-common library."""

from __future__ import annotations

from typing import Any

from hellbender.errors import ConfigError


def load_mistral_common_tokenizer(source: str, revision: str | None) -> Any:
    """The tokenizer in test mode: plain text gets BOS only (as `alpaca` and `completion` rows expect), and chat rows
    are encoded in fine-tuning mode by `data.formats.mistral_chat`."""
    try:
        from transformers.tokenization_mistral_common import MistralCommonBackend
    except ImportError as exc:
        raise ConfigError(
            f"`tokenizer_use_mistral_common: true` needs mistral-common, which does not import here ({exc}). Install "
            "it with `pip install 'hellbender[mistral]'`, or remove the key."
        ) from None
    try:
        return MistralCommonBackend.from_pretrained(source, mode="test", revision=revision or "main")
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"Could not load a mistral-common tokenizer from `{source}`: {str(exc).rstrip('.')}. With "
            "`tokenizer_use_mistral_common: true`, `base_model` / `tokenizer_config` must hold a `tekken.json` or "
            "`tokenizer.model.v*` file (a hub id needs network access); remove the key to load `tokenizer.json`."
        ) from None
