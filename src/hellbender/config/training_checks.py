"""Combinations of the learning-rate schedule, early stopping, checkpoint, accelerator and loss keys that cannot work
together. Each problem is one paragraph naming the keys."""

from __future__ import annotations

from hellbender.config.loss import EAFT_TUNING_KEYS, LossSettings
from hellbender.config.plugins import CUT_CROSS_ENTROPY_PLUGIN
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
    problems += _eaft_problems(cfg)
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


def _eaft_problems(cfg: HellbenderConfig) -> list[str]:
    if not cfg.use_eaft:
        tuned = [k for k in EAFT_TUNING_KEYS if getattr(cfg, k) != LossSettings.model_fields[k].default]
        if not tuned:
            return []
        verb, them = ("tunes", "it") if len(tuned) == 1 else ("tune", "them")
        named = " and ".join(f"`{k}`" for k in tuned)
        return [
            f"{named} {verb} entropy-aware focal training, and `use_eaft` is off: add `use_eaft: true`, or remove "
            f"{them}."
        ]
    # Checked before the defaults are filled in: the plugin turns `cut_cross_entropy` on unless it is set to false.
    fused = ["`liger_fused_linear_cross_entropy`"] if cfg.liger_fused_linear_cross_entropy else []
    if cfg.cut_cross_entropy:
        fused.append("`cut_cross_entropy`")
    elif cfg.cut_cross_entropy is None and CUT_CROSS_ENTROPY_PLUGIN in cfg.plugins:
        fused.append(f"`plugins: [{CUT_CROSS_ENTROPY_PLUGIN}]` (which turns `cut_cross_entropy` on)")
    if not fused:
        return []
    return [
        f"`use_eaft: true` weights each token's loss by the entropy of its logits, and {' and '.join(fused)} fuses "
        "the LM head into the loss so that the logits never exist. Remove one of them (without the fused loss, a "
        "micro-batch's logits take tokens x vocabulary x 4 bytes of memory; with the plugin, `cut_cross_entropy: "
        "false` turns the fused loss off)."
    ]
