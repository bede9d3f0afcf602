"""RLOO (`rl: rloo`, REINFORCE Leave-One-Out) on TRL's RLOOTrainer: the model generates `trl.num_generations`
completions per prompt, the user's reward functions (`trl.reward_funcs`) score them, and each completion's advantage
is its reward minus the mean reward of the other completions of its prompt. The KL weight `trl.beta` (TRL's default
0.05) is subtracted from the rewards, per sequence, not added to the loss as in GRPO.

With an adapter and `trl.beta > 0` the reference is the base model with the adapter switched off (TRL's copy of the
adapter is removed). What RLOO shares with GRPO is in `online.py`."""

from __future__ import annotations

from typing import Any

from trl import RLOOConfig, RLOOTrainer

from hellbender.config import HellbenderConfig
from hellbender.train.methods.generation_state import GenerationStateMixin
from hellbender.train.methods.online import OnlineRLMixin, build_online_trainer, online_arguments
from hellbender.train.methods.shared import PreferenceMixin
from hellbender.train.trainer import HellbenderMixin


def arguments(cfg: HellbenderConfig) -> tuple[type[RLOOConfig], dict[str, Any]]:
    """RLOOConfig and the fields the `trl:` block sets, beside those every training method shares."""
    return RLOOConfig, online_arguments(cfg)


class RLOOHellbenderTrainer(HellbenderMixin, GenerationStateMixin, OnlineRLMixin, PreferenceMixin, RLOOTrainer):
    """TRL's RLOOTrainer with hellbender's run behaviour, on prompt rows."""


TRAINER = RLOOHellbenderTrainer


def build_trainer(
    cfg: HellbenderConfig,
    model: Any,
    args: RLOOConfig,
    train_dataset: Any,
    eval_dataset: Any,
    tokenizer: Any,
    data_collator: Any = None,
    **hellbender: Any,
) -> RLOOHellbenderTrainer:
    return build_online_trainer(TRAINER, cfg, model, args, train_dataset, eval_dataset, tokenizer, **hellbender)
