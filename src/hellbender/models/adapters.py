"""LoRA / QLoRA / DoRA adapters through PEFT."""

from __future__ import annotations

from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError

# Used when the config names no targets: the attention and MLP projections of common decoder families.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def target_modules(cfg: HellbenderConfig, model: Any) -> list[str] | str:
    if cfg.lora_target_linear and not cfg.lora_target_modules:
        return "all-linear"
    if isinstance(cfg.lora_target_modules, str):
        return cfg.lora_target_modules
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    wanted = list(cfg.lora_target_modules or [t for t in DEFAULT_TARGETS if t in names])
    missing = [t for t in wanted if t not in names]
    if missing or not wanted:
        raise ConfigError(
            f"`lora_target_modules`: {', '.join(missing) or 'no default projection'} not found in the model. "
            f"Linear layers it has: {', '.join(sorted(_linear_names(model)))}. Or set `lora_target_linear: true`."
        )
    if cfg.lora_target_linear:
        wanted = sorted(set(wanted) | _linear_names(model))
    return wanted


def _linear_names(model: Any) -> set[str]:
    import torch

    out_head = model.get_output_embeddings()
    return {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not out_head
    }


def apply_adapter(cfg: HellbenderConfig, model: Any) -> Any:
    """Wrap `model` in a PEFT adapter when the config asks for one; otherwise return it for full fine-tuning."""
    if cfg.adapter is None:
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if cfg.adapter == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=target_modules(cfg, model),
        modules_to_save=list(cfg.lora_modules_to_save) or None,
        use_dora=cfg.peft_use_dora,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)
