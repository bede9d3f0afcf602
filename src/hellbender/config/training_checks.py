"""Combinations of the learning-rate schedule, early stopping, checkpoint and accelerator keys that cannot work
together. Each problem is one paragraph naming the keys."""

from __future__ import annotations

from hellbender.config.schema import HellbenderConfig

# Keys that shape the cosine schedule; each needs `lr_scheduler: cosine`.
COSINE_KEYS = ("cosine_min_lr_ratio", "cosine_constant_lr_ratio", "lr_quadratic_warmup")


def training_conflicts(cfg: HellbenderConfig) -> list[str]:
    problems: list[str] = []
    shaping = [key for key in COSINE_KEYS if getattr(cfg, key)]
    if cfg.cosine_min_lr_ratio is not None and "cosine_min_lr_ratio" not in shaping:
        shaping.insert(0, "cosine_min_lr_ratio")  # 0 is a floor too
    if shaping and cfg.lr_scheduler != "cosine":
        problems.append(
            f"{', '.join(f'`{k}`' for k in shaping)} shape the cosine schedule, and `lr_scheduler` is "
            f"`{cfg.lr_scheduler}`: set `lr_scheduler: cosine`, or remove them."
        )
    if cfg.cosine_constant_lr_ratio is not None and cfg.cosine_min_lr_ratio is None:
        problems.append(
            "`cosine_constant_lr_ratio` holds the learning rate at the floor set by `cosine_min_lr_ratio`, which is "
            "not set: add it (e.g. `cosine_min_lr_ratio: 0.1`), or remove `cosine_constant_lr_ratio`."
        )
    if cfg.early_stopping_patience is not None:
        problems += _early_stopping_problems(cfg)
    if cfg.save_only_model and cfg.auto_resume_from_checkpoints:
        problems.append(
            "`auto_resume_from_checkpoints: true` resumes from the checkpoints of `output_dir`, and `save_only_model: "
            "true` writes checkpoints without the optimizer, scheduler and random state, which a run cannot resume "
            "from exactly. Remove one of them."
        )
    if cfg.save_only_model and cfg.uses_fsdp2 and cfg.fsdp_settings.state_dict_type == "SHARDED_STATE_DICT":
        problems.append(
            "`save_only_model: true` with FSDP2 needs whole-model checkpoints: set `fsdp_config.state_dict_type: "
            "FULL_STATE_DICT` (transformers cannot save only the model from sharded checkpoints)."
        )
    accelerator = cfg.accelerator_config
    if accelerator is not None and accelerator.dispatch_batches and cfg.uses_streaming:
        problems.append(
            "`accelerator_config.dispatch_batches: true` cannot be honoured with a streamed `pretraining_dataset`: "
            "the main process would slice every batch tensor along its first dimension, which for image tensors is "
            "not the batch. Remove it (each process then reads the stream and keeps its share)."
        )
    return problems


def _early_stopping_problems(cfg: HellbenderConfig) -> list[str]:
    problems = []
    if not cfg.has_eval_data:
        problems.append(
            "`early_stopping_patience` stops training when the evaluation loss stops improving, and there is no "
            "evaluation data: add `val_set_size` (e.g. `0.05`) or `test_datasets`, or remove the key."
        )
    if cfg.save_steps and cfg.eval_steps and cfg.save_steps % cfg.eval_steps:
        problems.append(
            f"`early_stopping_patience` keeps the checkpoint with the best evaluation loss, so every checkpoint must "
            f"follow an evaluation: `save_steps` ({cfg.save_steps}) must be a multiple of `eval_steps` "
            f"({cfg.eval_steps})."
        )
    if cfg.save_only_model and (cfg.uses_fsdp2 or cfg.deepspeed):
        problems.append(
            "`early_stopping_patience` loads the best checkpoint at the end, which transformers cannot do from "
            "`save_only_model` checkpoints with FSDP or DeepSpeed: remove `save_only_model` or `early_stopping_patience`."
        )
    return problems
