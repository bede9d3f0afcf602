"""The router's auxiliary (load-balancing) loss of mixture-of-experts causal LMs: asked for with
`overrides_of_model_config` (Axolotl's `model_config`) `output_router_logits: true`, weighted by
`router_aux_loss_coef`. transformers computes it in the family's forward (`load_balancing_loss_func`) and returns it
as `aux_loss`; it adds `coef x aux_loss` to the loss only when the forward computes the loss itself, which
hellbender's own cross-entropy does not let it do, so the trainer adds it (train/trainer.py). This module says which
models have the loss, reads its weight and refuses the settings under which it would do nothing or fail."""

from __future__ import annotations

import importlib
from typing import Any

from hellbender.errors import ConfigError

ROUTER_KEYS = ("output_router_logits", "router_aux_loss_coef")
# Where a family keeps the weight of the loss: the usual name, JetMoE's, and DBRX's (inside its `ffn_config`).
COEFFICIENT_NAMES = ("router_aux_loss_coef", "aux_loss_coef")


def _owners(config: Any) -> list[Any]:
    """The config and its text model's (a vision-language model keeps its experts in the text model)."""
    text = config.get_text_config()
    return [config] if text is config else [config, text]


def coefficient_of(config: Any) -> float | None:
    """The weight the family's forward gives its auxiliary loss, or None when it keeps none."""
    for name in COEFFICIENT_NAMES:
        if getattr(config, name, None) is not None:
            return float(getattr(config, name))
    ffn = getattr(config, "ffn_config", None)
    if getattr(ffn, "moe_loss_weight", None) is not None:
        return float(ffn.moe_loss_weight)
    return None


def computes_router_aux_loss(config: Any) -> bool:
    """Whether this config's family returns a router auxiliary loss: it keeps a weight for it, and its modeling
    module defines the load-balancing loss. Llama 4 keeps a weight and never uses it; DeepSeek-V3 and GLM-4 MoE
    return router logits but balance their experts with a bias instead of a loss; dense models have no router."""
    if coefficient_of(config) is None or not hasattr(config, "output_router_logits"):
        return False
    try:
        modeling = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return False
    return hasattr(modeling, "load_balancing_loss_func")


def check_router_overrides(config: Any, overrides: dict[str, Any]) -> None:
    """Before `overrides_of_model_config` is applied: a router key on a model without the loss is refused by name
    (it would do nothing), as is a weight without `output_router_logits: true` (no loss is computed then)."""
    asked = [key for key in ROUTER_KEYS if key in overrides and (key != "output_router_logits" or overrides[key])]
    if not asked:
        return
    if not any(computes_router_aux_loss(owner) for owner in _owners(config)):
        keys = " and ".join(f"`overrides_of_model_config.{key}`" for key in asked)
        raise ConfigError(
            f"{keys} ask for the router's auxiliary (load-balancing) loss, and this `{config.model_type}` model "
            "computes none: it has no router (a dense model), or its family balances its experts without that loss "
            "(DeepSeek-V3 and GLM-4 MoE use a bias on the expert scores; Llama 4 and Gemma 4 have no such loss in "
            "transformers). Remove the key(s); the loss applies to Mixtral, Qwen2/Qwen3 MoE, OLMoE, gpt-oss and "
            "other families whose config has `router_aux_loss_coef`."
        )
    if "router_aux_loss_coef" in overrides and not overrides.get("output_router_logits"):
        on = any(getattr(owner, "output_router_logits", False) for owner in _owners(config))
        if not on:
            raise ConfigError(
                f"`overrides_of_model_config.router_aux_loss_coef: {overrides['router_aux_loss_coef']}` weights the "
                "router's auxiliary loss, which this model computes only with `output_router_logits: true` (its "
                "config.json has it off). Add `output_router_logits: true` beside it, or remove the weight."
            )


def router_aux_coefficient(config: Any) -> float | None:
    """The weight of the router's auxiliary loss when this model's forward returns one (`output_router_logits` on,
    from config.json or `overrides_of_model_config`), else None."""
    for owner in _owners(config):
        if getattr(owner, "output_router_logits", False) and computes_router_aux_loss(owner):
            return coefficient_of(owner)
    return None


def check_router_aux_loss(cfg: Any, model: Any) -> None:
    """At loading: the settings under which the loss would be dropped or could not be computed are refused."""
    from hellbender.models.packed_attention import needs_packed_masks, text_config

    if router_aux_coefficient(model.config) is None:
        return
    if cfg.reward_model:
        raise ConfigError(
            "`output_router_logits` is on (from `overrides_of_model_config` or the model's config.json): it adds the "
            "router's auxiliary loss to a causal LM's loss, and `reward_model` trains a score head whose loss never "
            "includes it. Set `overrides_of_model_config: {output_router_logits: false}` for a reward model."
        )
    if (cfg.sample_packing or cfg.eval_sample_packing) and needs_packed_masks(text_config(model)):
        raise ConfigError(
            f"`output_router_logits: true` with `sample_packing` on this `{text_config(model).model_type}` model: "
            "packed rows get a block-diagonal attention mask here, and the model's load-balancing loss reads the "
            "attention mask as one entry per token, so it cannot be computed. Use `attn_implementation: "
            "flash_attention_2` (packed rows then need no mask), set `sample_packing: false`, or remove "
            "`output_router_logits`."
        )
