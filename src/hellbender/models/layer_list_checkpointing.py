"""Activation checkpointing for models whose transformers classes offer none: no `GradientCheckpointingLayer` among
their layers and `supports_gradient_checkpointing = False` (CTRL, GPT-1, GPT-NeoX Japanese, XLNet, XLM).

Such a model still runs its layers one after the other from per-layer module lists: `nn.ModuleList`s with one entry
per layer (CTRL's `h`, XLM's `attentions` and `ffns`). hellbender checkpoints every call of those entries with the
function transformers' own layers get (`checkpoint_function`), by giving each entry instance a `forward` that routes
through it in training with gradients on. Classes, parameter names and saved weights stay as they are, and module
hooks (PEFT's, the offloader's) stay outside the checkpoint, as transformers keeps them for its own layers."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial, wraps
from typing import Any

import torch
from torch import nn

# Keyword arguments that hand a layer a cache to write into: a replay in backward would write it a second time.
CACHE_ARGUMENTS = ("layer_past", "past_key_values", "cache", "mems")


def per_layer_modules(model: nn.Module) -> list[list[nn.Module]]:
    """Per layer index, the modules that do that layer's work: the entries of the model's module lists as long as its
    number of layers, outermost lists only (a list inside a layer, such as its experts, is checkpointed with the
    layer). Lists of parameter-only modules (XLM's per-layer norms) are left out: recomputing a norm saves nothing."""
    count = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    if not count:
        return []
    lists = [
        module
        for module in model.modules()
        if isinstance(module, nn.ModuleList) and len(module) == count and all(any(e.children()) for e in module)
    ]
    inner = {
        id(nested)
        for outer in lists
        for entry in outer
        for nested in entry.modules()
        if nested is not entry and isinstance(nested, nn.ModuleList)
    }
    return [list(entries) for entries in zip(*(m for m in lists if id(m) not in inner), strict=True)]


def checkpoint_layer_modules(layers: list[list[nn.Module]], checkpointed: Callable[..., Any]) -> None:
    """Every module of `layers` runs through `checkpointed(layer_call, *args)` when it trains with gradients on."""
    for modules in layers:
        for module in modules:
            module.forward = _checkpointing_forward(module, module.forward, checkpointed)


def _checkpointing_forward(module: nn.Module, forward: Callable[..., Any], checkpointed: Callable[..., Any]):
    @wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        for name in CACHE_ARGUMENTS:
            if kwargs.get(name) is not None:
                kwargs[name] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        return checkpointed(partial(forward, **kwargs), *args)

    return run
