"""DPO and IPO (`rl: dpo` / `rl: ipo`) on TRL's DPOTrainer, from prepared pairs.

TRL receives the finished model (LoRA / QLoRA adapter or full weights) and the prepared pairs as token ids; it loads,
wraps, quantizes and tokenizes nothing itself. The reference model is the base model with the adapter switched off
(no second copy in memory) or, for full fine-tuning, a frozen copy of the starting weights, or no model at all when
`precompute_ref_log_probs` scores every pair once before training."""

from __future__ import annotations

import logging
from typing import Any

from trl import DPOConfig, DPOTrainer

from hellbender.config import HellbenderConfig
from hellbender.config.preference_checks import dpo_loss_weights, dpo_losses
from hellbender.train.methods.shared import (
    PreferenceMixin,
    build_preference_trainer,
    is_adapter_model,
    reference_model,
    refuse_trained_output_head,
    shared_arguments,
)
from hellbender.train.shared_prompt import use_shared_prompts
from hellbender.train.trainer import HellbenderMixin

logger = logging.getLogger("hellbender")


def arguments(cfg: HellbenderConfig) -> tuple[type[DPOConfig], dict[str, Any]]:
    """DPOConfig and the fields the config sets, beside those every training method shares (`training_arguments`)."""
    return DPOConfig, {
        **shared_arguments(),
        "beta": cfg.rl_beta,
        "loss_type": dpo_losses(cfg),
        "loss_weights": dpo_loss_weights(cfg),
        "label_smoothing": cfg.dpo_label_smoothing or 0.0,
        "use_weighting": bool(cfg.dpo_use_weighting),
        "precompute_ref_log_probs": bool(cfg.precompute_ref_log_probs),
        # Lengths are the data preparation's business (`sequence_len`): TRL must not cut pairs short again.
        "max_length": None,
        "pad_to_multiple_of": None,
    }


class DPOPreferenceTrainer(HellbenderMixin, PreferenceMixin, DPOTrainer):
    """TRL's DPOTrainer with hellbender's run behaviour, on pre-tokenized pairs."""

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        return self.score_reference_in_memory(dataset, batch_size, ("ref_chosen_logps", "ref_rejected_logps"))


TRAINER = DPOPreferenceTrainer  # also built by `hellbender evaluate` (use/evaluate_preference.py)


def build_trainer(
    cfg: HellbenderConfig,
    model: Any,
    args: DPOConfig,
    train_dataset: Any,
    eval_dataset: Any,
    tokenizer: Any,
    data_collator: Any = None,
    **hellbender: Any,
) -> DPOPreferenceTrainer:
    """The DPO trainer for `cfg`, on `model` as built (`build_trainable_model`) and prepared pairs.
    `tokenizer`: the tokenizer, or a vision-language model's processor; `data_collator`: None for TRL's own collator
    of text pairs (`data/preference_collator.py` gives the one of pairs with images). `hellbender`:
    `HellbenderMixin`'s keywords and the Trainer's `callbacks`."""
    refuse_trained_output_head(model)
    trainer = build_preference_trainer(
        TRAINER,
        model,
        args,
        train_dataset,
        eval_dataset,
        tokenizer,
        ref_model=reference_model(cfg, model),
        data_collator=data_collator,
        **hellbender,
    )
    if cfg.dpo_shared_prompt is not False and data_collator is None:  # pairs with images keep TRL's two rows
        share_pair_prompts(trainer, required=bool(cfg.dpo_shared_prompt))
    return trainer


def share_pair_prompts(trainer: DPOPreferenceTrainer, required: bool) -> None:
    """Score each pair with its prompt once (`dpo_shared_prompt`), on the policy and on a separate reference model,
    where the model allows it; the run's log says which layout scores the pairs."""
    policy = trainer.model.get_base_model() if is_adapter_model(trainer.model) else trainer.model
    shared = use_shared_prompts(policy, required)
    if shared and trainer.ref_model is not None:
        use_shared_prompts(trainer.ref_model, required=True)
    logger.info(
        "DPO scores each pair %s (`dpo_shared_prompt`).",
        "in one row that holds its prompt once" if shared else "as two rows, each with the prompt",
    )
