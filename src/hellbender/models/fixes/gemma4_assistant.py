"""Gemma 4 assistants (`gemma4_assistant`, `gemma4_unified_assistant`): draft models for speculative decoding that
transformers lists among its causal language models. Every layer of an assistant reuses the keys and values of its
target Gemma 4 model, and its forward takes the target's hidden states (`inputs_embeds`) and K/V
(`shared_kv_states`) instead of token ids; it fails on token ids alone ("inputs_embeds and shared_kv_states cannot
be None"). Training one needs its target model running beside it, which hellbender's causal-LM training does not
do, so the family is refused by name when its config is read (a test checks that the forward still needs them)."""

from __future__ import annotations

from typing import Any

from hellbender.errors import ConfigError

MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")


def refuse_assistant(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return
    raise ConfigError(
        f"`base_model` is a `{model_type}` model, a Gemma 4 assistant (a draft model for speculative decoding): its "
        "forward reads the hidden states and the keys and values of its target Gemma 4 model, not token ids, so it "
        "cannot train on its own as a causal language model, and hellbender does not train a drafter against its "
        "target. Train the target model (`gemma4` / `gemma4_text`) instead."
    )
