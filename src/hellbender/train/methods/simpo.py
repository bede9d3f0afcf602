"""SimPO (`rl: simpo`) on TRL's experimental CPOTrainer with `loss_type="simpo"`, from prepared pairs. No reference
model."""

from __future__ import annotations

from typing import Any

from trl.experimental.cpo import CPOConfig, CPOTrainer

from hellbender.config import HellbenderConfig
from hellbender.train.methods.legacy_pairs import PreTokenizedPairs
from hellbender.train.methods.shared import PreferenceMixin, build_preference_trainer, shared_arguments
from hellbender.train.trainer import HellbenderMixin


def arguments(cfg: HellbenderConfig) -> tuple[type[CPOConfig], dict[str, Any]]:
    """`max_length` bounds only TRL's own tokenization, which the prepared rows skip."""
    return CPOConfig, {
        **shared_arguments(),
        "loss_type": "simpo",
        "beta": cfg.rl_beta,
        "simpo_gamma": cfg.simpo_gamma,
        "cpo_alpha": cfg.cpo_alpha,
    }


class SimPOPreferenceTrainer(HellbenderMixin, PreTokenizedPairs, PreferenceMixin, CPOTrainer):
    """CPOTrainer on prepared pairs. Its NLL (behaviour-cloning) term already uses the chosen answers' labels,
    which hide the prompt."""


TRAINER = SimPOPreferenceTrainer  # also built by `hellbender evaluate` (use/evaluate_preference.py)


def build_trainer(
    cfg: HellbenderConfig,
    model: Any,
    args: CPOConfig,
    train_dataset: Any,
    eval_dataset: Any,
    tokenizer: Any,
    **hellbender: Any,
) -> SimPOPreferenceTrainer:
    """The loss per batch is the mean of -log sigmoid(beta * (mean log-prob of the chosen answer - that of the
    rejected one) - simpo_gamma), plus `cpo_alpha` times the mean NLL of the chosen answers' tokens (0 gives the
    paper's SimPO; TRL's and Axolotl's default, 1.0, is CPO-SimPO)."""
    return build_preference_trainer(TRAINER, model, args, train_dataset, eval_dataset, tokenizer, **hellbender)
