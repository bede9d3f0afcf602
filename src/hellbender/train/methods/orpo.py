"""ORPO (`rl: orpo`) on TRL's experimental ORPOTrainer, from prepared pairs (`prompt_ids`, `chosen_ids`,
`rejected_ids`). No reference model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback, TrainingArguments
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from hellbender.train.methods.rows import IGNORE_INDEX, PAIRED_COLUMNS, PreTokenizedPairs, require_columns
from hellbender.train.methods.trl_config import trl_config


class PreTokenizedORPOTrainer(PreTokenizedPairs, ORPOTrainer):
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


def build_orpo_trainer(
    model: PreTrainedModel,
    args: TrainingArguments,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: Dataset,
    eval_dataset: Dataset | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    *,
    orpo_alpha: float,
    disable_dropout: bool = True,
    trainer_class: type[PreTokenizedORPOTrainer] = PreTokenizedORPOTrainer,
) -> PreTokenizedORPOTrainer:
    """The ORPO trainer for `model` (a causal LM, or a PeftModel). The loss per batch is the mean NLL of the chosen
    answers' tokens minus `orpo_alpha` times the mean log-sigmoid of the log odds ratio of the chosen over the rejected
    answer (length-averaged log-probabilities); TRL names that weight (the paper's lambda) `beta`."""
    for dataset in (train_dataset, eval_dataset):
        if dataset is not None:
            require_columns(dataset, PAIRED_COLUMNS, "ORPO")
    # `max_length` only bounds TRL's own tokenization, which the prepared rows skip.
    config = trl_config(ORPOConfig, args, beta=orpo_alpha, disable_dropout=disable_dropout)
    return trainer_class(
        model=model,
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
