"""A fused RMSNorm with a SiLU gate, forward and backward in Triton: the gated norms of linear-attention and Mamba2
layers, which run once per token per head and are memory-bound (several fp32 temporaries in eager PyTorch).

Two orders exist in transformers' gated norms, selected by `norm_before_gate`:

- norm, then gate (Qwen3.5's GatedDeltaNet): `y = (w * rms_norm(x)) * silu(g)`, the RMS over the whole last dim;
- gate, then norm (Nemotron-H's Mamba2 mixer): `y = w * rms_norm(x * silu(g))`, the RMS over groups of
  `group_size` channels of the last dim (the weight still spans the whole last dim).

Math runs in fp32 and the forward rounds where the eager modules round (the normed activations to the input's
dtype, the weight product to the weight/input promoted dtype), so that bf16 outputs equal the module's up to fp32
reassociation; gradients are computed in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _forward_kernel(
    X,
    G,
    W,
    Y,
    RSTD,
    n_groups,
    group_size,
    eps,
    NORM_BEFORE_GATE: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < group_size
    start = row * n_groups * group_size + group * group_size
    x = tl.load(X + start + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + start + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + group * group_size + cols, mask=mask, other=0.0).to(tl.float32)
    silu = g * tl.sigmoid(g)
    if NORM_BEFORE_GATE:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / group_size + eps)
        normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
        scaled = w * normed
        if ROUND_PRODUCT:  # the module multiplies weight and normed activations in their (narrow) common dtype
            scaled = scaled.to(X.dtype.element_ty).to(tl.float32)
        y = scaled * silu
    else:
        gated = x * silu
        rstd = tl.rsqrt(tl.sum(gated * gated, axis=0) / group_size + eps)
        y = w * (gated * rstd).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + start + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row * n_groups + group, rstd)


@triton.jit
def _backward_kernel(
    DY,
    X,
    G,
    W,
    RSTD,
    DX,
    DG,
    DW_PARTIAL,
    n_rows,
    n_groups,
    group_size,
    rows_per_program,
    NORM_BEFORE_GATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Each program takes a block of rows for one group and sums its share of the weight gradient in fp32.
    block = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < group_size
    w = tl.load(W + group * group_size + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    first = block * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for row in range(first, last):
        start = row * n_groups * group_size + group * group_size
        dy = tl.load(DY + start + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + start + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + start + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row * n_groups + group)
        sigmoid = tl.sigmoid(g)
        silu = g * sigmoid
        silu_grad = sigmoid * (1.0 + g * (1.0 - sigmoid))
        if NORM_BEFORE_GATE:
            normed = x * rstd
            dw += dy * normed * silu
            dg = dy * w * normed * silu_grad
            dnormed = dy * w * silu
            dx = rstd * (dnormed - normed * (tl.sum(dnormed * normed, axis=0) / group_size))
        else:
            gated = x * silu
            normed = gated * rstd
            dw += dy * normed
            dnormed = dy * w
            dgated = rstd * (dnormed - normed * (tl.sum(dnormed * normed, axis=0) / group_size))
            dx = dgated * silu
            dg = dgated * x * silu_grad
        tl.store(DX + start + cols, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DG + start + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + block * n_groups * group_size + group * group_size + cols, dw, mask=mask)


def _launch_settings(group_size: int) -> tuple[int, int]:
    block = triton.next_power_of_2(group_size)
    return block, 4 if block <= 2048 else 8 if block <= 8192 else 16


def _backward_programs(rows: int, device: torch.device) -> int:
    # A few programs per SM keep the GPU busy while the weight-gradient partials stay small.
    if device.type == "cuda":
        return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(rows, 4))


class GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        gate: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        group_size: int,
        norm_before_gate: bool,
    ) -> torch.Tensor:
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        flat_x = x.reshape(rows, width).contiguous()
        flat_gate = gate.reshape(rows, width).contiguous()
        weight = weight.contiguous()
        groups = width // group_size
        product_dtype = torch.promote_types(weight.dtype, x.dtype)
        out_dtype = x.dtype if norm_before_gate else product_dtype
        y = torch.empty((rows, width), dtype=out_dtype, device=x.device)
        rstd = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
        block, warps = _launch_settings(group_size)
        if rows:
            _forward_kernel[(rows, groups)](
                flat_x,
                flat_gate,
                weight,
                y,
                rstd,
                groups,
                group_size,
                eps,
                NORM_BEFORE_GATE=norm_before_gate,
                ROUND_PRODUCT=product_dtype != torch.float32,
                BLOCK=block,
                num_warps=warps,
            )
        ctx.save_for_backward(flat_x, flat_gate, weight, rstd)
        ctx.shapes = (x.shape, gate.shape)
        ctx.settings = (group_size, norm_before_gate)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat_x, flat_gate, weight, rstd = ctx.saved_tensors
        x_shape, gate_shape = ctx.shapes
        group_size, norm_before_gate = ctx.settings
        rows, width = flat_x.shape
        groups = width // group_size
        flat_dy = dy.reshape(rows, width).contiguous()
        dx = torch.empty_like(flat_x)
        dgate = torch.empty_like(flat_gate)
        programs = _backward_programs(rows, flat_x.device)
        rows_per_program = triton.cdiv(rows, programs) if rows else 0
        programs = triton.cdiv(rows, rows_per_program) if rows else 0
        partial = torch.zeros((max(programs, 1), width), dtype=torch.float32, device=flat_x.device)
        block, warps = _launch_settings(group_size)
        if rows:
            _backward_kernel[(programs, groups)](
                flat_dy,
                flat_x,
                flat_gate,
                weight,
                rstd,
                dx,
                dgate,
                partial,
                rows,
                groups,
                group_size,
                rows_per_program,
                NORM_BEFORE_GATE=norm_before_gate,
                BLOCK=block,
                num_warps=warps,
            )
        dweight = partial.sum(0).to(weight.dtype)
        return dx.view(x_shape), dgate.view(gate_shape), dweight, None, None, None


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
) -> torch.Tensor:
    """The fused gated RMSNorm of `x` (`[..., width]`) with `gate` of the same shape and `weight` of `[width]`.
    Output dtype is the module's: the input's with `norm_before_gate`, else the weight/input promoted dtype."""
    width = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (width,) or group_size <= 0 or width % group_size:
        raise ValueError(
            f"gated RMSNorm: input {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)} and "
            f"group size {group_size} do not fit together"
        )
    return GatedRMSNormFunction.apply(x, gate, weight, float(eps), int(group_size), bool(norm_before_gate))
