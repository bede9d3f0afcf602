"""Flex attention compiled with the config's `flex_attn_compile_kwargs`.

transformers' `flex_attention` backend compiles torch's `flex_attention` once per process with torch.compile's
defaults. `flex_attn_compile_kwargs` (Axolotl's key, e.g. `{dynamic: false, mode: max-autotune-no-cudagraphs}`) asks
for other compile settings. hellbender registers an attention implementation of its own through transformers'
`AttentionInterface` whose function calls `torch.compile(flex_attention, **flex_attn_compile_kwargs)`, and registers
transformers' flex mask builder for it through `AttentionMaskInterface`, so padding, sliding windows, chunked layers and
packed documents (read from restarting position ids) are masked exactly as for `flex_attention`. No library code or
attribute is replaced; a model switches to it through `set_attn_implementation`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask

from hellbender.errors import ConfigError

COMPILED_FLEX_PREFIX = "hellbender_flex_attention"
# The keyword arguments of torch.compile that apply to one function (`model` is the function itself).
COMPILE_KEYWORDS = frozenset({"fullgraph", "dynamic", "backend", "mode", "options", "disable"})

# One compiled function per distinct settings, shared by every model of the process: it holds no model state.
_COMPILED: dict[str, Any] = {}


def settings_key(compile_kwargs: dict[str, Any]) -> str:
    return json.dumps(compile_kwargs, sort_keys=True, default=str)


def compiled_flex(compile_kwargs: dict[str, Any]) -> Any:
    key = settings_key(compile_kwargs)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(flex_attention, **compile_kwargs)
    return _COMPILED[key]


def make_attention_function(compile_kwargs: dict[str, Any]) -> Any:
    """The attention function of transformers' interface for these compile settings."""
    flex = compiled_flex(compile_kwargs)

    def compiled_flex_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: BlockMask | torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        softcap: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        unsupported = [name for name in ("s_aux", "position_bias") if kwargs.get(name) is not None]
        if dropout > 0:
            unsupported.append("attention dropout")
        if unsupported:
            raise ConfigError(
                f"`flex_attn_compile_kwargs`: {type(module).__name__} calls attention with {', '.join(unsupported)}, "
                "which hellbender's compiled flex attention does not take. Remove `flex_attn_compile_kwargs` to use "
                "transformers' own flex attention (compiled with torch's defaults)."
            )
        block_mask = attention_mask if isinstance(attention_mask, BlockMask) else None
        # A dense mask (a model that builds its own) is added to the scores; it must be additive (0 / -inf).
        additive = attention_mask if isinstance(attention_mask, torch.Tensor) else None
        if additive is not None and additive.dtype == torch.bool:
            additive = torch.zeros_like(additive, dtype=query.dtype).masked_fill_(~additive, float("-inf"))
        if additive is not None:
            additive = additive[:, :, :, : key.shape[-2]]

        def score_mod(score, batch, head, q_idx, kv_idx):
            if softcap is not None:
                score = softcap * torch.tanh(score / softcap)
            if additive is not None:
                score = score + additive[batch, 0, q_idx, kv_idx]
            return score

        needs_score_mod = softcap is not None or additive is not None
        output = flex(
            query,
            key,
            value,
            score_mod=score_mod if needs_score_mod else None,
            block_mask=block_mask,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
            kernel_options=kwargs.get("kernel_options"),
        )
        return output.transpose(1, 2).contiguous(), None

    return compiled_flex_attention


def register_compiled_flex(compile_kwargs: dict[str, Any]) -> str:
    """Register (idempotently) the attention implementation for these settings; returns its name. Each distinct
    setting gets its own name, so two models of one process with different settings do not share one."""
    digest = hashlib.sha256(settings_key(compile_kwargs).encode()).hexdigest()[:12]
    name = f"{COMPILED_FLEX_PREFIX}_{digest}"
    AttentionInterface.register(name, make_attention_function(compile_kwargs))
    AttentionMaskInterface.register(name, flex_attention_mask)
    return name


def use_compiled_flex(model: Any, compile_kwargs: dict[str, Any]) -> str:
    """Switch a model loaded with `attn_implementation: flex_attention` (transformers checked it supports flex
    attention) to flex attention compiled with `compile_kwargs`. Every sub-model that used flex attention must
    switch; one that cannot is an error, never a silent keep of the default compile."""
    from transformers import PreTrainedModel

    def flex_users() -> list[Any]:
        return [
            m
            for m in model.modules()
            if isinstance(m, PreTrainedModel) and m.config._attn_implementation == "flex_attention"
        ]

    if not flex_users():
        raise ConfigError(
            "`flex_attn_compile_kwargs` is set, but the loaded model does not use flex attention. Set "
            "`attn_implementation: flex_attention`, or remove `flex_attn_compile_kwargs`."
        )
    name = register_compiled_flex(compile_kwargs)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(name)
    if left := flex_users():
        raise ConfigError(
            f"`flex_attn_compile_kwargs` cannot be applied to {type(left[0]).__name__}: it does not let its attention "
            "implementation be changed after loading, so its flex attention would keep transformers' default compile "
            "settings. Remove `flex_attn_compile_kwargs`."
        )
    return name


def check_flex_compiles(
    model: Any, compile_kwargs: dict[str, Any] | None, dtype: torch.dtype, device: torch.device | None = None
) -> None:
    """Compile flex attention for the model's head layout on this GPU and run one forward and backward pass, before
    any data or training work. Inductor cannot lower every layout on every torch / Triton release: torch 2.11 with
    Triton 3.6 on H200s fails on grouped-query attention (fewer key/value heads than query heads, as most current
    models have) with `NoValidChoicesError`, at the first training step, whatever the dtype or head size. Found here,
    it is one paragraph instead of a compiler traceback minutes into a run."""
    if device is None and not torch.cuda.is_available():
        return  # CPU runs are refused earlier (config/machine_needs.py)
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    device = device or torch.device("cuda", torch.cuda.current_device())
    query = torch.randn(1, heads, 128, head_dim, device=device, dtype=dtype, requires_grad=True)
    key, value = (torch.randn(1, kv_heads, 128, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in "kv")
    try:
        if compile_kwargs is None:  # transformers' own compiled function, as its flex backend calls it
            from transformers.integrations.flex_attention import compile_friendly_flex_attention

            output = compile_friendly_flex_attention(query, key, value, training=True, enable_gqa=heads != kv_heads)
        else:
            output = compiled_flex(compile_kwargs)(query, key, value, enable_gqa=heads != kv_heads)
        output.sum().backward()
    except Exception as exc:  # the compiler's own errors: InductorError, BackendCompilerFailed, ...
        import triton

        reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ConfigError(
            f"`attn_implementation: flex_attention` cannot compile for this model on this GPU: PyTorch "
            f"{torch.__version__} with Triton {triton.__version__} fails to build flex attention for "
            f"{heads} query / {kv_heads} key-value heads of size {head_dim} ({type(exc).__name__}: {reason[:200]}). "
            "Use `attn_implementation: sdpa` (packed rows stay separated by their position ids) or "
            "`flash_attention_2`, or a PyTorch release whose compiler handles this layout."
        ) from None
