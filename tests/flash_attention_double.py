"""A stand-in for the flash-attention package, so that transformers' own flash-attention path (its wrapper, which
finds packed documents from the position ids, and its varlen call) runs on machines without flash-attn.

`use_flash_attention(monkeypatch, model, varlen)` makes transformers load `varlen` as flash attention's varlen entry
point and switches every attention of `model` to `flash_attention_2`. `exact_varlen` computes what the kernel
computes (each sequence of the flattened batch on its own: causal or not, inside the sliding window) with PyTorch's
SDPA, so a model run through it on CPU in float32 gives the attention of real flash kernels to rounding; on CUDA,
`torch_varlen` calls PyTorch's own flash-attention varlen kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _dense(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1)) -> torch.Tensor:
    """Attention of one [batch, tokens, heads, dim] block with flash attention's causal and window rules."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    n = q.shape[-2]
    i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None]
    allowed = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= j <= i
    if window_size[0] >= 0:  # flash attention's windows are inclusive: (left, right) tokens either side
        allowed &= j >= i - window_size[0]
    if window_size[1] >= 0 and not causal:
        allowed &= j <= i + window_size[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)


def exact_flash(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=None, dropout_p=0.0):
    assert not softcap and not dropout_p, "the stand-in computes neither soft-capping nor dropout"
    return _dense(q, k, v, softmax_scale, causal, window_size)


def exact_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=None,
    dropout_p=0.0,
) -> torch.Tensor:
    """flash attention's varlen call: q, k, v are [total tokens, heads, dim], sequence i spans
    cu_seqlens[i]:cu_seqlens[i + 1]."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k), "the stand-in attends within equal query and key sequences"
    assert not softcap and not dropout_p, "the stand-in computes neither soft-capping nor dropout"
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        out[start:end] = _dense(
            q[None, start:end], k[None, start:end], v[None, start:end], softmax_scale, causal, window_size
        )[0]
    return out


def torch_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
) -> torch.Tensor:
    """flash attention's varlen call through PyTorch's flash-attention varlen kernel (CUDA only)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    groups = q.shape[-2] // k.shape[-2]  # grouped-query attention: older kernels take equal head counts
    k, v = (t.repeat_interleave(groups, dim=-2) for t in (k, v))
    accepted = inspect.signature(varlen_attn).parameters
    options: dict[str, Any] = {}
    if "window_size" in accepted:  # torch 2.13
        options["window_size"] = (window_size[0], 0 if causal else window_size[1])
    else:  # torch 2.11: causal or not, no window
        assert window_size[0] < 0, "this torch's varlen kernel takes no sliding window"
        options["is_causal"] = causal
    if "scale" in accepted:
        options["scale"] = softmax_scale
    else:
        assert softmax_scale is None or abs(softmax_scale - q.shape[-1] ** -0.5) < 1e-9, "kernel scales by 1/sqrt(d)"
    bounds_q, bounds_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    return varlen_attn(q, k, v, bounds_q, bounds_k, int(max_seqlen_q), int(max_seqlen_k), **options)


def use_flash_attention(monkeypatch: Any, model: Any, varlen=exact_varlen) -> None:
    """Make transformers' flash-attention wrapper call `varlen` (and `exact_flash` for unpacked batches), and run
    every attention of `model` through that wrapper."""
    import transformers.modeling_flash_attention_utils as flash_utils

    monkeypatch.setattr(
        flash_utils,
        "_lazy_imports",
        lambda *args, **kwargs: (exact_flash, varlen, None, flash_utils._pad_input, flash_utils._unpad_input),
    )
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)  # load the stand-in, not a cached kernel
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = "flash_attention_2"
