"""XLNet (`xlnet`), trained causally (`attn_type: uni`, set by encoders.py): transformers adds the padding mask in
place to its causal mask, which has no batch dimension, so any batch of more than one row with an `attention_mask`
fails inside the model (transformers 5.24: "output with shape [L, L, 1, 1] doesn't match the broadcast shape").

With causal attention and padding after each row's tokens, the padding mask changes nothing a real token computes:
it never sees a later position, and the padding's own outputs carry no labels. hellbender drops the mask in that
case (tests/test_layer_list_checkpointing.py checks the logits against each row alone, and that transformers still
fails without this). A batch padded on the left keeps its mask, and transformers' error with it."""

from __future__ import annotations

from typing import Any

import torch

MODEL_TYPE = "xlnet"


def drop_trailing_padding_mask(model: Any) -> None:
    """On a causal XLNet `model`, a forward pre-hook that drops an `attention_mask` whose rows are ones then
    zeros; every other model is left as it is."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != MODEL_TYPE or getattr(config, "attn_type", None) != "uni":
        return
    model.register_forward_pre_hook(_without_trailing_padding_mask, with_kwargs=True)


def _without_trailing_padding_mask(module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    mask = kwargs.get("attention_mask")
    if mask is None or not _padding_only_at_the_end(mask):
        return None
    return args, {**kwargs, "attention_mask": None}


def _padding_only_at_the_end(mask: torch.Tensor) -> bool:
    """Every row's ones come before its zeros (a mask that never rises from 0 back to 1)."""
    return mask.dim() == 2 and bool((mask[:, 1:] <= mask[:, :-1]).all())
