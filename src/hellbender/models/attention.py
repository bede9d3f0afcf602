"""SDPA for attention heads wider than flash attention's 256, without the math-kernel fallback.

PyTorch's SDPA picks a kernel per call. Flash attention takes head_dim <= 256; the memory-efficient kernel takes
wider heads but not `enable_gqa`. transformers up to at least 5.8 passes `enable_gqa=True` whenever there is no
mask, so a grouped-query layer with head_dim 512 (Gemma 4's full-attention layers) lands on the math kernel, which
materialises the [batch, heads, seq, seq] scores: gigabytes per layer at 8k tokens. Newer releases expand K/V
instead, unless `TRANSFORMERS_SDPA_FORCE_GQA=1`.

`LARGE_HEAD_SDPA` is transformers' SDPA attention with one change for heads wider than 256: K/V heads are expanded
to the query heads, and on CUDA the math kernel is excluded, so a case with no efficient kernel fails loudly
instead of silently using O(seq^2) memory. Narrower heads (sliding layers, vision towers) go through transformers'
own SDPA function unchanged, keeping flash attention where it applies. Masks are built exactly as for "sdpa".
Measured memory: docs/gemma4.md.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hellbender.errors import EnvironmentProblem

LARGE_HEAD_SDPA = "hellbender_sdpa"
FLASH_MAX_HEAD_DIM = 256
EFFICIENT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def large_head_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    q_length, kv_length = query.shape[2], key.shape[2]
    # Decoding and cache prefill (queries shorter than keys) keep transformers' handling: tiny score matrices.
    if query.shape[-1] <= FLASH_MAX_HEAD_DIM or q_length != kv_length or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal and attention_mask is None and q_length > 1)
    with sdpa_kernel(EFFICIENT_BACKENDS) if query.is_cuda else nullcontext():
        try:
            output = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal
            )
        except RuntimeError as exc:
            if "No available kernel" not in str(exc):
                raise
            raise EnvironmentProblem(
                f"No efficient SDPA kernel takes this attention (head_dim {query.shape[-1]}, dtype {query.dtype}, "
                f"mask {None if attention_mask is None else attention_mask.dtype}), and hellbender does not let it "
                "fall back to the math kernel, which would hold the full [batch, heads, seq, seq] scores in memory. "
                "Train in bf16 or fp16, or set `attn_implementation: eager` to accept that memory."
            ) from None
    return output.transpose(1, 2).contiguous(), None


def register_large_head_sdpa() -> str:
    """Make `LARGE_HEAD_SDPA` a transformers attention implementation (idempotent); returns its name."""
    AttentionInterface.register(LARGE_HEAD_SDPA, large_head_sdpa)
    AttentionMaskInterface.register(LARGE_HEAD_SDPA, sdpa_mask)
    return LARGE_HEAD_SDPA


def widest_head_dim(model: Any) -> int:
    heads = [m.head_dim for m in model.modules() if isinstance(getattr(m, "head_dim", None), int)]
    return max(heads, default=0)
