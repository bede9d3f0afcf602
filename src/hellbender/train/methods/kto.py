"""KTO (`rl: kto`) on TRL's KTOTrainer, from prepared unpaired rows (`prompt_ids`, `completion_ids`, `label`).

The reference model is DPO's: the base with the adapter switched off, or a frozen copy of the starting weights."""

from __future__ import annotations

from typing import Any

from trl import KTOConfig, KTOTrainer

from hellbender.config import HellbenderConfig
from hellbender.train.methods.shared import (
    UNPAIRED_COLUMNS,
    PreferenceMixin,
    build_preference_trainer,
    reference_model,
    refuse_trained_output_head,
    shared_arguments,
)
from hellbender.train.trainer import HellbenderMixin


def arguments(cfg: HellbenderConfig) -> tuple[type[KTOConfig], dict[str, Any]]:
    return KTOConfig, {
        **shared_arguments(),
        "loss_type": "kto",
        "beta": cfg.rl_beta,
        "desirable_weight": cfg.kto_desirable_weight,
        "undesirable_weight": cfg.kto_undesirable_weight,
        "precompute_ref_log_probs": bool(cfg.precompute_ref_log_probs),
        "max_length": None,  # the data preparation has applied the length limits; the collator must not cut further
        "train_sampling_strategy": "sequential",  # TRL's KL pairing below needs the rows in their prepared order
    }


class KTOPreferenceTrainer(HellbenderMixin, PreferenceMixin, KTOTrainer):
    """TRL's KTOTrainer with hellbender's run behaviour, on prepared unpaired rows."""

    columns = UNPAIRED_COLUMNS

    def _method_columns(self, dataset: Any, args: KTOConfig, dataset_name: str) -> Any:
        """KTO's KL term scores each prompt with another row's completion: within each micro-batch, row i takes the
        completion of row i-1 (the collator reads `KL_completion_ids`), which is why TRL reads the rows in order. The
        training rows are shuffled once, with the run's seed, so that neighbours are unrelated rows whatever the
        order of the files (a file that lists each prompt's desirable answer next to its undesirable one would
        otherwise pair a prompt with its own other answer)."""
        if dataset_name == "train":
            dataset = dataset.shuffle(seed=args.data_seed if args.data_seed is not None else args.seed)
            dataset = dataset.flatten_indices()
        if not self.calculate_KL:
            return dataset

        def rotate_completions(batch: dict[str, list]) -> dict[str, list]:
            completions = batch["completion_ids"]
            return {"KL_completion_ids": completions[-1:] + completions[:-1]}

        return dataset.map(
            rotate_completions,
            batched=True,
            batch_size=args.per_device_train_batch_size,
            desc=f"Pairing KL completions of the {dataset_name} rows",
        )

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """Each row's reference score, and its KL completion's when the KL term is on (rows in their paired order:
        `_method_columns` has run)."""
        columns = ("ref_logps", "ref_KL_logps") if self.calculate_KL else ("ref_logps",)
        return self.score_reference_in_memory(dataset, batch_size, columns)


TRAINER = KTOPreferenceTrainer  # also built by `hellbender evaluate` (use/evaluate_preference.py)


def build_trainer(
    cfg: HellbenderConfig,
    model: Any,
    args: KTOConfig,
    train_dataset: Any,
    eval_dataset: Any,
    tokenizer: Any,
    **hellbender: Any,
) -> KTOPreferenceTrainer:
    refuse_trained_output_head(model)
    return build_preference_trainer(
        TRAINER,
        model,
        args,
        train_dataset,
        eval_dataset,
        tokenizer,
        ref_model=reference_model(cfg, model),
        **hellbender,
    )
