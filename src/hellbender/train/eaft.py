"""Entropy-aware focal training (`use_eaft`): each trained token's cross-entropy is weighted by how uncertain the model
is at that position, measured as the entropy of the softmax over its `k` largest logits, raised to `alpha`. Confident
positions (low entropy) weigh little, uncertain ones weigh more; the weights are constants (no gradient)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from hellbender.data.formats.base import IGNORE_INDEX


def top_k_entropy(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Entropy (nats) of the softmax over the `k` largest logits of each row; `k` is capped at the vocabulary size.
    The top k are picked in the logits' own dtype (rounding to float32 afterwards keeps their order) and the entropy
    is computed in float32."""
    top = torch.topk(logits, k=min(k, logits.shape[-1]), dim=-1).values.float()
    log_p = F.log_softmax(top, dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def eaft_loss(
    outputs: Any,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    *,
    alpha: float,
    k: int,
) -> torch.Tensor:
    """Sum over trained tokens of entropy^alpha x cross-entropy, divided by the trained tokens of the whole accumulated
    batch (`num_items_in_batch`), so gradient accumulation stays exact as with the plain loss; without it (evaluation)
    divided by this batch's trained tokens. Labels are shifted as for the plain causal loss: position t predicts
    label t + 1, and the last position predicts nothing."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    vocab = logits.shape[-1]
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1).to(logits.device)
    flat = logits.reshape(-1, vocab)
    trained = targets != IGNORE_INDEX
    token_loss = F.cross_entropy(flat.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    with torch.no_grad():
        weights = top_k_entropy(flat, k).pow(alpha)
    # `where`, not a product with the mask: a position that trains nothing must add 0 even if its weight is not finite.
    total = torch.where(trained, token_loss * weights, 0.0).sum()
    if num_items_in_batch is None:
        return total / trained.sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def eaft_loss_function(alpha: float, k: int) -> Callable[..., torch.Tensor]:
    """The loss the Trainer is given as `compute_loss_func` for `use_eaft: true`."""
    return partial(eaft_loss, alpha=alpha, k=k)
