"""Whether a model can score a DPO pair in one row that holds its prompt once (`dpo_shared_prompt`), and whether it
does so by default. Read by training (`train/shared_prompt.py`) and by the memory planner, so both decide alike."""

from __future__ import annotations

from typing import Any


def why_not_shared(config: Any) -> str | None:
    """Why the pairs of a model with this (text) config cannot be scored with their prompt once, or None."""
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ("sdpa", "eager"):
        return (
            f"its attention is `{attention}`; the shared rows need SDPA (on a GPU, flash-attention varlen kernels "
            "run them) or eager attention"
        )
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(config, "sliding_window", None) is not None:
        named = ", ".join(sorted(layer_types - {"full_attention"})) or "sliding-window attention"
        return f"it has {named} layers, which the shared rows' attention does not keep"
    if getattr(config, "output_router_logits", False):
        return "its router's load-balancing loss counts every token of the batch, and the prompt would count once"
    return None


def why_model_not_shared(model: Any) -> str | None:
    """`why_not_shared` for a whole model, a vision-language model (whose images belong to the prompt) included."""
    config = model.config.get_text_config()
    if config is not model.config:
        return "it is a vision-language model, whose images belong to the prompt"
    return why_not_shared(config)


def varlen_available() -> bool:
    """Whether the installed torch has the flash-attention varlen kernel the shared rows run on a GPU."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def shared_by_default(attention: str | None, on_gpu: bool, sixteen_bit: bool) -> bool:
    """Unset `dpo_shared_prompt` on a model that can share: on where it pays, on CUDA with SDPA in 16-bit precision,
    where the varlen kernel computes no masked block. A dense mask (CPU, eager attention, float32) takes attention off
    its causal kernels and costs more than the prompt saves (measured on CPU: half the pairs/s)."""
    return on_gpu and sixteen_bit and attention == "sdpa" and varlen_available()
