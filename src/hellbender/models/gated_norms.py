"""`liger_rms_norm_gated: true`: the gated RMSNorms of one loaded model run hellbender's fused Triton kernel
(models/gated_rms_norm_kernel.py).

Liger has no kernel for these norms, so this is hellbender's own, applied the way hellbender applies Liger's: a
bound `forward` on each gated-norm module of this model, never a change to a transformers class or module, so a
model built later in the process (DPO's reference model, a distillation teacher) keeps the stock norms. Each
recognised class is matched exactly (a subclass may compute something else) and says how its module computes:

- Qwen3.5 and Qwen3.5-MoE (`Qwen3_5RMSNormGated`, in the GatedDeltaNet linear-attention layers): normalise over
  the head dimension, scale, then gate;
- Nemotron-H (`NemotronHRMSNormGated`, in the Mamba2 mixers): gate, then normalise over groups of `group_size`
  channels, then scale.

A model with none of these norms is refused by name, as is a Nemotron-H model trained with `mamba-ssm` installed:
its fused scan then computes the gated norm itself in training, and the module is never called.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import types
from dataclasses import dataclass
from typing import Any

from hellbender.errors import ConfigError, EnvironmentProblem

KEY = "liger_rms_norm_gated"


@dataclass(frozen=True)
class GatedNormKind:
    module: str  # transformers' modeling module that defines the class
    names: tuple[str, ...]  # the class's name in the transformers releases hellbender meets, newest first
    family: str
    norm_before_gate: bool
    grouped: bool  # the RMS is taken over `module.group_size` channels rather than the whole last dim


KINDS = (
    GatedNormKind("transformers.models.qwen3_5.modeling_qwen3_5", ("Qwen3_5RMSNormGated",), "Qwen3.5", True, False),
    GatedNormKind(
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", ("Qwen3_5MoeRMSNormGated",), "Qwen3.5-MoE", True, False
    ),
    # transformers 5.24 gives Nemotron-H its own `NemotronHRMSNormGated`; 5.17 imports Zamba2's `Zamba2RMSNormGated`
    # into the Nemotron-H module (same computation), and some releases between call it `MambaRMSNormGated`.
    GatedNormKind(
        "transformers.models.nemotron_h.modeling_nemotron_h",
        ("NemotronHRMSNormGated", "MambaRMSNormGated", "Zamba2RMSNormGated"),
        "Nemotron-H",
        False,
        True,
    ),
)


def installed_class(kind: GatedNormKind) -> type | None:
    """The installed transformers' class for `kind`, or None where this release lacks the family."""
    try:
        module = importlib.import_module(kind.module)
    except ImportError:
        return None
    return next((c for c in (getattr(module, n, None) for n in kind.names) if isinstance(c, type)), None)


def _classes() -> dict[type, GatedNormKind]:
    return {cls: kind for kind in KINDS if (cls := installed_class(kind)) is not None}


def _fused_forward(kind: GatedNormKind) -> Any:
    from hellbender.models.gated_rms_norm_kernel import SUPPORTED_DTYPES, gated_rms_norm

    def forward(self: Any, hidden_states: Any, gate: Any = None) -> Any:
        if gate is None or hidden_states.dtype not in SUPPORTED_DTYPES:
            # No gate (Nemotron-H's norm allows it; its mixers always pass one) or float64: the module's own code.
            return type(self).forward(self, hidden_states, gate)
        group_size = self.group_size if kind.grouped else hidden_states.shape[-1]
        return gated_rms_norm(
            hidden_states, gate, self.weight, self.variance_epsilon, group_size, norm_before_gate=kind.norm_before_gate
        )

    return forward


def _check_contract(name: str, module: Any, kind: GatedNormKind) -> None:
    """The attributes the fused forward reads, as the module's own forward reads them."""
    import torch

    problems = []
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        problems.append("no 1-D `weight`")
    if not isinstance(getattr(module, "variance_epsilon", None), float):
        problems.append("no float `variance_epsilon`")
    if not kind.grouped and getattr(module, "activation", "silu") != "silu":
        problems.append(f"gate activation {module.activation!r}, not SiLU")
    if kind.grouped:
        group_size = getattr(module, "group_size", None)
        if not isinstance(group_size, int) or weight is None or group_size <= 0 or weight.shape[0] % group_size:
            problems.append("no `group_size` dividing the weight's size")
    if problems:
        import transformers

        raise EnvironmentProblem(
            f"`{KEY}`: `{name}` ({type(module).__name__} of transformers {transformers.__version__}) has {', '.join(problems)}, "
            f"which hellbender's fused kernel for {kind.family} relies on. Remove `{KEY}`, or use a transformers "
            "release hellbender supports."
        )


def fuse_gated_norms(model: Any) -> list[str]:
    """Bind the fused forward on each gated RMSNorm of `model` (and nothing else); returns their names. Runs on any
    device; the fused modules then need CUDA (or Triton's interpreter)."""
    classes = _classes()
    found = [(name, module, classes[type(module)]) for name, module in model.named_modules() if type(module) in classes]
    if not found:
        families = ", ".join(kind.family for kind in KINDS)
        raise ConfigError(
            f"`{KEY}: true`, but this {type(model).__name__} (`model_type: {model.config.model_type}`) has no gated "
            f"RMSNorm for the kernel to fuse (it covers the gated norms of {families}). Remove `{KEY}` for this model."
        )
    if any(kind.family == "Nemotron-H" for _, _, kind in found) and importlib.util.find_spec("mamba_ssm") is not None:
        raise ConfigError(
            f"`{KEY}: true`, but `mamba-ssm` is installed, so Nemotron-H's Mamba2 mixers compute their gated norm "
            f"inside mamba-ssm's fused scan when training and never call the norm module: the key would change "
            f"nothing. Remove `{KEY}` (mamba-ssm already fuses this norm)."
        )
    for name, module, kind in found:
        _check_contract(name, module, kind)
    forwards = {kind: _fused_forward(kind) for kind in {kind for _, _, kind in found}}
    for _, module, kind in found:
        module.forward = types.MethodType(forwards[kind], module)
    return [name for name, _, _ in found]


def apply_gated_norm_kernel(cfg: Any, model: Any) -> list[str]:
    """`liger_rms_norm_gated` for `model`: the names of the fused modules (empty when the key is off)."""
    if not cfg.liger_rms_norm_gated:
        return []
    import torch

    if importlib.util.find_spec("triton") is None:
        raise EnvironmentProblem(
            f"`{KEY}` is a Triton kernel and needs the `triton` package, which is not installed (it comes with "
            f"PyTorch's CUDA builds). Remove `{KEY}`."
        )
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise EnvironmentProblem(
            f"`{KEY}` is a Triton kernel and needs a CUDA GPU; this machine has none. Remove `{KEY}`."
        )
    return fuse_gated_norms(model)
