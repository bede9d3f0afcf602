"""ORPO (`rl: orpo`) on TRL's experimental ORPOTrainer, from prepared pairs. No reference model."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from hellbender.config import HellbenderConfig
from hellbender.data.formats.base import IGNORE_INDEX
from hellbender.train.methods.legacy_pairs import PreTokenizedPairs
from hellbender.train.methods.shared import PreferenceMixin, build_preference_trainer, shared_arguments
from hellbender.train.trainer import HellbenderMixin


def arguments(cfg: HellbenderConfig) -> tuple[type[ORPOConfig], dict[str, Any]]:
    """TRL names the weight of the odds-ratio term (the paper's lambda, Axolotl's `orpo_alpha`) `beta`.
    `max_length` bounds only TRL's own tokenization, which the prepared rows skip."""
    return ORPOConfig, {**shared_arguments(), "beta": cfg.orpo_alpha}


class ORPOPreferenceTrainer(HellbenderMixin, PreTokenizedPairs, PreferenceMixin, ORPOTrainer):
    """ORPOTrainer on prepared pairs, with its likelihood (NLL) term on the chosen answer's tokens only.

    TRL's ORPOTrainer takes the NLL over the whole chosen sequence, prompt included; the ORPO paper's SFT term, and
    hellbender's rule that prompt tokens are never trained, take it over the answer. The odds-ratio term already uses
    the answer tokens only (the labels hide the prompt)."""

    def concatenated_forward(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple:
        outputs = super().concatenated_forward(model, batch)
        chosen_logits = outputs[2]  # [rows, length - 1, vocab]: the predictions of tokens 1.. of each chosen sequence
        labels = batch["chosen_labels"]
        labels = F.pad(labels, (0, chosen_logits.shape[1] + 1 - labels.shape[1]), value=IGNORE_INDEX)[:, 1:]
        nll = F.cross_entropy(
            chosen_logits.flatten(0, 1), labels.flatten().to(chosen_logits.device), ignore_index=IGNORE_INDEX
        )
        return (*outputs[:4], nll, *outputs[5:])


TRAINER = ORPOPreferenceTrainer  # also built by `hellbender evaluate` (use/evaluate_preference.py)


def build_trainer(
    cfg: HellbenderConfig,
    model: Any,
    args: ORPOConfig,
    train_dataset: Any,
    eval_dataset: Any,
    tokenizer: Any,
    **hellbender: Any,
) -> ORPOPreferenceTrainer:
    """The loss per batch is the mean NLL of the chosen answers' tokens minus `orpo_alpha` times the mean log-sigmoid
    of the log odds ratio of the chosen over the rejected answer (length-averaged log-probabilities)."""
    return build_preference_trainer(TRAINER, model, args, train_dataset, eval_dataset, tokenizer, **hellbender)
