"""A reward model that scores completions during online RL (a `trl.reward_funcs` entry that is a directory or a hub
id): a sequence-classification checkpoint with one score, frozen, in the run's dtype, with its own tokenizer (TRL
renders each prompt and completion with it, chat template included). Validation has checked what it can
(`config/reward_functions.py`); what only loading finds is reported here, one paragraph."""

from __future__ import annotations

from typing import Any

from hellbender.errors import ConfigError


def load_reward_scorer(source: str, name: str, dtype: Any) -> tuple[Any, Any]:
    """(model, tokenizer) of the reward model at `source` (a resolved directory or a hub id), named `name` in the
    config."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        model = AutoModelForSequenceClassification.from_pretrained(source, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"`trl.reward_funcs` names `{name}` as a reward model, and loading it failed: {reason}. Name a directory "
            "holding a sequence-classification model and its tokenizer (`reward_model: true` saves both), or a hub "
            "id you can download."
        ) from None
    model.requires_grad_(False)
    return model.eval(), tokenizer
