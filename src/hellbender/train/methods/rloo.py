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
from hellbender.train.methods.online import OnlineRLMixin, online_arguments, reward_functions
from hellbender.train.methods.shared import PreferenceMixin
from hellbender.train.trainer import HellbenderMixin


def arguments(cfg: HellbenderConfig) -> tuple[type[RLOOConfig], dict[str, Any]]:
    """RLOOConfig and the fields the `trl:` block sets, beside those every training method shares."""
    return RLOOConfig, online_arguments(cfg)


class RLOOHellbenderTrainer(HellbenderMixin, GenerationStateMixin, OnlineRLMixin, PreferenceMixin, RLOOTrainer):
    """TRL's RLOOTrainer with hellbender's run behaviour, on prompt rows."""


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
    """The RLOO trainer for `cfg`, on `model` as built (`build_trainable_model`) and prompt rows (`prompt` and the
    columns the reward functions read). `hellbender`: `HellbenderMixin`'s keywords and the Trainer's `callbacks`."""
    scorers, scorer_tokenizers = reward_functions(cfg)
    return RLOOHellbenderTrainer(
        model=model,
        reward_funcs=scorers,
        reward_processing_classes=scorer_tokenizers,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        **hellbender,
    )
