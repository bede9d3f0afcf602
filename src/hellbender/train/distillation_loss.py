"""The knowledge-distillation loss: `kd_alpha` x a divergence between the teacher's top-k distribution and the
student's on those k tokens, plus `kd_ce_alpha` x the usual next-token cross-entropy, on trained positions only.

Targets are per token (`data/teacher_targets.py`): the target at token t is the teacher's distribution for token t,
compared with the student's logits at t - 1, exactly as labels are shifted for the cross-entropy. Both parts are
summed over positions and divided by the trained tokens of the whole accumulated batch (`num_items_in_batch`), so
gradient accumulation stays exact; without it (evaluation) by this batch's trained tokens. The student's logits are
cast to float32 for both parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hellbender.data.formats.base import IGNORE_INDEX


@dataclass(frozen=True)
class DistillationLoss:
    """The config's `kd_*` loss settings."""

    alpha: float = 1.0  # kd_alpha
    ce_alpha: float = 0.0  # kd_ce_alpha
    temperature: float = 1.0  # kd_temperature
    beta: float = 0.0  # kd_beta: 0 forward KL, 1 reverse KL, between: generalised Jensen-Shannon
    normalize_topk: bool = False  # kd_normalize_topk / kd_top_k_before_softmax
    zscore_base_temp: float | None = None  # kd_zscore_base_temp

    @classmethod
    def from_config(cls, cfg: Any) -> DistillationLoss:
        return cls(
            alpha=cfg.kd_alpha,
            ce_alpha=cfg.kd_ce_alpha,
            temperature=cfg.kd_temperature,
            beta=cfg.kd_beta,
            normalize_topk=cfg.kd_normalize_topk or cfg.kd_top_k_before_softmax,
            zscore_base_temp=cfg.kd_zscore_base_temp,
        )


@dataclass
class LossParts:
    """One batch's loss and its two parts (each before its weight)."""

    loss: torch.Tensor
    kd: torch.Tensor
    ce: torch.Tensor


def _masked_log_softmax(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Padded slots get -inf before the softmax and 0 after, so neither they nor their gradients are ever NaN.
    return F.log_softmax(values.masked_fill(~mask, float("-inf")), dim=-1).masked_fill(~mask, 0.0)


def _zscored(values: torch.Tensor, mask: torch.Tensor, base_temperature: float) -> torch.Tensor:
    """Each row standardised over its valid slots (mean 0, standard deviation 1), divided by `base_temperature`."""
    weight = mask.to(values.dtype)
    count = weight.sum(-1, keepdim=True).clamp_min(1.0)
    values = values.masked_fill(~mask, 0.0)
    mean = (values * weight).sum(-1, keepdim=True) / count
    variance = (weight * (values - mean) ** 2).sum(-1, keepdim=True) / count
    return (values - mean) / variance.clamp_min(1e-9).sqrt() / base_temperature


def topk_divergence(
    student_logits: torch.Tensor,
    target_ids: torch.Tensor,
    target_logprobs: torch.Tensor,
    target_mask: torch.Tensor,
    settings: DistillationLoss,
) -> torch.Tensor:
    """Per position ([N]): the divergence between the teacher's top-k log-probabilities `target_logprobs` ([N, k],
    already at `temperature`) and the student's log-probabilities of the same tokens, from `student_logits` ([N,
    vocab]) divided by the temperature: over the whole vocabulary, or over the k tokens (`normalize_topk`), or both
    sides z-scored over the k tokens (`zscore_base_temp`). Slots where `target_mask` is false count nothing."""
    scaled = student_logits.float()
    if settings.temperature != 1.0:  # a pass over the logits each way, skipped where it changes nothing
        scaled = scaled / settings.temperature
    gathered = scaled.gather(-1, target_ids)
    teacher = target_logprobs.float()
    if settings.zscore_base_temp is not None:
        log_p = _masked_log_softmax(_zscored(teacher, target_mask, settings.zscore_base_temp), target_mask)
        log_q = _masked_log_softmax(_zscored(gathered, target_mask, settings.zscore_base_temp), target_mask)
    elif settings.normalize_topk:
        log_p = teacher.masked_fill(~target_mask, 0.0)
        log_q = _masked_log_softmax(gathered, target_mask)
    else:
        log_p = teacher.masked_fill(~target_mask, 0.0)
        log_q = (gathered - torch.logsumexp(scaled, dim=-1, keepdim=True)).masked_fill(~target_mask, 0.0)
    p, q = log_p.exp(), log_q.exp()
    if settings.beta == 0.0:
        terms = p * (log_p - log_q)
    elif settings.beta == 1.0:
        terms = q * (log_q - log_p)
    else:
        beta = settings.beta
        log_m = (beta * p + (1 - beta) * q).clamp_min(torch.finfo(p.dtype).tiny).log()
        terms = beta * p * (log_p - log_m) + (1 - beta) * q * (log_q - log_m)
    return torch.where(target_mask, terms, 0.0).sum(-1)


def trained_positions(
    values: torch.Tensor,
    labels: torch.Tensor,
    target_ids: torch.Tensor,
    target_logprobs: torch.Tensor,
    target_mask: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The positions whose next token is trained: `values` ([B, T, ...], the student's logits or last hidden states)
    at those positions ([N, ...]), and the labels [N] and targets [N, k] of the tokens they predict."""
    device = values.device
    labels = labels.to(device)
    trained = torch.zeros_like(labels, dtype=torch.bool)
    trained[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    # Flat indices, found once (the host waits here to learn N): selecting rows by index, the backward scatters them
    # back without waiting again, where a boolean mask's backward would.
    at = trained.flatten().nonzero().squeeze(1)
    predicted = at + 1  # the token each position predicts: the next one, in the same row (the last is never trained)

    def rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return t.to(device).flatten(0, 1).index_select(0, index)

    return (
        rows(values, at),
        rows(labels, predicted),
        *(rows(t, predicted) for t in (target_ids, target_logprobs, target_mask)),
    )


def summed_parts(
    logits: torch.Tensor,
    labels: torch.Tensor,
    target_ids: torch.Tensor,
    target_logprobs: torch.Tensor,
    target_mask: torch.Tensor,
    settings: DistillationLoss,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the divergence summed over the positions that have a target, the cross-entropy summed over all), for logits
    [N, V] of trained positions with their labels [N] and targets [N, k] (`trained_positions`)."""
    # Positions without a target stay (selecting the others would make the host wait): every slot of theirs is
    # masked, so they add nothing to the divergence, nor a gradient.
    kd_sum = topk_divergence(logits, target_ids, target_logprobs, target_mask, settings).sum()
    # Its own float32 copy: sharing the divergence's would keep the cross-entropy's gradient in float32 until the
    # divergence's joins it (2 bytes more per logit at the peak in bf16, measured on CPU).
    with torch.set_grad_enabled(torch.is_grad_enabled() and settings.ce_alpha > 0):
        ce_sum = F.cross_entropy(logits.float(), labels, reduction="sum")
    return kd_sum, ce_sum


def denominator_of(
    trained: int, num_items_in_batch: torch.Tensor | int | None, device: torch.device
) -> torch.Tensor | int:
    """What both parts are divided by: the accumulated batch's trained tokens, or without them (evaluation) this
    batch's `trained`."""
    value = trained if num_items_in_batch is None else num_items_in_batch
    return value.to(device) if torch.is_tensor(value) else value


def weighted_parts(
    kd_sum: torch.Tensor, ce_sum: torch.Tensor, denominator: torch.Tensor | int, settings: DistillationLoss
) -> LossParts:
    """The two sums divided by `denominator` and weighted into the loss."""
    kd, ce = kd_sum / denominator, ce_sum / denominator
    loss = settings.alpha * kd + (settings.ce_alpha * ce if settings.ce_alpha > 0 else 0.0)
    return LossParts(loss=loss, kd=kd.detach(), ce=ce.detach())


def distillation_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    target_ids: torch.Tensor,
    target_logprobs: torch.Tensor,
    target_mask: torch.Tensor,
    settings: DistillationLoss,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> LossParts:
    """`alpha` x the summed top-k divergence over trained positions that have a target + `ce_alpha` x the summed
    cross-entropy over trained positions, both divided by the accumulated batch's trained tokens. `logits` [B, T, V],
    `labels` [B, T], targets [B, T, k], all per token (unshifted)."""
    logits, labels, *targets = trained_positions(logits, labels, target_ids, target_logprobs, target_mask)
    kd_sum, ce_sum = summed_parts(logits, labels, *targets, settings)
    return weighted_parts(kd_sum, ce_sum, denominator_of(labels.numel(), num_items_in_batch, logits.device), settings)
