"""Tiled MLP (`tiled_mlp: true`): each decoder layer's MLP runs over the sequence in shards, forward and backward,
so its [tokens x intermediate] activations exist for one shard at a time. For very long sequences these are the
largest tensors of a layer (a Llama-3-8B MLP holds several 14336-wide activations per token); tokens pass through
an MLP independently, so sharding along the sequence changes no result.

The forward runs without recording a graph and keeps only the MLP's input. The backward recomputes each shard
with gradients on and back-propagates it at once: parameter gradients add up shard by shard in `.grad`, as they
would over one long pass, and the input gradient is assembled from the shards. The random state (LoRA dropout) is
replayed so the recomputation draws what the forward drew.

The parameter gradients are produced by a backward inside a backward, which data-parallel engines (DDP, FSDP2,
DeepSpeed) do not expect: hellbender refuses `tiled_mlp` with several processes.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

ATTRIBUTE = "_hellbender_tiled_mlp"  # marks an MLP already tiled
DECODER_MLP = re.compile(r"(^|\.)layers\.\d+\.mlp$")


def shard_count(tokens: int, hidden: int, configured: int | None) -> int:
    """`tiled_mlp_num_shards` when set; otherwise about one shard per `hidden` tokens, so a shard's activations
    stay near the size of the layer's [hidden x hidden] weights."""
    return max(1, min(tokens, configured or math.ceil(tokens / hidden)))


class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: Any, shards: int, *_params: torch.Tensor) -> torch.Tensor:
        ctx.forward, ctx.shards = forward, shards
        ctx.device_type = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        ctx.rng = _rng_state(x.device)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([_checked(forward(part)) for part in x.tensor_split(shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        grads = []
        enabled, dtype = ctx.autocast
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            _set_rng_state(x.device, ctx.rng)
            for part, grad_part in zip(
                x.tensor_split(ctx.shards, dim=-2), grad_output.tensor_split(ctx.shards, dim=-2), strict=True
            ):
                part = part.detach().requires_grad_(x.requires_grad)
                with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
                    out = ctx.forward(part)
                if out.requires_grad:
                    torch.autograd.backward(out, grad_part)  # parameter gradients accumulate in .grad
                if x.requires_grad:
                    grads.append(part.grad if part.grad is not None else torch.zeros_like(part))
        grad_x = torch.cat(grads, dim=-2) if grads else None
        return (grad_x, None, None) + (None,) * (len(ctx.needs_input_grad) - 3)


def _checked(out: Any) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"tiled_mlp: this MLP returns {type(out).__name__}, not one tensor (a mixture-of-experts block with "
            "router outputs?); `tiled_mlp` supports dense MLPs only. Set `tiled_mlp: false` for this model."
        )
    return out


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _tiled_forward(module: torch.nn.Module, original: Any, shards: int | None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or x.dim() < 2:  # evaluation and generation: nothing to save
            return original(x)
        count = shard_count(x.shape[-2], x.shape[-1], shards)
        params = tuple(p for p in module.parameters() if p.requires_grad)
        return _TiledMLPFunction.apply(x, original, count, *params)

    return forward


def tile_mlps(model: torch.nn.Module, shards: int | None = None) -> int:
    """Run every decoder layer's MLP (`...layers.N.mlp`) tiled over the sequence; returns how many. The module
    keeps its class, parameters and names (saving and adapters see no difference); only its instance's `forward`
    is replaced."""
    count = 0
    for name, module in model.named_modules():
        if DECODER_MLP.search(name) and not hasattr(module, ATTRIBUTE):
            setattr(module, ATTRIBUTE, True)
            module.forward = _tiled_forward(module, module.forward, shards)
            count += 1
    return count
