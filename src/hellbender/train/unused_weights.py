"""Trained weights that the first step's backward did not reach, named once, before the first optimizer step.

A weight gets no gradient when its layer takes no part in the forward for this data: an encoder-decoder family's
cross-attention trained as a decoder alone, a vision tower in text-only training, a BERT pooler the language-model
head never reads, a router projection used only to pick experts, a projection whose output only ever meets a zero
derivative (Doge's `dt_proj`, Gemma 3n's per-layer input gate on tiny random weights). `lora_target_linear` adapts
every linear layer it can
and cannot know which ones the forward will use; an adapter there stays at its initial weights for the whole run, so
the run says which, rather than count it as trained."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger("hellbender")


def weights_without_gradient(model: Any) -> list[str]:
    """Names of the trainable parameters of `model` that the first backward left without a gradient (`.grad` None)
    or with an all-zero one. A LoRA A matrix is judged by its None only: its first gradient is zero by design (B
    starts at zero), and its layer is named through B."""
    return [
        name
        for name, parameter in model.named_parameters()
        if parameter.requires_grad
        and (parameter.grad is None or (".lora_A." not in name and _all_zero_local(parameter.grad)))
    ]


def _all_zero_local(grad: Any) -> bool:
    """Whether a plain tensor is all zeros; a sharded one (FSDP2's DTensor) holds only this process's part, which
    says nothing about the whole, so it counts as reached."""
    import torch

    return type(grad) is torch.Tensor and not bool(grad.any())


def unused_modules(names: list[str]) -> list[str]:
    """The modules those parameters belong to (a LoRA pair counts once, under the layer it adapts)."""
    modules = {name.rsplit(".", 1)[0].split(".lora_")[0] for name in names}
    return sorted(module.removeprefix("base_model.model.") for module in modules)


class UnusedWeightsNotice(TrainerCallback):
    """Warns once, at the first optimizer step, about trainable weights that got no gradient. Skipped under DeepSpeed,
    which keeps gradients in its own buffers rather than in `.grad`."""

    def __init__(self) -> None:
        self.checked = False

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.checked or model is None or args.deepspeed:
            return
        self.checked = True
        unused = unused_modules(weights_without_gradient(model))
        if unused:
            shown = ", ".join(f"`{m}`" for m in unused[:6]) + (
                f" and {len(unused) - 6} more" if len(unused) > 6 else ""
            )
            logger.warning(
                "%d trained module(s) got no gradient in the first step, so their weights will not change: %s. Their "
                "layers take no part in this model's forward for this data; leave them out of `lora_target_modules` "
                "(or freeze them) to save their memory.",
                len(unused),
                shown,
            )
