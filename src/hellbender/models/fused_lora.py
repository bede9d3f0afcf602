"""LoRA's linear layer as one autograd function (`lora_qkv_kernel`, `lora_o_kernel`, `lora_mlp_kernel`).

PEFT computes `base(x) + lora_B(lora_A(x)) * scaling` as separate operations: the base matmul, the two low-rank
matmuls, the scaling and the sum each read or write a tensor as wide as the layer's output, forward and backward
(and the adapter's float32 weights are cast to the compute dtype at every call). Here the same sum is computed with
the low-rank product written first and the base matmul accumulating into it (`addmm_`, the matmul's own epilogue),
and in backward the input gradient's two terms accumulate the same way:

    forward   xa = x·Aᵀ                      out = xa·(sB)ᵀ,  out += x·Wᵀ
    backward  gb = g·(sB)   dx = gb·A,  dx += g·W    dA = gbᵀ·x    dB = s·gᵀ·xa

It saves what PEFT's layers save (the input and the small `xa`), less PEFT's bf16 copies of the input, and computes
the same function: the gradients and outputs agree with PEFT's within the compute dtype's rounding
(tests/test_fused_lora.py). The layer stays PEFT's `lora.Linear` (same parameters and names, so adapters save and
load as ever); the fused path runs only where it computes exactly LoRA: one active adapter, no dropout, no DoRA or
other variant, no LoRA bias, not merged, an unquantized `nn.Linear` or a bitsandbytes 4-bit base (QLoRA:
dequantized for each matmul, as bitsandbytes does), and not while `torch.compile` traces the layer. Anywhere else
the layer runs PEFT's forward."""

from __future__ import annotations

import functools
import importlib.util
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


def is_4bit(weight: torch.Tensor) -> bool:
    """A bitsandbytes 4-bit weight (QLoRA's base), which is dequantized for each matmul."""
    return getattr(weight, "quant_state", None) is not None


def dense_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The base weight as a dense matrix in `dtype`: a 4-bit weight dequantized, as bitsandbytes' own matmul does."""
    if is_4bit(weight):
        import bitsandbytes as bnb

        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).to(dtype)
    return weight.to(dtype)


class LoraLinearFunction(torch.autograd.Function):
    """`x·Wᵀ + bias + scaling·(x·Aᵀ)·Bᵀ` with W (and the bias) frozen; every matmul in `dtype`. A 4-bit W is
    dequantized in forward and again in backward (never kept), as bitsandbytes' matmul does."""

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
        w, a = dense_weight(weight, dtype), lora_a.to(dtype)
        scaled_b = (lora_b * scaling).to(dtype)
        xa = rows @ a.t()
        out = xa @ scaled_b.t() if bias is None else torch.addmm(bias.to(dtype), xa, scaled_b.t())
        out.addmm_(rows, w.t())
        if is_4bit(weight):
            ctx.quantized_weight = weight
            ctx.save_for_backward(rows, xa, a, scaled_b)
        else:
            ctx.quantized_weight = None
            ctx.save_for_backward(rows, xa, a, scaled_b, w)
        ctx.scaling = scaling
        ctx.input_dtype = x.dtype
        ctx.adapter_dtypes = (lora_a.dtype, lora_b.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, xa, a, scaled_b, *kept = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(rows.dtype)
        gb = g @ scaled_b
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            w = kept[0] if kept else dense_weight(ctx.quantized_weight, rows.dtype)
            grad_x = gb @ a
            grad_x.addmm_(g, w)
            grad_x = grad_x.view(*grad.shape[:-1], rows.shape[1]).to(ctx.input_dtype)
        if ctx.needs_input_grad[3]:
            grad_a = (gb.t() @ rows).to(ctx.adapter_dtypes[0])
        if ctx.needs_input_grad[4]:
            grad_b = (g.t() @ xa).mul_(ctx.scaling).to(ctx.adapter_dtypes[1])
        return grad_x, None, None, grad_a, grad_b, None, None


class FusedLora:
    """The fused forward shared by the LoRA layer classes below; `fused` is set per layer by `enable_lora_kernels`."""

    fused: bool = False
    plain_base_types: tuple[type, ...] = ()  # the base layer classes the function computes exactly

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter = self._fused_adapter(args, kwargs)
        if adapter is None or torch.compiler.is_compiling():
            # Compiled, PEFT's plain ops: the compiler fuses them itself (a compiled layer measured 1.04x slower
            # through the function on an H100), and inside a compiled checkpoint it recomputes them, where the
            # function's saved tensors would be kept instead (0.30 GiB more per layer at 4,096 tokens of W1).
            return super().forward(x, *args, **kwargs)
        base = self.get_base_layer()
        with torch.autocast(x.device.type, enabled=False):
            return LoraLinearFunction.apply(
                x,
                base.weight,
                base.bias,
                self.lora_A[adapter].weight,
                self.lora_B[adapter].weight,
                float(self.scaling[adapter]),
                self._compute_dtype(x),
            )

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """Autocast's dtype when it is on for this device, else what the base layer computes in."""
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        base = self.get_base_layer()
        if is_4bit(base.weight):
            return getattr(base, "compute_dtype", None) or x.dtype
        return base.weight.dtype

    def _fused_adapter(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The one adapter the fused path computes, or None where PEFT's forward must run."""
        if not self.fused or self.disable_adapters or self.merged or args or kwargs:
            return None
        active = [name for name in self.active_adapters if name in self.lora_A]
        base = self.get_base_layer()
        if len(active) != 1 or base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
            return None
        name = active[0]
        plain = (
            isinstance(self.lora_dropout[name], torch.nn.Identity)
            and name not in self.lora_variant
            and not self.lora_bias.get(name, False)
            and type(base) in self.plain_base_types
        )
        return name if plain else None


class FusedLoraLinear(FusedLora, LoraLinear):
    """PEFT's LoRA layer over an unquantized `nn.Linear`, computing through `LoraLinearFunction` where it can."""

    plain_base_types = (torch.nn.Linear,)


@functools.cache
def fused_4bit_class() -> type | None:
    """PEFT's LoRA layer over a bitsandbytes 4-bit linear layer (QLoRA), computing through `LoraLinearFunction` where
    it can; None without bitsandbytes."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    import bitsandbytes as bnb
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    return type(
        "FusedLoraLinear4bit",
        (FusedLora, LoraLinear4bit),
        {"plain_base_types": (bnb.nn.Linear4bit,), "__module__": __name__, "__qualname__": "FusedLoraLinear4bit"},
    )


def register_fused_lora(lora_config: Any) -> None:
    """Make PEFT build fused LoRA layers for every `nn.Linear` and bitsandbytes 4-bit linear layer it adapts (PEFT's
    custom layer dispatch); which of them compute fused is set afterwards by `enable_lora_kernels`."""
    layers: dict[type, type] = {}
    if (four_bit := fused_4bit_class()) is not None:  # first: bitsandbytes' 4-bit layer is an `nn.Linear` too
        import bitsandbytes as bnb

        layers[bnb.nn.Linear4bit] = four_bit
    layers[torch.nn.Linear] = FusedLoraLinear
    lora_config._register_custom_module(layers)


def enable_lora_kernels(model: torch.nn.Module, keys: Iterable[str]) -> dict[str, int]:
    """Turn the fused path on for the LoRA layers each `lora_*_kernel` key covers (by the module's last name); a key
    whose projections the model has no LoRA layer for is refused, since it would change nothing. Returns the
    number of layers per key."""
    layers = {name: module for name, module in model.named_modules() if isinstance(module, FusedLora)}
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
