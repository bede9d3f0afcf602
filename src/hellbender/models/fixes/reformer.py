"""Reformer (`reformer`): its layers are reversible. The forward keeps no activations of its layers; the backward
recomputes each layer's input from its output and runs the layer again (a custom autograd function of transformers'
Reformer classes). That is what activation checkpointing would do, so `gradient_checkpointing` would change nothing,
and hellbender refuses a key that does nothing rather than ignore it. Its training batches must also have one fixed
length, which is checked when the config is read.

The reversible layers run inside one custom autograd function whose only tensor input is the embeddings' output:
with frozen embeddings (LoRA) that input needs no gradient, so the function's output has none either and the
adapters inside the layers never learn (the first backward fails: "element 0 of tensors does not require grad").
hellbender makes the embeddings' output require a gradient for this family, which lets the function's backward run
and reach the adapters."""

from __future__ import annotations

import math
from typing import Any

import torch

from hellbender.errors import ConfigError


def refuse_checkpointing_reversible_layers(config: Any) -> None:
    if getattr(config, "model_type", None) != "reformer":
        return
    raise ConfigError(
        "`gradient_checkpointing` is set, but this `reformer` model's layers are reversible: its backward already "
        "recomputes every layer's activations from the layer's output and keeps none from the forward, which is what "
        "checkpointing would do. Set `gradient_checkpointing: false`; the memory saving is there without it."
    )


def check_training_length(config: Any, sequence_len: int, pad_to_sequence_len: bool) -> None:
    """Reformer trains only on batches of one length: with axial position embeddings (the default), exactly the
    product of `axial_pos_shape`; always a multiple of its attention chunk lengths. transformers raises otherwise at
    the first step, after the data work; here it is refused when the config is read, with the keys that fix it."""
    if getattr(config, "model_type", None) != "reformer":
        return
    chunks = [config.lsh_attn_chunk_length, config.local_attn_chunk_length]
    multiple = math.lcm(*(c for c in chunks if c))
    axial = math.prod(config.axial_pos_shape) if config.axial_pos_embds else None
    if pad_to_sequence_len and (sequence_len == axial if axial else sequence_len % multiple == 0):
        return
    length = f"exactly {axial} tokens (the product of its `axial_pos_shape`)" if axial else f"a multiple of {multiple}"
    raise ConfigError(
        f"A `reformer` model trains only on batches {length} long (its attention chunks and axial position "
        f"embeddings require it), and this config has `sequence_len: {sequence_len}`"
        f"{'' if pad_to_sequence_len else ' without `pad_to_sequence_len: true`'}. Set `sequence_len` to that "
        "length and `pad_to_sequence_len: true`, so that every batch is padded to it."
    )


def let_reversible_layers_train(model: Any) -> None:
    """The embeddings' output of a Reformer `model` requires a gradient in every forward with gradients on."""
    if getattr(model.config, "model_type", None) != "reformer":
        return
    model.get_input_embeddings().register_forward_hook(
        lambda module, args, output: output.requires_grad_() if torch.is_grad_enabled() else None
    )
