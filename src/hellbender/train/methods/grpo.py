"""GRPO (`rl: grpo`) on TRL's GRPOTrainer: the model generates `trl.num_generations` completions per prompt, the
user's reward functions (`trl.reward_funcs`) score them, and the policy learns from each completion's reward relative
to its group (minus the group's mean, divided by its spread: `trl.scale_rewards`), with the loss `trl.loss_type`.
`rl: gdpo` is the same trainer with each reward function normalised within the group before the sum
(`trl.multi_objective_aggregation: normalize_then_sum`).

With an adapter and `trl.beta > 0` the reference is the base model with the adapter switched off (TRL's copy of the
adapter is removed). What GRPO shares with RLOO is in `online.py`."""

from __future__ import annotations

from typing import Any

from trl import GRPOConfig, GRPOTrainer

from hellbender.config import HellbenderConfig
from hellbender.train.methods.generation_state import GenerationStateMixin
from hellbender.train.methods.online import OnlineRLMixin, build_online_trainer, online_arguments
from hellbender.train.methods.shared import PreferenceMixin
from hellbender.train.trainer import HellbenderMixin


def arguments(cfg: HellbenderConfig) -> tuple[type[GRPOConfig], dict[str, Any]]:
    """GRPOConfig and the fields the `trl:` block sets, beside those every training method shares."""
    trl = cfg.trl
    assert trl is not None  # `rl: grpo` without it is refused at validation
    return GRPOConfig, {
        **online_arguments(cfg),
        "loss_type": trl.loss_type,
        "scale_rewards": trl.scale_rewards,
        "multi_objective_aggregation": trl.multi_objective_aggregation,
        "importance_sampling_level": trl.importance_sampling_level,
    }


class GRPOHellbenderTrainer(HellbenderMixin, GenerationStateMixin, OnlineRLMixin, PreferenceMixin, GRPOTrainer):
    """TRL's GRPOTrainer with hellbender's run behaviour, on prompt rows."""


TRAINER = GRPOHellbenderTrainer


def build_trainer(
    cfg: HellbenderConfig,
    model: Any,
    args: GRPOConfig,
    train_dataset: Any,
    eval_dataset: Any,
    tokenizer: Any,
    data_collator: Any = None,
    **hellbender: Any,
) -> GRPOHellbenderTrainer:
    return build_online_trainer(TRAINER, cfg, model, args, train_dataset, eval_dataset, tokenizer, **hellbender)
