"""Every default that depends on other keys is computed here, in one visible place.

Defaults that depend on the prepared data (steps per epoch for `saves_per_epoch`, warm-up from a ratio)
are computed by `hellbender.train.schedule` once the data is known.
"""

from __future__ import annotations

from pathlib import Path

from hellbender.config.schema import HellbenderConfig

ADAPTER_LEARNING_RATE = 2e-4
FULL_FINETUNE_LEARNING_RATE = 2e-5


def apply_derived_defaults(cfg: HellbenderConfig) -> HellbenderConfig:
    updates: dict = {}
    if cfg.learning_rate is None:
        updates["learning_rate"] = ADAPTER_LEARNING_RATE if cfg.adapter else FULL_FINETUNE_LEARNING_RATE
    if cfg.model_type is None:
        updates["model_type"] = "AutoModelForImageTextToText" if cfg.is_multimodal else "AutoModelForCausalLM"
    if cfg.attn_implementation is None:
        updates["attn_implementation"] = "flash_attention_2" if cfg.flash_attention else "sdpa"
    if cfg.adapter == "qlora":
        updates["load_in_4bit"] = True
    if cfg.dataset_prepared_path is None:
        updates["dataset_prepared_path"] = str(Path(cfg.output_dir).parent / "last_run_prepared")
    if cfg.streaming is None and cfg.pretraining_dataset:
        updates["streaming"] = True
    if cfg.eval_batch_size is None:
        updates["eval_batch_size"] = cfg.micro_batch_size
    if cfg.chat_template is None:
        updates["chat_template"] = "tokenizer_default"
    return cfg.model_copy(update=updates)
