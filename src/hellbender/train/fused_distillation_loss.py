"""The distillation loss computed from the student's last hidden states, a chunk of positions at a time
(`kd_fused_loss`): the [tokens x vocabulary] logits never exist at once, only one chunk's.

The loss is `train/distillation_loss.py`'s, term for term (`summed_parts` on each chunk's logits), over the positions
whose next token is trained only (prompt positions are not projected at all). Each chunk's gradients with respect to
its hidden states and the output layer's weight are computed in the forward pass, while its logits exist, and kept
for the backward pass, which only scales them: [trained tokens x hidden] for the hidden states and one copy of the
output weight's gradient (when the weight trains) instead of the logits and their softmax.
"""

from __future__ import annotations

from typing import Any

import torch

from hellbender.models.output_head import OutputHead
from hellbender.train.distillation_loss import (
    DistillationLoss,
    LossParts,
    denominator_of,
    summed_parts,
    trained_positions,
    weighted_parts,
)


class _ChunkedDistillation(torch.autograd.Function):
    """Inputs: hidden [N, H] of trained positions, the output layer's weight and bias (may be None), then the
    non-tensor settings and the labels and targets of the N positions. Outputs: the weighted loss and its two
    parts (the parts carry no gradient)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        head: OutputHead,
        labels: torch.Tensor,
        targets: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        settings: DistillationLoss,
        denominator: torch.Tensor | int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wants = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if wants[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wants[2] else None
        sums = torch.zeros(2, dtype=torch.float32, device=hidden.device)
        start = 0
        for part in head.chunks(hidden):
            end = start + part.shape[0]
            with torch.enable_grad():
                leaves = [
                    None if t is None else t.detach().requires_grad_(want)
                    for t, want in zip((part, weight, bias), wants, strict=True)
                ]
                kd_sum, ce_sum = summed_parts(
                    head.logits(*leaves), labels[start:end], *(t[start:end] for t in targets), settings
                )
                loss = weighted_parts(kd_sum, ce_sum, denominator, settings).loss
                trainable = [leaf for leaf, want in zip(leaves, wants, strict=True) if want]
                grads = iter(torch.autograd.grad(loss, trainable) if trainable and loss.requires_grad else ())
            if wants[0]:
                grad_hidden[start:end] = next(grads, 0.0)
            if wants[1]:
                grad_weight.add_(next(grads, 0.0))
            if wants[2]:
                grad_bias.add_(next(grads, 0.0))
            sums += torch.stack([kd_sum.detach(), ce_sum.detach()]).float()
            start = end
        parts = weighted_parts(sums[0], sums[1], denominator, settings)
        ctx.save_for_backward(
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        )
        ctx.mark_non_differentiable(parts.kd, parts.ce)
        return parts.loss, parts.kd, parts.ce

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return (*scaled, None, None, None, None, None)


def fused_distillation_loss(
    head: OutputHead,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    target_ids: torch.Tensor,
    target_logprobs: torch.Tensor,
    target_mask: torch.Tensor,
    settings: DistillationLoss,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> LossParts:
    """`distillation_loss` of the logits `head` computes from `hidden` [B, T, H], without computing them all at
    once. Same arguments otherwise."""
    hidden, labels, *targets = trained_positions(hidden, labels, target_ids, target_logprobs, target_mask)
    denominator = denominator_of(labels.numel(), num_items_in_batch, hidden.device)
    loss, kd, ce = _ChunkedDistillation.apply(
        hidden, head.module.weight, head.module.bias, head, labels, tuple(targets), settings, denominator
    )
    return LossParts(loss=loss, kd=kd, ce=ce)
