"""Bradley-Terry reward models (`reward_model: true`) on TRL's RewardTrainer, from prepared pairs. The model is a
sequence-classification model with one label (models/loading.py); the saved output loads in plain transformers as
one (`AutoModelForSequenceClassification`), or through PEFT for a LoRA adapter with its trained score head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from trl import RewardConfig, RewardTrainer

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError
from hellbender.train.methods.shared import (
    PreferenceMixin,
    build_preference_trainer,
    is_adapter_model,
    shared_arguments,
)
from hellbender.train.trainer import HellbenderMixin

# Where transformers' sequence-classification models keep their head (PEFT's SEQ_CLS task saves these modules).
SCORE_HEADS = ("score", "classifier")


def arguments(cfg: HellbenderConfig) -> tuple[type[RewardConfig], dict[str, Any]]:
    # The data preparation has applied the length limits; TRL must not drop rows.
    return RewardConfig, {
        **shared_arguments(),
        "max_length": None,
        "center_rewards_coefficient": cfg.center_rewards_coefficient,
    }


def check_score_head_trained(model: Any) -> None:
    """With an adapter, the randomly initialised score head must be trained and saved in full beside it (PEFT's
    `modules_to_save`, which task_type SEQ_CLS sets up); an adapter without it would train LoRA weights against a
    random head that nothing saves."""
    if not is_adapter_model(model):
        return
    base = model.get_base_model()
    heads = [getattr(base, name) for name in SCORE_HEADS if isinstance(getattr(base, name, None), nn.Module)]
    if not heads:
        raise ConfigError(
            f"`reward_model: true`: {type(base).__name__} has no sequence-classification head "
            f"({' or '.join(SCORE_HEADS)}). Use a model family transformers offers for sequence classification."
        )
    for head in heads:
        saved = getattr(head, "modules_to_save", None) is not None
        if not saved or not any(p.requires_grad for p in head.parameters()):
            raise ConfigError(
                "`reward_model: true` with an adapter: the score head is not trained and saved with the "
                "adapter (PEFT's sequence-classification task keeps it in `modules_to_save`), so LoRA would learn "
                "against a random head that nothing saves. Train all weights (remove `adapter`)."
            )


class RewardModelTrainer(HellbenderMixin, PreferenceMixin, RewardTrainer):
    """TRL's RewardTrainer with hellbender's run behaviour, on prepared pairs: the loss is
    -log sigmoid(r(chosen) - r(rejected)), each reward read at the last real token of its sequence (the model
    config's `pad_token_id`, which TRL sets from the tokenizer, marks where the padding starts)."""

    def _method_columns(self, dataset: Any, args: RewardConfig, dataset_name: str) -> Any:
        """RewardTrainer's pre-tokenized columns: `chosen_ids` and `rejected_ids` as whole sequences, the prompt
        followed by each answer."""
        return dataset.map(
            lambda row: {
                "chosen_ids": row["prompt_ids"] + row["chosen_ids"],
                "rejected_ids": row["prompt_ids"] + row["rejected_ids"],
            },
            remove_columns=["prompt_ids"],
            desc=f"Joining prompts and answers of the {dataset_name} pairs",
        )

    def batch_tokens(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen and rejected sequences are read whole: every real token is an input and a trained one."""
        real = inputs["attention_mask"].sum()
        return real, real


TRAINER = RewardModelTrainer  # also built by `hellbender evaluate` (use/evaluate_preference.py)


def build_trainer(
    cfg: HellbenderConfig,
    model: Any,
    args: RewardConfig,
    train_dataset: Any,
    eval_dataset: Any,
    tokenizer: Any,
    **hellbender: Any,
) -> RewardModelTrainer:
    check_score_head_trained(model)
    return build_preference_trainer(TRAINER, model, args, train_dataset, eval_dataset, tokenizer, **hellbender)
