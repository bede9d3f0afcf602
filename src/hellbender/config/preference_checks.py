"""The rules of the preference keys (`preference.py`): each method-specific key under its method, KTO's batch size, the
reward model's class, the combinations TRL's trainers cannot honour, and the losses and weights a config trains with."""

from __future__ import annotations

from typing import Any

from hellbender.config.preference import METHOD_KEYS, SMOOTHED_LOSSES
from hellbender.config.rl import ONLINE_RL_METHODS
from hellbender.config.schema import HellbenderConfig

# The keys only a reward model reads -> what each does.
REWARD_MODEL_KEYS = {
    "num_labels": "sizes the score head of a reward model",
    "center_rewards_coefficient": "keeps a reward model's scores near zero",
}


def _is_set(value: Any) -> bool:
    return value is not None and value is not False


def preference_problems(cfg: HellbenderConfig) -> list[str]:
    """Each problem of the preference keys, one paragraph each."""
    problems: list[str] = []
    method = cfg.rl
    for key, methods in METHOD_KEYS.items():
        if not _is_set(getattr(cfg, key)) or method in methods or (key == "rl_beta" and method in ONLINE_RL_METHODS):
            continue  # online RL's own paragraph for `rl_beta` points at `trl.beta` (`rl_checks.py`)
        owners = " or ".join(f"`rl: {m}`" for m in methods)
        if method is None:
            problems.append(
                f"`{key}` tunes preference tuning with {owners}, but `rl` is not set, so it would change nothing. "
                f"Set `rl` to {' or '.join(methods)}, or remove `{key}`."
            )
        else:
            problems.append(
                f"`{key}` belongs to {owners}, but this config sets `rl: {method}`, which does not read it. Remove "
                f"`{key}`, or set `rl` to {' or '.join(methods)}."
            )
    if cfg.reward_model and method is not None:
        problems.append(
            f"`reward_model: true` and `rl: {method}` are both set: a reward model is trained on its own (a scoring "
            "head on preference pairs), not with a preference-tuning method. Keep one of them."
        )
    if cfg.reward_model:
        problems += _reward_model_problems(cfg)
    else:
        problems += [
            f"`{key}` {what}, and `reward_model` is not set, so it would change nothing. Set `reward_model: true`, or "
            f"remove `{key}`."
            for key, what in REWARD_MODEL_KEYS.items()
            if getattr(cfg, key) is not None
        ]
    if method in ("dpo", "ipo"):
        problems += _dpo_problems(cfg)
    if method == "kto" and cfg.micro_batch_size < 2:
        problems.append(
            f"`rl: kto` with `micro_batch_size: {cfg.micro_batch_size}`: KTO estimates its KL term by scoring each "
            "prompt with another row's answer from the same micro-batch, so a micro-batch needs at least 2 rows. Set "
            "`micro_batch_size: 2` or more (lower `gradient_accumulation_steps` to keep the batch)."
        )
    if method == "kto" and cfg.curriculum_sampling:
        problems.append(
            "`curriculum_sampling` trains rows in dataset order, and `rl: kto` shuffles its rows once before training "
            "(its KL term pairs each prompt with a neighbouring row's answer, which must be another prompt's). Remove "
            "`curriculum_sampling`."
        )
    if method is not None or cfg.reward_model:
        problems += _sft_only_problems(cfg)
    return problems


def _dpo_problems(cfg: HellbenderConfig) -> list[str]:
    problems: list[str] = []
    losses = list(cfg.dpo_loss_type or [])
    if cfg.rl == "ipo" and losses not in ([], ["ipo"]):
        problems.append(
            f"`dpo_loss_type: {losses}` with `rl: ipo`: `rl: ipo` is DPO with the IPO loss only. Remove "
            "`dpo_loss_type`, or set `rl: dpo` to choose the losses."
        )
    losses = dpo_losses(cfg)
    if cfg.dpo_loss_weights is not None and len(cfg.dpo_loss_weights) != len(cfg.dpo_loss_type or ["sigmoid"]):
        problems.append(
            f"`dpo_loss_weights` has {len(cfg.dpo_loss_weights)} weight(s) for {len(cfg.dpo_loss_type or [1])} "
            "loss type(s) in `dpo_loss_type`: give one weight per loss, in the same order."
        )
    if cfg.dpo_norm_loss and (cfg.dpo_loss_type or ["sigmoid"]) != ["sigmoid"]:
        problems.append(
            f"`dpo_norm_loss: true` length-normalises the `sigmoid` loss, and `dpo_loss_type` is {cfg.dpo_loss_type}. "
            "Remove `dpo_norm_loss` (for normalised DPO, `dpo_loss_type: [sigmoid_norm]` says the same)."
        )
    if cfg.rpo_alpha is not None and "sft" in (cfg.dpo_loss_type or []):
        problems.append(
            "`rpo_alpha` adds the `sft` loss, and `dpo_loss_type` names `sft` already. Keep one: `rpo_alpha`, or "
            "`sft` in `dpo_loss_type` with its weight in `dpo_loss_weights`."
        )
    if cfg.dpo_label_smoothing and not SMOOTHED_LOSSES & set(losses):
        problems.append(
            f"`dpo_label_smoothing` is read only by the `robust`, `exo_pair`, `aot` and `aot_unpaired` losses, and "
            f"this run's losses are {losses}: it would change nothing. For conservative DPO with flipped labels, set "
            "`dpo_loss_type: [robust]`; otherwise remove `dpo_label_smoothing`."
        )
    if "exo_pair" in losses and not cfg.dpo_label_smoothing:
        problems.append(
            "The `exo_pair` loss needs `dpo_label_smoothing` above 0 (its epsilon; the EXO paper suggests 0.001)."
        )
    if cfg.dpo_use_weighting and {"aot", "aot_unpaired"} & set(losses):
        problems.append(
            "`dpo_use_weighting` weights each pair, and the `aot` losses sort the pairs of a batch, so the weights "
            "would land on other pairs. Remove `dpo_use_weighting`, or choose another loss."
        )
    return problems


def _reward_model_problems(cfg: HellbenderConfig) -> list[str]:
    if cfg.num_labels not in (None, 1):
        return [
            f"`num_labels: {cfg.num_labels}` with `reward_model: true`: a Bradley-Terry reward model gives one score "
            "per sequence, so its head has one label. Set `num_labels: 1` or remove it."
        ]
    if cfg.model_type is not None and not cfg.model_type.endswith("ForSequenceClassification"):
        return [
            f"`reward_model: true` trains a sequence-classification model (a score head on the model), and "
            f"`model_type: {cfg.model_type}` loads another kind. Remove `model_type` (it defaults to "
            "`AutoModelForSequenceClassification`), or name a `...ForSequenceClassification` class."
        ]
    return []


def _sft_only_problems(cfg: HellbenderConfig) -> list[str]:
    """Keys of supervised fine-tuning that preference tuning cannot honour yet."""
    refused = {
        "sample_packing": (
            cfg.sample_packing,
            "TRL's preference trainer pads each pair; packed rows are not offered for it yet",
        ),
        "liger_fused_linear_cross_entropy": (
            cfg.fuses_the_loss,
            "the preference trainer computes log-probabilities through its own fused LM head, so Liger's fused "
            "cross-entropy (also asked for by `cut_cross_entropy`) would never run",
        ),
        "use_eaft": (
            cfg.use_eaft,
            "it weights the cross-entropy of supervised fine-tuning, which DPO does not compute",
        ),
        "streaming": (cfg.uses_streaming, "preference pairs are prepared and cached before training, not streamed"),
        # Verified on two GPUs (tests/test_gpu_preference.py) for the offline methods and, with FSDP2 and ZeRO-2,
        # for online RL, which generates with the sharded model inside the step.
    }
    method = f"`rl: {cfg.rl}`" if cfg.rl else "`reward_model: true`"
    return [
        f"`{key}` cannot be used with {method}: {why}. Remove `{key}` (preference tuning runs on one process "
        "or several with `--nproc`)."
        for key, (asked, why) in refused.items()
        if asked
    ]


def dpo_losses(cfg: HellbenderConfig) -> list[str]:
    """The TRL loss types this config trains with, `rpo_alpha`'s `sft` term included."""
    losses = ["ipo"] if cfg.rl == "ipo" else list(cfg.dpo_loss_type or ["sigmoid"])
    if cfg.dpo_norm_loss and losses == ["sigmoid"]:
        losses = ["sigmoid_norm"]
    if cfg.rpo_alpha is not None:
        losses.append("sft")
    return losses


def dpo_loss_weights(cfg: HellbenderConfig) -> list[float] | None:
    """One weight per loss of `dpo_losses`, or None for TRL's equal weights."""
    if cfg.rpo_alpha is None:
        return list(cfg.dpo_loss_weights) if cfg.dpo_loss_weights is not None else None
    preference = list(cfg.dpo_loss_weights) if cfg.dpo_loss_weights is not None else [1.0] * (len(dpo_losses(cfg)) - 1)
    return [*preference, cfg.rpo_alpha]
