"""LoRA's linear layer as one autograd function (`lora_qkv_kernel`, `lora_o_kernel`, `lora_mlp_kernel`).

PEFT computes `base(x) + lora_B(lora_A(x)) * scaling` as separate operations: the base matmul, the two low-rank
matmuls, the scaling and the sum each read or write a tensor as wide as the layer's output, forward and backward
(and the adapter's float32 weights are cast to the compute dtype at every call). Here the same sum is computed with
the low-rank product written first and the base matmul accumulating into it (`addmm_`, the matmul's own epilogue),
and in backward the input gradient's two terms accumulate the same way:

    forward   xa = x·Aᵀ                      out = xa·(sB)ᵀ,  out += x·Wᵀ
    backward  gb = g·(sB)   dx = gb·A,  dx += g·W    dA = gbᵀ·x    dB = s·gᵀ·xa

It saves what PEFT's layers save (the input and the small `xa`), less PEFT's bf16 copies of the input, and computes
the same
function: the gradients and outputs agree with PEFT's within the compute dtype's rounding (tests/test_fused_lora.py).
The layer stays PEFT's `lora.Linear` (same parameters and names, so adapters save and load as ever); the fused path
runs only where it computes exactly LoRA: one active adapter, no dropout, no DoRA or other variant, no LoRA bias,
not merged, an unquantized `nn.Linear` base, and not while `torch.compile` traces the layer. Anywhere else the
layer runs PEFT's forward."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear

from hellbender.errors import ConfigError

logger = logging.getLogger("hellbender")

# The projections each of Axolotl's kernel keys covers, by the module names of Llama-style decoders.
KERNEL_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "lora_qkv_kernel": ("q_proj", "k_proj", "v_proj"),
    "lora_o_kernel": ("o_proj",),
    "lora_mlp_kernel": ("gate_proj", "up_proj", "down_proj"),
}


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the base matmul runs in: autocast's when it is on for this device, else the weight's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype


class LoraLinearFunction(torch.autograd.Function):
    """`x·Wᵀ + bias + scaling·(x·Aᵀ)·Bᵀ` with W (and the bias) frozen; every matmul in `dtype`."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scaling: float,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        w, a = weight.to(dtype), lora_a.to(dtype)
        scaled_b = (lora_b * scaling).to(dtype)
        xa = rows @ a.t()
        out = xa @ scaled_b.t() if bias is None else torch.addmm(bias.to(dtype), xa, scaled_b.t())
        out.addmm_(rows, w.t())
        ctx.save_for_backward(rows, xa, w, a, scaled_b)
        ctx.scaling = scaling
        ctx.input_dtype = x.dtype
        ctx.adapter_dtypes = (lora_a.dtype, lora_b.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, xa, w, a, scaled_b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(w.dtype)
        gb = g @ scaled_b
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = gb @ a
            grad_x.addmm_(g, w)
            grad_x = grad_x.view(*grad.shape[:-1], w.shape[1]).to(ctx.input_dtype)
        if ctx.needs_input_grad[3]:
            grad_a = (gb.t() @ rows).to(ctx.adapter_dtypes[0])
        if ctx.needs_input_grad[4]:
            grad_b = (g.t() @ xa).mul_(ctx.scaling).to(ctx.adapter_dtypes[1])
        return grad_x, None, None, grad_a, grad_b, None, None


class FusedLoraLinear(LoraLinear):
    """PEFT's LoRA linear layer, computing through `LoraLinearFunction` where `fused` is set and the layer's state is
    plain LoRA (see the module's docstring); PEFT's own forward otherwise."""

    fused: bool = False

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter = self._fused_adapter(args, kwargs)
        if adapter is None or torch.compiler.is_compiling():
            # Compiled, PEFT's plain ops: the compiler fuses them itself (a compiled layer measured 1.04x slower
            # through the function on an H100), and inside a compiled checkpoint it recomputes them, where the
            # function's saved tensors would be kept instead (0.30 GiB more per layer at 4,096 tokens of W1).
            return super().forward(x, *args, **kwargs)
        base = self.get_base_layer()
        if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
            return super().forward(x, *args, **kwargs)
        dtype = compute_dtype(x, base.weight)
        with torch.autocast(x.device.type, enabled=False):
            out = LoraLinearFunction.apply(
                x,
                base.weight,
                base.bias,
                self.lora_A[adapter].weight,
                self.lora_B[adapter].weight,
                float(self.scaling[adapter]),
                dtype,
            )
        return out

    def _fused_adapter(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The one adapter the fused path computes, or None where PEFT's forward must run."""
        if not self.fused or self.disable_adapters or self.merged or args or kwargs:
            return None
        active = [name for name in self.active_adapters if name in self.lora_A]
        if len(active) != 1:
            return None
        name = active[0]
        plain = (
            isinstance(self.lora_dropout[name], torch.nn.Identity)
            and name not in self.lora_variant
            and not self.lora_bias.get(name, False)
            and type(self.get_base_layer()) is torch.nn.Linear
        )
        return name if plain else None


def register_fused_lora(lora_config: Any) -> None:
    """Make PEFT build `FusedLoraLinear` for every `nn.Linear` it adapts (PEFT's custom layer dispatch); which of them
    compute fused is set afterwards by `enable_lora_kernels`."""
    lora_config._register_custom_module({torch.nn.Linear: FusedLoraLinear})


def enable_lora_kernels(model: torch.nn.Module, keys: Iterable[str]) -> dict[str, int]:
    """Turn the fused path on for the LoRA layers each `lora_*_kernel` key covers (by the module's last name); a key
    whose projections the model has no LoRA layer for is refused, since it would change nothing. Returns the
    number of layers per key."""
    layers = {name: module for name, module in model.named_modules() if isinstance(module, FusedLoraLinear)}
    counts = {}
    for key in keys:
        covered = [module for name, module in layers.items() if name.rsplit(".", 1)[-1] in KERNEL_PROJECTIONS[key]]
        if not covered:
            adapted = sorted({name.rsplit(".", 1)[-1] for name in layers}) or ["none"]
            raise ConfigError(
                f"`{key}: true` fuses LoRA on {', '.join(f'`{p}`' for p in KERNEL_PROJECTIONS[key])}, and this model "
                f"has no LoRA layer of those names (its adapted linear layers: {', '.join(adapted)}). Add them to "
                f"`lora_target_modules`, or set `{key}: false`."
            )
        for module in covered:
            module.fused = True
        counts[key] = len(covered)
    logger.info("LoRA kernels: %s", ", ".join(f"{key} on {n} layers" for key, n in counts.items()))
    return counts
