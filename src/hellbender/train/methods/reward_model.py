"""Bradley-Terry reward models (`reward_model: true`) on TRL's RewardTrainer, from prepared pairs (`prompt_ids`,
`chosen_ids`, `rejected_ids`). The model is a sequence-classification model with one label; the saved output loads
in plain transformers as one (`AutoModelForSequenceClassification`)."""

from __future__ import annotations

from collections.abc import Sequence

from accelerate.utils import is_peft_model
from datasets import Dataset
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback, TrainingArguments
from trl import RewardConfig, RewardTrainer

from hellbender.train.methods.rows import PAIRED_COLUMNS, require_columns
from hellbender.train.methods.trl_config import trl_config

# Where transformers' sequence-classification models keep their head (PEFT's SEQ_CLS task saves these modules).
SCORE_HEADS = ("score", "classifier")


def whole_sequences(dataset: Dataset) -> Dataset:
    """RewardTrainer's pre-tokenized columns: `chosen_ids` and `rejected_ids` as whole sequences, the prompt
    followed by each answer. The reward is read at the last token of each."""
    require_columns(dataset, PAIRED_COLUMNS, "The reward model")
    return dataset.map(
        lambda row: {
            "chosen_ids": row["prompt_ids"] + row["chosen_ids"],
            "rejected_ids": row["prompt_ids"] + row["rejected_ids"],
        },
        remove_columns=["prompt_ids"],
        desc="Joining prompts and answers",
    )


def check_score_head_trained(model: PreTrainedModel) -> None:
    """With an adapter, the randomly initialised score head must be trained and saved in full beside it (PEFT's
    `modules_to_save`, which task_type SEQ_CLS sets up); an adapter without it would train LoRA weights against a
    random head that nothing saves."""
    if not is_peft_model(model):
        return
    base = model.get_base_model()
    heads = [getattr(base, name) for name in SCORE_HEADS if isinstance(getattr(base, name, None), nn.Module)]
    if not heads:
        raise ValueError(f"{type(base).__name__} has no sequence-classification head ({' or '.join(SCORE_HEADS)}).")
    for head in heads:
        saved = getattr(head, "modules_to_save", None) is not None
        if not saved or not any(p.requires_grad for p in head.parameters()):
            raise ValueError(
                "The reward model's score head is not trained with the adapter: create the LoRA config with "
                "task_type='SEQ_CLS' (or put the head in modules_to_save)."
            )


def build_reward_trainer(
    model: PreTrainedModel,
    args: TrainingArguments,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: Dataset,
    eval_dataset: Dataset | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    *,
    disable_dropout: bool = True,
    trainer_class: type[RewardTrainer] = RewardTrainer,
) -> RewardTrainer:
    """The reward-model trainer for `model`: a sequence-classification model with `num_labels=1` (or a PeftModel of
    one, task_type SEQ_CLS). The loss is -log sigmoid(r(chosen) - r(rejected)); TRL sets the model config's
    `pad_token_id` from the tokenizer, which is how the model finds the last real token of each sequence."""
    check_score_head_trained(model)
    config = trl_config(
        RewardConfig,
        args,
        disable_dropout=disable_dropout,
        max_length=None,  # the data layer has applied the length limits; TRL must not drop rows
    )
    return trainer_class(
        model=model,
        args=config,
        train_dataset=whole_sequences(train_dataset),
        eval_dataset=whole_sequences(eval_dataset) if eval_dataset is not None else None,
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
