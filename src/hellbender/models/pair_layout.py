"""Whether a model can score a DPO pair in one row that holds its prompt once (`dpo_shared_prompt`), and whether it
does so by default. Read by training (`train/shared_prompt.py`) and by the memory planner, so both decide alike."""

from __future__ import annotations

from typing import Any


def why_not_shared(model: Any, config: Any) -> str | None:
    """Why the pairs of this model cannot be scored with their prompt once, or None where they can. `config`: the
    causal LM's text config."""
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ("sdpa", "eager", "flex_attention"):
        return (
            f"its attention is `{attention}`, whose kernel cannot be given a mask under which the rejected answer sees "
            "the prompt but not the chosen answer (SDPA, eager and flex attention can)"
        )
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(config, "sliding_window", None) is not None:
        named = ", ".join(sorted(layer_types - {"full_attention"})) or "sliding-window attention"
        return f"it has {named} layers, which one mask for every layer would not keep"
    if getattr(config, "output_router_logits", False):
        return "its router's load-balancing loss counts every token of the batch, and the prompt would count once"
    return None


def why_model_not_shared(model: Any) -> str | None:
    """`why_not_shared` for a whole model, a vision-language model (whose images belong to the prompt) included."""
    config = model.config.get_text_config()
    if config is not model.config:
        return "it is a vision-language model, whose images belong to the prompt"
    return why_not_shared(model, config)


def shared_by_default(attention: str | None, on_gpu: bool) -> bool:
    """Unset `dpo_shared_prompt` on a model that can share: on where it pays, on CUDA with SDPA or flex attention
    (flex attention's block mask skips the masked blocks). A dense mask (CPU, eager attention) takes SDPA off its
    causal kernels and costs more than the prompt saves (measured on CPU: half the pairs/s)."""
    return on_gpu and attention != "eager"
