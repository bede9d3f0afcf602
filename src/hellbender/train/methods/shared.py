"""What every preference trainer shares, whatever TRL trainer it extends: the model as hellbender built it (its own
activation checkpointing, the adapter's dtype, no second adapter as the reference), the prepared rows passed through
after a check of their columns, token counting, and no telemetry. A method's trainer is
`class X(HellbenderMixin, PreferenceMixin, TRLTrainer)`."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError
from hellbender.models.activation_checkpointing import CHANNEL_ATTRIBUTE, OFFLOADER_ATTRIBUTE

# The columns of prepared pairs: prompt token ids, and the chosen and rejected answers' token ids that continue the
# prompt exactly. KTO's unpaired rows: one answer per row and whether it is desirable.
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
UNPAIRED_COLUMNS = ("prompt_ids", "completion_ids", "label")
# The name under which TRL adds a copy of the adapter as the reference; hellbender removes it (see below).
REFERENCE_ADAPTER = "ref"


def is_adapter_model(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def reference_model(cfg: HellbenderConfig, model: Any) -> Any | None:
    """The model TRL scores the reference log-probabilities with (DPO, KTO): None with an adapter (TRL then switches
    the adapter off) or with `precompute_ref_log_probs` (TRL scores the rows with the untrained model before the first
    step); otherwise a frozen copy of the starting weights, which shares no tensor or per-model state with the
    policy."""
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


class PausableCheckpointing:
    """The switches TRL turns activation checkpointing off and on with (around generation and each reference pass),
    bound to one model as hellbender set up its checkpointing. Off clears the flag of each decoder layer that
    checkpoints and remembers those layers; on sets exactly those flags again. hellbender's checkpoint function (and
    its per-layer choices) is never replaced, where transformers' own `gradient_checkpointing_enable` would give
    every layer its default function.

    Off must really be off: `generate` runs with the policy in training mode, and transformers (up to at least 5.17)
    then sends every decoder layer with the flag set through the checkpoint function and drops its KV cache, so each
    new token is computed without the earlier ones: slower, and the completions are not the model's."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.paused: list[Any] = []

    def disable(self, *args: Any, **kwargs: Any) -> None:
        switched = [m for m in self.model.modules() if getattr(m, "gradient_checkpointing", False) is True]
        for module in switched:
            module.gradient_checkpointing = False
        self.paused.extend(switched)

    def enable(self, *args: Any, **kwargs: Any) -> None:
        """Arguments (TRL passes its `gradient_checkpointing_kwargs`) are ignored: hellbender's function stays."""
        for module in self.paused:
            module.gradient_checkpointing = True
        self.paused.clear()


CHECKPOINTING_SWITCHES = (
    ("gradient_checkpointing_disable", "gradient_checkpointing_enable"),
    # transformers' newer names for the same switches.
    ("activation_checkpointing_disable", "activation_checkpointing_enable"),
)


def keep_own_checkpointing(model: Any) -> None:
    """TRL switches transformers' activation checkpointing off around generation and each reference pass and on
    again after them; on again would replace hellbender's checkpoint function (and its per-layer choices) on every
    layer. On this model instance the switches pause and resume hellbender's checkpointing instead
    (`PausableCheckpointing`), so training checkpoints exactly as `build_trainable_model` set it up."""
    base = model.get_base_model() if is_adapter_model(model) else model
    switches = PausableCheckpointing(base)
    for target in {id(model): model, id(base): base}.values():
        for disable, enable in CHECKPOINTING_SWITCHES:
            if hasattr(target, disable):
                setattr(target, disable, switches.disable)
                setattr(target, enable, switches.enable)


def refuse_trained_output_head(model: Any) -> None:
    """DPO and KTO compute log-probabilities from the output embedding's weight directly, so a trained copy of it
    (`lora_modules_to_save: [lm_head]`) would never be used nor learn."""
    from peft.utils.other import AuxiliaryTrainingWrapper

    head = model.get_output_embeddings()
    if isinstance(head, AuxiliaryTrainingWrapper):
        raise ConfigError(
            "`lora_modules_to_save` names the output embedding (lm_head): this preference method scores answers with "
            "the output embedding's own weight, so its trained copy would never be used. Remove it from "
            "`lora_modules_to_save` (or train all weights without `adapter`)."
        )


def check_columns(dataset: Any, columns: tuple[str, ...], dataset_name: str) -> None:
    present = getattr(dataset, "column_names", None) or []
    missing = [c for c in columns if c not in present]
    if missing:
        kind = (
            "unpaired rows (prompt ids, completion ids, label)"
            if "label" in columns
            else "prompt rows (a `prompt` column)"
            if columns == ("prompt",)
            else "pairs (prompt ids, chosen ids, rejected ids)"
        )
        raise ConfigError(
            f"The {dataset_name} data has no column {', '.join(f'`{c}`' for c in missing)}: this method trains on "
            f"prepared {kind}. Use a preference dataset `type:` (docs/preference.md), or remove `rl` / `reward_model`."
        )


def shared_arguments() -> dict[str, Any]:
    """The TRL config fields every method sets the same way, beside those of every training method
    (`training_arguments`)."""
    from transformers import TrainingArguments

    # transformers renamed `gradient_checkpointing` to `activation_checkpointing` (the old name then warns on every
    # run); the installed version's name is used.
    checkpointing = (
        "activation_checkpointing"
        if "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}
        else "gradient_checkpointing"
    )
    return {
        # hellbender checkpoints activations itself (models/stack.py); TRL's default would switch transformers' own
        # checkpointing on over it.
        checkpointing: False,
        # The dropout the config asks for (`lora_dropout`, the model's own) applies as in supervised fine-tuning.
        "disable_dropout": False,
    }


def build_preference_trainer(
    trainer_class: type, model: Any, args: Any, train_dataset: Any, eval_dataset: Any, tokenizer: Any, **keywords: Any
) -> Any:
    """A method's trainer class on `model` (as `build_trainable_model` built it, or a trained one for `hellbender
    evaluate`) and the prepared rows. `tokenizer`: the tokenizer, or a vision-language model's processor. `keywords`:
    what only some methods take (the reference model `ref_model`, a `data_collator`), `HellbenderMixin`'s keywords and
    the Trainer's `callbacks`."""
    return trainer_class(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        **keywords,
    )


class PreferenceMixin:
    """Put between `HellbenderMixin` and the TRL trainer. `columns`: the prepared columns the method reads."""

    columns: tuple[str, ...] = PAIR_COLUMNS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        for name in ("train_dataset", "eval_dataset"):
            if kwargs.get(name) is not None:
                check_columns(kwargs[name], self.columns, name.split("_")[0])
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

    def score_reference_in_memory(self, dataset: Any, batch_size: int, columns: tuple[str, ...]) -> Any:
        """The reference's log-probabilities of every row (`precompute_ref_log_probs`), scored once by the TRL
        trainer's `compute_ref_log_probs` (one tensor per column) and added as columns, in memory.

        TRL would also write them as an Arrow file beside the dataset's own files, which are hellbender's
        prepared-data cache, and read that file back in any later run whose weights hash the same, though
        precision (`bf16` autocast), attention or kernels change the scores. They are never written here: a few
        numbers per row are scored again each run."""
        import torch
        from torch.utils.data import DataLoader

        self._drop_reference_adapter()  # TRL scores the rows inside its own __init__, before it returns to ours
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            shuffle=False,
        )
        scored: dict[str, list[Any]] = {column: [] for column in columns}
        for batch in self.accelerator.prepare(loader):  # each process scores its share; all gather every score
            scores = self.compute_ref_log_probs(self.ref_model or self.model, batch)
            scores = self.accelerator.gather_for_metrics(tuple(scores[: len(columns)]))
            for column, values in zip(scored, scores, strict=True):
                scored[column].append(values.float().cpu())
        for column, values in scored.items():
            dataset = dataset.add_column(column, torch.cat(values).tolist())
        return dataset

    def _send_telemetry(self) -> None:
        """No usage report leaves the machine from a hellbender run."""

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        """The rows are tokenized already (data preparation): passed through, with what the method adds to them
        (`_method_columns`)."""
        return self._method_columns(dataset, args, dataset_name)

    def _method_columns(self, dataset: Any, args: Any, dataset_name: str) -> Any:
        return dataset

    def batch_tokens(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input tokens, trained tokens) of a collated batch, as tensors where the batch is: every row's real
        tokens, and its answer tokens (the scored ones, never the prompt)."""
        return inputs["attention_mask"].sum(), inputs["completion_mask"].sum()

    def compute_loss(self, model, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch=None):
        if model.training:
            self.token_counter().add(*self.batch_tokens(inputs))
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
