"""KTO (`rl: kto`) on TRL's KTOTrainer, from prepared unpaired rows (`prompt_ids`, `completion_ids`, `label`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from accelerate.utils import is_peft_model
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback, TrainingArguments
from trl import KTOConfig, KTOTrainer

from hellbender.train.methods.rows import UNPAIRED_COLUMNS, require_columns
from hellbender.train.methods.trl_config import trl_config


class PreTokenizedKTOTrainer(KTOTrainer):
    """KTOTrainer that takes hellbender's prepared rows as they are: no prompt extraction, no EOS added, no
    tokenization, no truncation."""

    def _prepare_dataset(self, dataset: Dataset, processing_class: Any, args: KTOConfig, dataset_name: str) -> Dataset:
        require_columns(dataset, UNPAIRED_COLUMNS, "KTO")
        if not self.calculate_KL:
            return dataset

        # KTO's KL term scores each prompt with another row's completion: within each micro-batch, row i takes the
        # completion of row i-1 (the collator reads `KL_completion_ids`). TRL builds the pairs this way in its own
        # preparation, which is why the trainer samples the rows in order.
        def rotate_completions(batch: dict[str, list]) -> dict[str, list]:
            completions = batch["completion_ids"]
            return {"KL_completion_ids": completions[-1:] + completions[:-1]}

        return dataset.map(
            rotate_completions,
            batched=True,
            batch_size=args.per_device_train_batch_size,
            desc=f"Pairing KL completions of the {dataset_name} rows",
        )


def build_kto_trainer(
    model: PreTrainedModel,
    args: TrainingArguments,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: Dataset,
    eval_dataset: Dataset | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    *,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
    ref_model: PreTrainedModel | None = None,
    precompute_ref_log_probs: bool = False,
    disable_dropout: bool = True,
    trainer_class: type[PreTokenizedKTOTrainer] = PreTokenizedKTOTrainer,
) -> PreTokenizedKTOTrainer:
    """The KTO trainer for `model` (a causal LM, a PeftModel when an adapter is trained).

    The reference model: with an adapter, the base model with the adapter disabled (`ref_model` must be None);
    with full fine-tuning, `ref_model` (a frozen second copy built like the policy), or none when
    `precompute_ref_log_probs` scores the rows once with the untrained policy before training. `trainer_class`: a
    subclass of `PreTokenizedKTOTrainer` (for example one that mixes in hellbender's trainer behaviours).

    Rows are read in order (TRL pairs each row with its micro-batch neighbour for the KL term), so shuffle when
    preparing the data; a micro-batch needs at least 2 rows.
    """
    adapter = is_peft_model(model)
    if adapter and ref_model is not None:
        raise ValueError(
            "With an adapter the reference is the base model with the adapter disabled: pass no ref_model."
        )
    if not adapter and ref_model is None and (not precompute_ref_log_probs or args.fsdp):
        # TRL would load a second copy itself from the hub id in the model's config, outside hellbender's loading.
        raise ValueError(
            "Full fine-tuning needs a reference model: pass ref_model, or precompute_ref_log_probs=True (not under FSDP)."
        )
    config = trl_config(
        KTOConfig,
        args,
        loss_type="kto",
        beta=beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
        precompute_ref_log_probs=precompute_ref_log_probs,
        disable_dropout=disable_dropout,
        max_length=None,  # the data layer has applied the length limits; the collator must not cut further
        train_sampling_strategy="sequential",  # required by the KL pairing above
    )
    adapters_before = set(model.peft_config) if adapter else set()
    trainer = trainer_class(
        model=model,
        ref_model=ref_model,
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
    if adapter:
        # Given a PeftModel, TRL adds a "ref" adapter copied from the trained one and scores the reference with it.
        # Deleting it makes TRL disable the adapter instead: the reference is the base model, with no second adapter
        # in memory.
        for name in set(trainer.model.peft_config) - adapters_before:
            trainer.model.delete_adapter(name)
    return trainer
