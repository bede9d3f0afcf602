"""Combinations of keys that knowledge distillation cannot honour, one paragraph each naming the keys."""

from __future__ import annotations

from hellbender.config.deepspeed import read_deepspeed_json, zero_stage
from hellbender.config.distillation import KD_TUNING_KEYS, DistillationSettings
from hellbender.config.schema import HellbenderConfig
from hellbender.errors import ConfigError

DOCS = "See docs/distillation.md."


def distillation_problems(cfg: HellbenderConfig) -> list[str]:
    entries = [(f"datasets[{i}]", e) for i, e in enumerate(cfg.datasets)] + [
        (f"test_datasets[{i}]", e) for i, e in enumerate(cfg.test_datasets)
    ]
    with_targets = [name for name, e in entries if e.logprobs_field]
    stray_temperature = [name for name, e in entries if e.temperature is not None and not e.logprobs_field]
    problems = [
        f"`{name}.temperature` is set without `logprobs_field`: it is the temperature of the teacher's "
        "log-probabilities stored in the rows. Add `logprobs_field`, or remove `temperature`."
        for name in stray_temperature
    ]
    if not cfg.distills:
        fields = DistillationSettings.model_fields
        tuned = [key for key in KD_TUNING_KEYS if getattr(cfg, key) != fields[key].get_default()]
        if tuned:
            problems.append(
                f"{', '.join(f'`{k}`' for k in tuned)} set but knowledge distillation is off: add `kd_trainer: true` "
                f"(or `plugins: [axolotl.integrations.kd.KDPlugin]`), or remove them. {DOCS}"
            )
        if with_targets:
            problems.append(
                f"{', '.join(f'`{n}`' for n in with_targets)} carr{'ies' if len(with_targets) == 1 else 'y'} the "
                "teacher's log-probabilities (`logprobs_field`, or an `axolotl.integrations.kd` type), which only "
                f"knowledge distillation reads: add `kd_trainer: true`, or remove `logprobs_field`. {DOCS}"
            )
        return problems
    problems += _unsupported_with_distillation(cfg)
    blocker = fused_loss_blocker(cfg)
    if cfg.kd_fused_loss and blocker:
        problems.append(f"`kd_fused_loss: true` cannot work here: {blocker}. Remove `kd_fused_loss`. {DOCS}")
    if cfg.kd_teacher_model is not None:
        if with_targets:
            problems.append(
                f"`kd_teacher_model` gives the teacher's targets batch by batch, and "
                f"{', '.join(f'`{n}`' for n in with_targets)} also carr{'ies' if len(with_targets) == 1 else 'y'} "
                "them (`logprobs_field`): keep one source: remove `kd_teacher_model` to train on the stored targets, "
                f"or `logprobs_field` to use the teacher. {DOCS}"
            )
        return problems
    if cfg.kd_online_topk != DistillationSettings.model_fields["kd_online_topk"].get_default():
        problems.append(
            "`kd_online_topk` is the number of targets taken from `kd_teacher_model`, which is not set: add "
            f"`kd_teacher_model`, or remove `kd_online_topk` (stored targets keep the k they were written with). {DOCS}"
        )
    without = [name for name, e in entries if not e.logprobs_field]
    if without:
        problems.append(
            f"`kd_trainer` without `kd_teacher_model` trains on the teacher's top-k stored in the rows, but "
            f"{', '.join(f'`{n}`' for n in without)} name{'s' if len(without) == 1 else ''} no `logprobs_field`: set "
            "`logprobs_field` (or `type: axolotl.integrations.kd.chat_template`), write the targets with `hellbender "
            f"distill-logprobs`, or name a teacher with `kd_teacher_model`. {DOCS}"
        )
    if cfg.pretraining_dataset:
        problems.append(
            "`pretraining_dataset` rows carry no teacher log-probabilities; offline distillation trains on "
            f"`datasets` with `logprobs_field`. Name a teacher with `kd_teacher_model`, or remove `pretraining_dataset`. "
            f"{DOCS}"
        )
    return problems


def _unsupported_with_distillation(cfg: HellbenderConfig) -> list[str]:
    """What distillation does not combine with, each with the reason."""
    clashes = []
    if cfg.rl is not None or cfg.reward_model:
        clashes.append(("`rl` / `reward_model`", "distillation is a supervised loss; preference tuning has its own"))
    if cfg.is_multimodal:
        clashes.append(("`processor_type`", "distillation of vision-language models is not offered yet"))
    if cfg.streaming or cfg.skip_prepare_dataset:
        clashes.append(
            (
                "`streaming` / `skip_prepare_dataset`",
                "the teacher's targets are aligned and checked when data is prepared",
            )
        )
    if cfg.fuses_the_loss:
        clashes.append(
            (
                "`liger_fused_linear_cross_entropy` / `cut_cross_entropy`",
                "those compute the cross-entropy alone; the distillation loss has its own fused form, "
                "`kd_fused_loss` (on by default on a GPU)",
            )
        )
    if cfg.use_eaft:
        clashes.append(("`use_eaft`", "it is another loss in place of cross-entropy; choose one"))
    return [f"`kd_trainer` cannot be combined with {keys}: {why}. Remove one of them. {DOCS}" for keys, why in clashes]


def fused_loss_blocker(cfg: HellbenderConfig) -> str | None:
    """Why the chunked distillation loss (`kd_fused_loss`) cannot run with this config, or None. It reads the output
    layer's weight whole, outside the model's forward, and needs that layer to be a plain linear layer."""
    if cfg.fsdp_version == 2:
        return "FSDP2 (`fsdp_version: 2`) shards the output layer's weight, which the chunked loss reads whole"
    if cfg.deepspeed:
        try:
            stage = zero_stage(read_deepspeed_json(cfg.deepspeed))
        except ConfigError:
            stage = None  # the file's own problem is reported by the DeepSpeed checks
        if stage == 3:
            return "ZeRO-3 partitions the output layer's weight, which the chunked loss reads whole"
    adapted = cfg.lora_target_modules if isinstance(cfg.lora_target_modules, list) else [cfg.lora_target_modules]
    if cfg.adapter and any("lm_head" in str(name) for name in [*adapted, *cfg.lora_modules_to_save]):
        return "the adapter wraps `lm_head`, and the chunked loss needs the plain output layer"
    return None
