"""The host's floor under a step: the GPU kernels one optimizer step launches, counted from the meta model's module
tree, times what the host spends launching each one (Python, PyTorch's dispatcher, the CUDA launch).

A small model's step is bound by these launches, not by its FLOPs: the GPU finishes each kernel before the host has
queued the next. Kernels per call, forward (the leaves of the module tree, and the ops a decoder layer's forward
runs outside its modules):
- a linear layer: 1 (the bias is fused into the matmul); on a 4- or 8-bit base, 1 more to dequantize its weight;
- a LoRA-wrapped layer: its base, A, B and dropout (when p > 0) as leaves, plus 3 (the cast to the adapter's dtype,
  the scaling, the sum with the base's output);
- a norm: 6 unfused (the float32 cast, square, mean, reciprocal square root, two products), 1 with Liger's kernel;
- any other leaf (an activation, an embedding, a dropout with p > 0): 1; an identity or p = 0 dropout: none;
- a decoder layer's own ops: 1 attention kernel, the rotary embedding of q and k (8 unfused, 1 with Liger's), 2
  residual sums, the gated MLP's product (fused into Liger's SwiGLU) and 2 reshapes;
- a mixture-of-experts block with its experts in stacked tensors: transformers loops over the experts a batch
  reaches (with many tokens, all of them), 8 kernels each (gather, two matmuls, the activation and its product, the
  routing weight, the scatter back).
Backward launches about twice the forward's kernels (an op's gradient and its accumulation; a matmul's input and
weight gradients); a checkpointed layer runs its forward once more; frozen modules outside the decoder (a vision
tower) run forward only. The output head and loss are 10 kernels forward. The optimizer step: a fused or
multi-tensor optimizer launches one kernel per op per chunk of up to 100 tensors (AdamW: about 12 ops; clipping the
gradients' norm: 3 more), a per-tensor optimizer (bitsandbytes' 8-bit ones, SGD, Adafactor) 3 per tensor.

`flops.py` turns the counts into a step's kernels; `cards.LAUNCH_SECONDS` (the seconds per kernel) is fitted in
docs/plan.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

UNFUSED_NORM, UNFUSED_ROPE = 6, 8
_LORA_GLUE = 3  # cast, scale, sum
_LAYER_OWN = 6  # attention, 2 residual sums, the gated product, 2 reshapes (the rotary embedding apart)
PER_EXPERT = 8
HEAD_AND_LOSS = 10
TENSORS_PER_CHUNK = 100
FUSED_OPS, CLIP_OPS, PER_TENSOR_OPS = 12, 3, 3
# Optimizers that update every tensor in a few multi-tensor launches (torch's fused and foreach AdamW, its default).
MULTI_TENSOR = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adam", "adamw")


@dataclass(frozen=True)
class LayerKernels:
    """Forward kernels of one decoder layer, split by what the run's kernels change."""

    fixed: int  # linear layers, LoRA, other leaves, the layer's own ops (rotary embedding apart)
    norms: int  # norm modules (6 kernels each unfused, 1 with Liger)
    dequantized: int  # linear weights a 4- or 8-bit base dequantizes before each matmul
    experts: int = 0  # experts of a stacked mixture-of-experts block, looped over


@dataclass(frozen=True)
class KernelCounts:
    layers: list[LayerKernels] = field(default_factory=list)
    outside_trained: int = 0  # forward kernels outside the decoder layers with a trainable parameter
    outside_frozen: int = 0  # forward kernels outside the decoder layers that train nothing (a vision tower)
    trainable_tensors: int = 0


def count_kernels(model: Any, decoder_layers: list[Any]) -> KernelCounts:
    """The forward kernels of `model` (on the meta device, adapter applied), per decoder layer and outside them."""
    inside = {id(m) for layer in decoder_layers for m in layer.modules()}
    layers = [_layer_kernels(layer) for layer in decoder_layers]
    trained = frozen = 0
    head = model.get_output_embeddings()
    for module in model.modules():
        if id(module) in inside or module is head or next(module.children(), None) is not None:
            continue
        kernels = _leaf(module)
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            trained += kernels
        else:
            frozen += kernels
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    return KernelCounts(layers, trained, frozen, tensors)


def _layer_kernels(layer: Any) -> LayerKernels:
    fixed, norms, dequantized, experts = _LAYER_OWN, 0, 0, 0
    for name, module in layer.named_modules():
        if _stacked_experts(module):
            experts += _expert_count(module)
            continue
        if getattr(module, "lora_A", None) is not None and len(module.lora_A):
            fixed += _LORA_GLUE
        if next(module.children(), None) is not None:
            continue
        if _is_norm(module):
            norms += 1
            continue
        fixed += _leaf(module)
        if _is_linear(module) and ".lora_" not in name and not name.startswith("lora_"):
            dequantized += 1
    return LayerKernels(fixed, norms, dequantized, experts)


def _is_linear(module: Any) -> bool:
    import torch

    return isinstance(module, torch.nn.Linear)


def _is_norm(module: Any) -> bool:
    return "Norm" in type(module).__name__


def _stacked_experts(module: Any) -> bool:
    """transformers 5's experts: one module holding every expert's weights as 3-D tensors."""
    return any(p.dim() == 3 for p in module.parameters(recurse=False)) and _expert_count(module) > 1


def _expert_count(module: Any) -> int:
    for p in module.parameters(recurse=False):
        if p.dim() == 3:
            return p.shape[0]
    return 0


def _leaf(module: Any) -> int:
    import torch

    containers = (torch.nn.ModuleDict, torch.nn.ModuleList, torch.nn.ParameterDict, torch.nn.ParameterList)
    if isinstance(module, (torch.nn.Identity, *containers)) or (isinstance(module, torch.nn.Dropout) and module.p == 0):
        return 0  # PEFT's empty dicts (embedding adapters, DoRA's magnitudes) are leaves that run nothing
    if _is_norm(module):
        return UNFUSED_NORM
    if "Rotary" in type(module).__name__:
        return 2  # cos and sin, once per forward
    return 1
