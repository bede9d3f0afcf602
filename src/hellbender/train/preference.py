"""Preference tuning (`rl: dpo` / `rl: ipo`): the config bound to TRL's DPOTrainer, on the model hellbender builds.

TRL receives the finished model (LoRA / QLoRA adapter or full weights) and the prepared pairs as token ids; it loads,
wraps, quantizes and tokenizes nothing itself. The reference model is the base model with the adapter switched off
(no second copy in memory) or, for full fine-tuning, a frozen copy of the starting weights, or no model at all when
`precompute_ref_log_probs` scores every pair once before training."""

from __future__ import annotations

import copy
from typing import Any

from trl import DPOConfig, DPOTrainer

from hellbender.config import HellbenderConfig
from hellbender.config.preference_checks import dpo_loss_weights, dpo_losses
from hellbender.errors import ConfigError
from hellbender.models.activation_checkpointing import CHANNEL_ATTRIBUTE, OFFLOADER_ATTRIBUTE
from hellbender.train.trainer import HellbenderMixin

# The columns of a prepared preference dataset: prompt token ids, and the chosen and rejected answers' token ids that
# continue the prompt exactly (TRL's `DataCollatorForPreference` reads these).
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
# The name under which TRL adds a copy of the adapter as the reference; hellbender removes it (see below).
REFERENCE_ADAPTER = "ref"


def dpo_arguments(cfg: HellbenderConfig) -> dict[str, Any]:
    """The DPOConfig fields the config sets, beside those every training method shares (`training_arguments`)."""
    return {
        "beta": cfg.rl_beta,
        "loss_type": dpo_losses(cfg),
        "loss_weights": dpo_loss_weights(cfg),
        "label_smoothing": cfg.dpo_label_smoothing or 0.0,
        "use_weighting": bool(cfg.dpo_use_weighting),
        "precompute_ref_log_probs": bool(cfg.precompute_ref_log_probs),
        # hellbender checkpoints activations itself (models/stack.py); TRL's default would switch transformers' own
        # checkpointing on over it.
        "gradient_checkpointing": False,
        # The dropout the config asks for (`lora_dropout`, the model's own) applies as in supervised fine-tuning.
        "disable_dropout": False,
        # Lengths are the data preparation's business (`sequence_len`): TRL must not cut pairs short again.
        "max_length": None,
        "pad_to_multiple_of": None,
    }


def is_adapter_model(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def reference_model(cfg: HellbenderConfig, model: Any) -> Any | None:
    """The model TRL scores the reference log-probabilities with: None with an adapter (TRL then switches the adapter
    off) or with `precompute_ref_log_probs` (TRL scores the pairs with the untrained model before the first step);
    otherwise a frozen copy of the starting weights, which shares no tensor or per-model state with the policy."""
    if is_adapter_model(model) or cfg.precompute_ref_log_probs:
        return None
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    # The copy would otherwise keep the policy's checkpoint function, whose side channel belongs to the policy.
    for module in reference.modules():
        if getattr(module, "gradient_checkpointing", False):
            module.gradient_checkpointing = False
    for attribute in (CHANNEL_ATTRIBUTE, OFFLOADER_ATTRIBUTE):
        reference.__dict__.pop(attribute, None)
    return reference.eval()


def keep_own_checkpointing(model: Any) -> None:
    """TRL switches transformers' activation checkpointing off around each reference pass and on again after it,
    which would replace hellbender's checkpoint function (and its per-layer choices) on every layer. On this model
    instance the two switches do nothing: checkpointing stays as `build_trainable_model` set it, and a layer called
    without gradients (the reference pass) saves nothing to recompute anyway."""
    base = model.get_base_model() if is_adapter_model(model) else model

    def unchanged(*args: Any, **kwargs: Any) -> None:
        return None

    for target in {id(model): model, id(base): base}.values():
        target.gradient_checkpointing_disable = unchanged
        target.gradient_checkpointing_enable = unchanged


class PreferenceTrainer(HellbenderMixin, DPOTrainer):
    """TRL's DPOTrainer with hellbender's run behaviour, on pre-tokenized pairs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        _refuse_trained_output_head(model)
        keep_own_checkpointing(model)
        # TRL casts trainable weights of a quantized base to bfloat16; the adapter keeps the dtype hellbender chose.
        chosen_dtypes = {name: p.dtype for name, p in model.named_parameters() if p.requires_grad}
        super().__init__(*args, **kwargs)
        self._drop_reference_adapter()
        for name, parameter in self.model.named_parameters():
            if name in chosen_dtypes and parameter.dtype != chosen_dtypes[name]:
                parameter.data = parameter.data.to(chosen_dtypes[name])

    def _drop_reference_adapter(self) -> None:
        """TRL gives a PEFT model a frozen copy of its adapter as the reference. Here the adapter is always new, so
        the reference is the base model itself: the copy is removed, and TRL then scores the reference with the
        adapter switched off (no second adapter in memory, nor in the saved checkpoints)."""
        if is_adapter_model(self.model) and REFERENCE_ADAPTER in self.model.peft_config:
            self.model.delete_adapter(REFERENCE_ADAPTER)

    def _send_telemetry(self) -> None:
        """No usage report leaves the machine from a hellbender run."""

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        """The pairs are tokenized already (data preparation): passed through as they are, after checking that
        they are pairs."""
        columns = getattr(dataset, "column_names", None) or []
        missing = [c for c in PAIR_COLUMNS if c not in columns]
        if missing:
            raise ConfigError(
                f"The {dataset_name} data for `rl` has no column {', '.join(f'`{c}`' for c in missing)}: preference "
                "tuning trains on prepared pairs (prompt ids, chosen ids, rejected ids). Use a preference dataset "
                "`type:` (docs/preference.md), or remove `rl`."
            )
        return dataset

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        self._drop_reference_adapter()  # TRL scores the pairs inside its own __init__, before it returns to ours
        return super()._precompute_ref_logps(dataset, name, batch_size)

    def compute_loss(self, model, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch=None):
        if model.training:
            # Chosen and rejected rows both run; the answer tokens (scored, never the prompt) are the trained ones.
            input_tokens = int(inputs["attention_mask"].sum())
            self.token_counter().add(input_tokens, int(inputs["completion_mask"].sum()))
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


def _refuse_trained_output_head(model: Any) -> None:
    """TRL computes log-probabilities from the output embedding's weight directly, so a trained copy of it
    (`lora_modules_to_save: [lm_head]`) would never be used nor learn."""
    from peft.utils.other import AuxiliaryTrainingWrapper

    head = model.get_output_embeddings()
    if isinstance(head, AuxiliaryTrainingWrapper):
        raise ConfigError(
            "`lora_modules_to_save` names the output embedding (lm_head): preference tuning scores answers with the "
            "output embedding's own weight, so its trained copy would never be used. Remove it from "
            "`lora_modules_to_save` (or train all weights without `adapter`)."
        )


def build_preference_trainer(
    cfg: HellbenderConfig,
    model: Any,
    args: DPOConfig,
    train_dataset: Any,
    eval_dataset: Any,
    tokenizer: Any,
    data_collator: Any = None,
    **hellbender: Any,
) -> PreferenceTrainer:
    """The preference trainer for `cfg`, on `model` as built (`build_trainable_model`) and prepared pairs.
    `tokenizer`: the tokenizer, or a vision-language model's processor; `data_collator`: None for TRL's own
    collator of text pairs (`data/preference_collator.py` gives the one of pairs with images).
    `hellbender`: `HellbenderMixin`'s keywords and the Trainer's `callbacks`."""
    if not isinstance(args, DPOConfig):
        raise TypeError("preference tuning needs DPOConfig arguments: training_arguments(..., DPOConfig, ...)")
    return PreferenceTrainer(
        model=model,
        ref_model=reference_model(cfg, model),
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_collator,
        **hellbender,
    )
