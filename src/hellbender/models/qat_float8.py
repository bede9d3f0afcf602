"""Straight-through gradients for torchao's float8 fake quantizers (torchao 0.18).

torchao's float8 fake quantization rounds with a straight-through `_RoundToFloat8`, but its result is a float8 tensor
that is then cast back (`.to(float32)`): autograd casts the incoming gradient to float8 on the way back, so the
gradient is rounded to float8 *after* being multiplied by the scale (amax / 448). Measured on the CPU: for weights of
size ~0.02 and gradients of ~1e-3, 99.98% of the gradient entries underflow to exactly zero. A fake-quantized layer
then passes almost no gradient to its weight (or, for the activation quantizer, to the layers below it but through
the residual stream), and LoRA under float8 QAT barely trains (tests/test_qat.py).

The fix keeps torchao's forward exactly (the quantizer itself computes the values) and makes the backward the
identity in the input's dtype: the usual straight-through estimator. It wraps each float8 quantizer of a torchao
fake-quantized layer (`Float8FakeQuantizer`, and `Int4WeightFakeQuantizer` when it rounds through float8) in place,
on the layer instance; integer quantizers keep torchao's own masked straight-through gradient."""

from __future__ import annotations

from typing import Any

import torch


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, quantizer: torch.nn.Module) -> torch.Tensor:
        return quantizer(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class StraightThroughFakeQuantizer(torch.nn.Module):
    """torchao's fake quantizer with an identity backward. `enabled` and `config` are the wrapped quantizer's, so
    what switches or reads torchao's quantizers (`set_fake_quantization`, the LoRA layer) works on it unchanged."""

    def __init__(self, quantizer: torch.nn.Module) -> None:
        super().__init__()
        self.quantizer = quantizer

    @property
    def enabled(self) -> bool:
        return self.quantizer.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.quantizer.enabled = value

    @property
    def config(self) -> Any:
        return self.quantizer.config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.quantizer.enabled:
            return x
        return _StraightThrough.apply(x, self.quantizer)


def rounds_through_float8(quantizer: Any) -> bool:
    from torchao.quantization.qat import Float8FakeQuantizer
    from torchao.quantization.qat.fake_quantizer import Int4WeightFakeQuantizer

    if isinstance(quantizer, Float8FakeQuantizer):
        return True
    return isinstance(quantizer, Int4WeightFakeQuantizer) and quantizer.config.activation_dtype == torch.float8_e4m3fn


def pass_float8_gradients_straight(model: Any) -> int:
    """Wrap the float8 quantizers of every torchao fake-quantized linear layer of `model`; returns how many. The
    layers' forward calls `self.weight_fake_quantizer` / `self.activation_fake_quantizer` (checked here: a torchao
    whose layers lack them fails loudly instead of training with float8-rounded gradients)."""
    from torchao.quantization.qat import FakeQuantizedLinear

    wrapped = 0
    for name, module in model.named_modules():
        if not isinstance(module, FakeQuantizedLinear):
            continue
        for attribute in ("weight_fake_quantizer", "activation_fake_quantizer"):
            if not hasattr(module, attribute):
                raise RuntimeError(
                    f"torchao's FakeQuantizedLinear (`{name}`) has no `{attribute}`: the installed torchao changed the "
                    "layer hellbender's float8 gradient fix wraps (models/qat_float8.py). Use torchao 0.18."
                )
            quantizer = getattr(module, attribute)
            if quantizer is not None and rounds_through_float8(quantizer):
                setattr(module, attribute, StraightThroughFakeQuantizer(quantizer))
                wrapped += 1
    return wrapped
