"""Liger's fused kernels, applied to a loaded model through Liger's own per-family entry points.

Liger swaps a family's RMSNorm / MLP / RoPE for Triton kernels and, with fused linear cross-entropy, computes the
loss from the last hidden states in chunks, so the [tokens x vocab] logits never exist. Each `liger_*` key maps to
the argument of the family's `apply_liger_kernel_to_<family>` function; a key the family's function does not take
is refused rather than ignored. Applied before the adapter, so LoRA wraps the projections the fused modules call.
"""

from __future__ import annotations

import inspect
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError, EnvironmentProblem

# config key -> the names Liger's per-family functions use for it (the MLP activation differs by family)
LIGER_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "liger_rope": ("rope",),
    "liger_rms_norm": ("rms_norm",),
    "liger_glu_activation": ("swiglu", "geglu"),
    "liger_layer_norm": ("layer_norm",),
    "liger_fused_linear_cross_entropy": ("fused_linear_cross_entropy",),
}


def requested_liger_keys(cfg: HellbenderConfig) -> list[str]:
    return [key for key in LIGER_ARGUMENTS if getattr(cfg, key)]


def apply_liger_kernels(cfg: HellbenderConfig, model: Any) -> list[str]:
    """Apply the requested kernels to `model` in place; returns the keys applied."""
    keys = requested_liger_keys(cfg)
    if not keys:
        return []
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        raise EnvironmentProblem(
            f"{', '.join(f'`{k}`' for k in keys)} need the `liger-kernel` package, which is not installed. Run "
            "`pip install 'hellbender[liger]'` (it needs a CUDA GPU with Triton), or remove the `liger_*` keys."
        ) from None
    import torch

    if not torch.cuda.is_available():
        raise EnvironmentProblem(
            "Liger's kernels are Triton kernels and need a CUDA GPU; this machine has none. Remove the `liger_*` keys."
        )
    model_type = model.config.model_type
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise ConfigError(
            f"Liger has no kernels for `model_type: {model_type}` (it covers: "
            f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}). Remove the `liger_*` keys for this model."
        )
    parameters = inspect.signature(apply).parameters
    arguments: dict[str, bool] = {}
    for key, names in LIGER_ARGUMENTS.items():
        name = next((n for n in names if n in parameters), None)
        if name is None:
            if getattr(cfg, key):
                raise ConfigError(
                    f"`{key}: true`, but Liger's kernels for {model_type} do not include it. Remove the key."
                )
            continue
        arguments[name] = bool(getattr(cfg, key))  # explicit False too: Liger's own defaults switch some on
    if "cross_entropy" in parameters:
        arguments["cross_entropy"] = False
    apply(model=model, **arguments)
    return keys
