"""Liger's fused kernels, applied to one loaded model through Liger's own per-family entry points.

Liger swaps a family's RMSNorm / MLP / RoPE for Triton kernels and, with fused linear cross-entropy, computes the
loss from the last hidden states in chunks, so the [tokens x vocab] logits never exist. Each `liger_*` key maps to
the argument of the family's `apply_liger_kernel_to_<family>` function; a key the family's function does not take,
or that changes nothing in this model, is refused rather than ignored. Applied before the adapter, so LoRA wraps
the projections the fused modules call.

Liger's functions also replace classes and functions in transformers' modeling modules for the whole process, so
a model built later (DPO's reference model, a distillation teacher) would be fused too. They run through
`one_model_patch.patch_one_model`, which puts transformers back and leaves the kernels on this model's modules
only.
"""

from __future__ import annotations

import inspect
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError, EnvironmentProblem
from hellbender.models.one_model_patch import CannotScope, patch_one_model

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
    """Apply the requested kernels to `model` (and nothing else) in place; returns the keys applied."""
    keys = requested_liger_keys(cfg)
    if not keys:
        return []
    try:
        import liger_kernel.transformers.monkey_patch  # noqa: F401
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
    applied = fuse(model, keys)
    if cfg.fused_cross_entropy_chunk_scale is not None:
        size_loss_chunks(model, cfg.fused_cross_entropy_chunk_scale)
    return applied


# Families whose Liger forward hands the model call's keyword arguments on to the fused loss (Liger's
# `LigerForCausalLMLoss` keeps those its loss function takes), checked by tests/test_kernels.py.
CHUNK_SCALE_FAMILIES = ("llama", "gemma4", "gemma4_text")


def size_loss_chunks(model: Any, scale: int) -> None:
    """Every call of `model` passes `chunk_mem_const=scale` to Liger's fused cross-entropy, through the keyword
    arguments of the model's forward, which Liger's forward hands to its loss."""
    from liger_kernel.transformers import functional

    model_type = model.config.model_type
    if model_type not in CHUNK_SCALE_FAMILIES:
        raise ConfigError(
            f"`fused_cross_entropy_chunk_scale` is not checked for `model_type: {model_type}` (only for "
            f"{', '.join(CHUNK_SCALE_FAMILIES)}): Liger's forward for it may not pass the setting on to the loss. "
            "Remove the key."
        )
    takes_it = "chunk_mem_const" in inspect.signature(functional.liger_fused_linear_cross_entropy).parameters
    # Liger's function drops the setting unless its autograd function (this machine's backend's) takes it.
    if not (
        takes_it and getattr(functional.LigerFusedLinearCrossEntropyFunction, "supports_inner_impl_dispatch", False)
    ):
        raise EnvironmentProblem(
            f"`fused_cross_entropy_chunk_scale` needs Liger's `chunk_mem_const`, which {_versions()} does not take on "
            "this machine. Install liger-kernel 0.8.5 or later (CUDA), or remove the key."
        )

    def pass_scale(module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return args, {**kwargs, "chunk_mem_const": scale}

    model.register_forward_pre_hook(pass_scale, with_kwargs=True)


def fuse(model: Any, keys: list[str]) -> list[str]:
    """Liger's kernels for `keys` on `model`'s modules only, one key at a time, so that a key Liger does not apply
    to this model is refused by name. Patching runs on any device; the fused modules then need CUDA."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = model.config.model_type
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise ConfigError(
            f"Liger has no kernels for `model_type: {model_type}` (it covers: "
            f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}). Remove the `liger_*` keys for this model."
        )
    parameters = inspect.signature(apply).parameters
    # Every switch is passed, off unless requested: Liger's defaults switch some kernels on (and its plain
    # cross-entropy, which replaces torch's function for everyone).
    switches = {name: False for name, parameter in parameters.items() if isinstance(parameter.default, bool)}
    arguments = {}
    for key in keys:
        name = next((n for n in LIGER_ARGUMENTS[key] if n in parameters), None)
        if name is None:
            raise ConfigError(f"`{key}: true`, but Liger's kernels for {model_type} do not include it. Remove the key.")
        arguments[key] = {**switches, name: True}
    for key in keys:
        changed = _apply_one(model, key, lambda arguments=arguments[key]: apply(model=model, **arguments))
        if not changed:
            raise ConfigError(
                f"`{key}: true`, but Liger's kernels for {model_type} change nothing in this "
                f"{type(model).__name__} ({_versions()}). Remove the key."
            )
    return keys


def _apply_one(model: Any, key: str, patch: Any) -> list[str]:
    model_type = model.config.model_type
    try:
        return patch_one_model(model, patch, library="liger_kernel")
    except CannotScope as problem:
        raise EnvironmentProblem(
            f"`{key}`: Liger's kernels for {model_type} change {problem} for the whole process, which hellbender "
            f"cannot limit to the model being trained (a model built later, such as DPO's reference model, would "
            f"be fused too) ({_versions()}). Remove `{key}`."
        ) from None
    except NotImplementedError as error:
        raise ConfigError(
            f"`{key}: true`, but Liger's kernels for {model_type} do not implement it ({error}). Remove the key."
        ) from None
    except Exception as error:  # Liger's entry point failed: an error for the user, with Liger's below it
        raise EnvironmentProblem(
            f"Liger's kernels for {model_type} failed to apply `{key}` ({type(error).__name__}: {error}) with "
            f"{_versions()}. Remove the key, or install a liger-kernel release made for this transformers release."
        ) from error


def _versions() -> str:
    from importlib.metadata import version

    import transformers

    return f"liger-kernel {version('liger-kernel')}, transformers {transformers.__version__}"
