"""SimPO (`rl: simpo`) on TRL's experimental CPOTrainer with `loss_type="simpo"`, from prepared pairs
(`prompt_ids`, `chosen_ids`, `rejected_ids`). No reference model."""

from __future__ import annotations

from collections.abc import Sequence

from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback, TrainingArguments
from trl.experimental.cpo import CPOConfig, CPOTrainer

from hellbender.train.methods.rows import PAIRED_COLUMNS, PreTokenizedPairs, require_columns
from hellbender.train.methods.trl_config import trl_config


class PreTokenizedCPOTrainer(PreTokenizedPairs, CPOTrainer):
    """CPOTrainer on prepared pairs. Its NLL (behaviour-cloning) term already uses the chosen answers' labels,
    which hide the prompt."""


def build_simpo_trainer(
    model: PreTrainedModel,
    args: TrainingArguments,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: Dataset,
    eval_dataset: Dataset | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    *,
    beta: float,
    simpo_gamma: float,
    cpo_alpha: float,
    disable_dropout: bool = True,
    trainer_class: type[PreTokenizedCPOTrainer] = PreTokenizedCPOTrainer,
) -> PreTokenizedCPOTrainer:
    """The SimPO trainer for `model` (a causal LM, or a PeftModel). The loss per batch is the mean of
    -log sigmoid(beta * (mean log-prob of the chosen answer - that of the rejected one) - simpo_gamma), plus
    `cpo_alpha` times the mean NLL of the chosen answers' tokens (0 gives the paper's SimPO; TRL's and Axolotl's
    default is 1.0, CPO-SimPO)."""
    for dataset in (train_dataset, eval_dataset):
        if dataset is not None:
            require_columns(dataset, PAIRED_COLUMNS, "SimPO")
    # `max_length` only bounds TRL's own tokenization, which the prepared rows skip.
    config = trl_config(
        CPOConfig,
        args,
        loss_type="simpo",
        beta=beta,
        simpo_gamma=simpo_gamma,
        cpo_alpha=cpo_alpha,
        disable_dropout=disable_dropout,
    )
    return trainer_class(
        model=model,
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
