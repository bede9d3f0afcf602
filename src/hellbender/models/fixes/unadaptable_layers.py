"""Layers of some families that are `nn.Linear` by class but cannot carry a LoRA adapter, and why.

`lora_target_linear: true` adapts every linear layer; for these families that includes layers PEFT refuses or
wraps wrongly, and training would stop inside PEFT or the forward pass. hellbender leaves them out of
`lora_target_linear` (saying so in one line) and refuses them by name when `lora_target_modules` asks for them.

- Mamba-based families: PEFT refuses LoRA on their `out_proj` and `conv1d` (its `_check_lora_target_modules_mamba`
  names the same model types and module names; a test checks PEFT still refuses each one).
- Mamba mixers that read a projection's weight matrix directly instead of calling the layer: their fused CUDA
  kernels take `out_proj.weight` (and Mamba-1's `x_proj.weight`), and Mamba-1 and Jamba multiply by `dt_proj.weight`
  on every path. An adapter on such a layer is never used: it trains nothing, silently (on CPU, Mamba-1's `dt_proj`
  adapter gets no gradient at all). Some of these families are not in PEFT's list (Jamba, Bamba, Granite hybrid,
  Zamba2). A vision-language model whose language model is one of these (Nemotron-H Omni) has the same mixers.
- Linear subclasses whose forward computes something other than `x @ W.T + b`: a LoRA pair adds `x @ A.T @ B.T` to the
  layer's output, which only fits a plain linear map. Routers that return a tuple (Llama 4, PhiMoE) and DeepSeek-V4's
  grouped output projection (each head group times its own slice of the weight, so the input is wider than
  `in_features`) are such layers; plain PEFT fails on them too (`'tuple' object has no attribute 'dtype'`, a size
  mismatch).
- The layers of a sparse-attention indexer (DeepSeek-V3.2's and V4's lightning indexer and the families built on it:
  GLM-MoE-DSA, HY-V4, AXK2, dots3, Qwen4-exp): the indexer only chooses which positions each query's attention reads,
  as top-k indices or a 0 / -inf mask built from them. No gradient passes through that choice, so an adapter there
  trains nothing (a test checks that no indexer weight of these families receives a gradient).
"""

from __future__ import annotations

from typing import Any

MAMBA_MODEL_TYPES = frozenset({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"})
MAMBA_REFUSED_LEAVES = frozenset({"out_proj", "conv1d"})
MAMBA_REASON = "PEFT refuses LoRA on `out_proj` and `conv1d` of Mamba-based models ({model_type})"

# model_type -> layers of its Mamba mixer (the module that has a `conv1d`) whose weight the mixer reads directly
_MAMBA1_READS = ("x_proj", "dt_proj", "out_proj")
_FUSED_OUT_PROJ = ("out_proj",)
WEIGHTS_READ_DIRECTLY: dict[str, tuple[str, ...]] = {
    "mamba": _MAMBA1_READS,
    "falcon_mamba": _MAMBA1_READS,
    "jamba": ("dt_proj",),
    **dict.fromkeys(("mamba2", "falcon_h1", "nemotron_h", "bamba", "granitemoehybrid", "zamba2"), _FUSED_OUT_PROJ),
}
DIRECT_READ_REASON = (
    "the Mamba mixer multiplies by this layer's weight directly (in its fused kernels, or always), so an adapter on "
    "it would never be used"
)

# class name -> why LoRA cannot wrap a layer of that class
NOT_PLAIN_LINEAR = {
    "Llama4Router": "Llama 4's router returns routing scores and logits (a tuple), not one tensor LoRA can add to",
    "PhimoeTopKRouter": "PhiMoE's router returns logits, weights and expert indices (a tuple), not one tensor LoRA "
    "can add to",
    "DeepseekV4GroupedLinear": "DeepSeek-V4's grouped output projection multiplies each head group by its own block "
    "of the weight, which a LoRA pair over `in_features` does not fit",
}


# Modules whose class name ends with this pick attention positions by top-k; their layers get no gradient.
INDEXER_SUFFIX = "Indexer"
INDEXER_REASON = (
    "the sparse-attention indexer only chooses which positions attention reads (top-k indices, or a mask built from "
    "them), a choice no gradient passes through, so an adapter there would never learn"
)


def unadaptable_layers(model: Any) -> dict[str, str]:
    """Full module name -> why LoRA must leave it out, for every such layer of `model` (empty for most models)."""
    import torch

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    mamba = model_type in MAMBA_MODEL_TYPES
    # A vision-language composite builds its language model from `text_config` (Nemotron-H Omni's is a Nemotron-H):
    # its Mamba mixers read the same weights directly. PEFT's refusal goes by the top-level type only, so it does
    # not apply there.
    text_type = getattr(getattr(config, "text_config", None), "model_type", None)
    read_directly = WEIGHTS_READ_DIRECTLY.get(model_type) or WEIGHTS_READ_DIRECTLY.get(text_type, ())
    found = {}
    indexers: list[str] = []  # named_modules lists a module before its children
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if type(module).__name__.endswith(INDEXER_SUFFIX):
            indexers.append(f"{name}.")
        if isinstance(module, torch.nn.Linear) and any(name.startswith(prefix) for prefix in indexers):
            found[name] = INDEXER_REASON
        elif mamba and leaf in MAMBA_REFUSED_LEAVES:
            found[name] = MAMBA_REASON.format(model_type=model_type)
        elif type(module).__name__ in NOT_PLAIN_LINEAR:
            found[name] = NOT_PLAIN_LINEAR[type(module).__name__]
        for child, layer in module.named_children():
            if child in read_directly and hasattr(module, "conv1d") and isinstance(layer, torch.nn.Linear):
                found.setdefault(f"{name}.{child}" if name else child, DIRECT_READ_REASON)
    return found


def left_out_notice(left_out: dict[str, str]) -> str:
    """One line saying which layers `lora_target_linear` leaves out, and why."""
    by_reason: dict[str, set[str]] = {}
    for name, reason in left_out.items():
        by_reason.setdefault(reason, set()).add(name.rsplit(".", 1)[-1])
    reasons = "; ".join(
        f"{', '.join(f'`{leaf}`' for leaf in sorted(leaves))}: {reason}" for reason, leaves in by_reason.items()
    )
    return f"`lora_target_linear` leaves out {len(left_out)} layer(s) LoRA cannot adapt ({reasons})."


def refusal(asked: list[str], left_out: dict[str, str], key: str = "lora_target_modules") -> str:
    """The paragraph refusing targets that name unadaptable layers (`asked`: the module names matched)."""
    reasons = "; ".join(sorted({f"`{n.rsplit('.', 1)[-1]}`: {left_out[n]}" for n in asked}))
    return (
        f"`{key}` names layers LoRA cannot adapt in this model ({reasons}). Remove them from `{key}` "
        "(`lora_target_linear: true` adapts every other linear layer)."
    )
