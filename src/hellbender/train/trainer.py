"""The transformers Trainer, with hellbender's run behaviour (`HellbenderMixin`: run identity checks before saves, a
stop on a non-finite loss or gradient, the atomic final save, own learning-rate schedules, exact RNG restore, step
lines on the console, throughput logs) shared by every training method, and supervised fine-tuning's loss, token
counting and packed attention (`HellbenderTrainer`)."""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import Trainer
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.trainer_callback import ProgressCallback

from hellbender.data.collator import REAL_TOKENS_KEY, forward_kwargs
from hellbender.data.formats.base import IGNORE_INDEX
from hellbender.data.streaming import STREAM_ROW_KEY
from hellbender.models.activation_checkpointing import side_channel_of
from hellbender.models.packed_attention import packed_attention_mask, text_config
from hellbender.models.packed_vision import packed_vision_inputs
from hellbender.models.pixel_dtype import pixels_in_model_dtype
from hellbender.models.router_aux_loss import router_aux_coefficient
from hellbender.models.split_attention import SPLIT_ATTENTION, splitting_rows
from hellbender.storage import FINAL_MANIFEST, complete_checkpoints, listed_files, move_files_into, write_manifest
from hellbender.train.console import StepLines
from hellbender.train.divergence import Divergence, StepFlags, agreed, weights_not_finite
from hellbender.train.row_split import split_rows
from hellbender.train.run_identity import RunIdentity, check_still_owner
from hellbender.train.sampling import EpochSeededLengthGroupedSampler
from hellbender.train.tokens import StreamPosition, TokenCounter

FINAL_STAGING = ".final-model-staging"
# Files of a final model of the other kind (adapter or whole model) that a new final save supersedes even when no
# older manifest lists them: left in place, loaders of `output_dir` would pick up a stale adapter or model.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
MODEL_FILE_PREFIXES = ("model.safetensors", "model-", "pytorch_model", "config.json", "generation_config.json")


def causal_lm_loss(
    outputs: Any,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
):
    """Next-token cross-entropy summed over trained tokens and divided by the trained tokens of the whole
    accumulated batch. Given to the Trainer as `compute_loss_func` so gradient accumulation is exact for every
    model: several vision-language models (Gemma 4, Qwen2.5-VL) declare `accepts_loss_kwargs = False`, and the
    Trainer would then average each micro-batch on its own. `shift_labels`: each position's next token, shifted
    before the row was split (context parallelism: a process's slice of the row does not hold the token after
    its last one)."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    # ForCausalLMLoss flattens with `view`; some models return a strided slice (ProphetNet: the main stream of its
    # n-gram logits), which `view` refuses. A no-op for contiguous logits.
    logits = logits.contiguous()
    if shift_labels is not None:
        shift_labels = shift_labels.contiguous()  # flattened with `view` too
    return ForCausalLMLoss(
        logits, labels, logits.shape[-1], num_items_in_batch=num_items_in_batch, shift_labels=shift_labels
    )


def with_router_aux_loss(loss_func: Callable[..., torch.Tensor], coefficient: float) -> Callable[..., torch.Tensor]:
    """`loss_func` plus `coefficient x` the router's auxiliary loss the model returned (`aux_loss`). The model adds
    that term only to a loss it computes itself from labels, and a `compute_loss_func` takes the labels away from
    it. Added before the Trainer's own scaling, so the term is weighted as in the model's own loss."""

    def loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None, **kwargs: Any):
        value = loss_func(outputs, labels, num_items_in_batch=num_items_in_batch, **kwargs)
        aux = outputs.get("aux_loss") if isinstance(outputs, dict) else None
        return value if aux is None else value + coefficient * aux.to(value.device)

    return loss


class HellbenderMixin:
    """What every hellbender trainer does, whatever its loss: put before the transformers / TRL trainer class it
    extends (`class X(HellbenderMixin, Trainer)`)."""

    def __init__(
        self,
        *args: Any,
        lr_factor: Callable[[int], float] | None = None,
        run: RunIdentity | None = None,
        divergence: Divergence | None = None,
        **kwargs: Any,
    ) -> None:
        """`lr_factor`: the learning rate's fraction of its peak after each step, for schedules transformers does not
        name. `run`: the identity of this run (main process), recorded in the final manifest and checked before each
        save. `divergence`: filled in when the run stops on a non-finite loss, gradient or weight."""
        self._lr_factor = lr_factor
        self.run = run
        self.divergence = divergence if divergence is not None else Divergence()
        self._step_flags = StepFlags()
        super().__init__(*args, **kwargs)
        self._rng_checkpoint: str | None = None
        if self.pop_callback(ProgressCallback) is not None:  # present unless the progress bar is disabled
            self.add_callback(StepLines)

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        if self._lr_factor is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        self.lr_scheduler = LambdaLR(optimizer or self.optimizer, self._lr_factor)
        self._created_lr_scheduler = True  # the Trainer's flag: it then steps the scheduler it created
        return self.lr_scheduler

    def _callback(self, cls: type) -> Any:
        # Looked up each time: on resume the Trainer replaces callbacks with restored copies.
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, cls):
                return callback
        return None

    def restore_rng_before_first_step(self, checkpoint) -> None:
        """Reload the checkpoint's RNG state just before the first step of a resumed run. Needed when the data
        resumes itself (the Trainer skips no batches): the Trainer then restores the RNG before the data
        iterator is created, and creating it draws from the RNG, so dropout would differ from the
        uninterrupted run."""
        self._rng_checkpoint = str(checkpoint)

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None):
        if self._rng_checkpoint:
            self._load_rng_state(self._rng_checkpoint)  # transformers' own restore, same files and order
            self._rng_checkpoint = None
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_flags.add_loss(loss)
        channel = side_channel_of(self.model)
        if channel is not None:  # backward is done: nothing routed around a checkpoint outlives the step
            channel.clear()
        return loss

    def _maybe_log_save_evaluate(
        self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, *a, **kw
    ):
        """At the end of each optimizer step: stop on a non-finite loss, gradient norm or (before a save or at the
        last step) weight, before anything from that step on is logged, evaluated or saved (`StepFlags`)."""
        if self.divergence.step is None:
            control = self.control
            decide_now = any(
                (control.should_log, control.should_evaluate, control.should_save, control.should_training_stop)
            )
            self._step_flags.end_step(self.state.global_step, grad_norm, self.args.device)
            found = self._step_flags.first_not_finite(including_newest=decide_now)
            if found is not None:
                step, flags = found[0], [*found[1], False]
            else:
                check_weights = control.should_save or control.should_training_stop
                weights = check_weights and agreed([weights_not_finite(self.model.parameters())])[0]
                step, flags = self.state.global_step, [False, False, weights]
            if any(flags):
                newest = complete_checkpoints(self.args.output_dir)
                self.divergence.record(step, flags, str(newest[-1]) if newest else None)
        if self.divergence.step is not None:
            self.control.should_log = self.control.should_evaluate = self.control.should_save = False
            self.control.should_training_stop = True
            tr_loss.zero_()  # the summary's mean loss then counts only the steps logged before
            return
        super()._maybe_log_save_evaluate(
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, *a, **kw
        )

    def _save_checkpoint(self, model, trial) -> None:
        """Before the Trainer writes `checkpoint-N`: this run must still own `output_dir`, and a `checkpoint-N` left
        by an earlier attempt of this run (resumed from an older step) goes first, so no stale file of it is listed
        in the new manifest."""
        if self.run is not None and self.args.should_save:
            check_still_owner(Path(self.args.output_dir), self.run)
            stale = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
            if stale.exists():
                (stale / "hellbender_checkpoint.json").unlink(missing_ok=True)  # untrusted from the first deletion
                shutil.rmtree(stale)
        super()._save_checkpoint(model, trial)

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if self.args.train_sampling_strategy == "group_by_length" and "length" in getattr(dataset, "column_names", ()):
            return EpochSeededLengthGroupedSampler(
                self.args.train_batch_size * self.args.gradient_accumulation_steps,
                list(dataset["length"]),
                self.args.seed,
            )
        return super()._get_train_sampler(train_dataset)

    def token_counter(self) -> TokenCounter:
        return self._callback(TokenCounter)

    def save_final_model(self, output_dir: str) -> None:
        """The trained model (or adapter), its tokenizer/processor and trainer_state.json (with the counters as they
        are now: the Trainer records callback states only in checkpoints), saved into `output_dir` so that a kill
        never leaves a part: everything is written to a staging directory, moved in file by file, and
        `hellbender_model.json` (the file list, as for checkpoints) is written last."""
        for cls in (TokenCounter, StreamPosition):
            callback = self._callback(cls)
            if callback is not None:
                self.state.stateful_callbacks[cls.__name__] = callback.state()
        final = Path(output_dir)
        staging = final / FINAL_STAGING
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
        if self.is_fsdp_enabled:
            # Always one whole model, whatever `state_dict_type` the checkpoints use. Every process takes part in
            # gathering the shards; the main process writes.
            state_dict = self.accelerator.get_state_dict(self.model)
            if self.args.should_save:
                self._save(str(staging), state_dict=state_dict)
        else:
            self.save_model(str(staging))
        if self.args.should_save:
            if self.run is not None:
                check_still_owner(final, self.run)
            self.state.save_to_json(str(staging / "trainer_state.json"))
            write_manifest(staging, FINAL_MANIFEST, run=self.run.record() if self.run is not None else None)
            move_files_into(staging, final, FINAL_MANIFEST, remove=superseded_outputs(final, staging))
        self.accelerator.wait_for_everyone()  # no process returns before the final model is in place

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # training logs, not evaluation or the final summary
            logs.update(self.token_counter().throughput_logs())
        if self.divergence.step is not None:  # the summary's mean loss counts the diverged step as a logged one
            logs.pop("train_loss", None)
        super().log(logs, start_time)


class HellbenderTrainer(HellbenderMixin, Trainer):
    """Supervised fine-tuning and continued pretraining: next-token cross-entropy on the trained tokens."""

    def __init__(self, *args: Any, fused_loss: bool = False, **kwargs: Any) -> None:
        """`fused_loss`: the model computes its loss itself without logits (Liger's fused linear cross-entropy);
        it is then given the accumulated batch's trained-token count, so accumulation stays exact.
        `compute_loss_func` (a keyword of the Trainer): a loss in place of `causal_lm_loss` (`use_eaft`'s), with the
        same arguments and reduction. The other keywords are `HellbenderMixin`'s and the Trainer's."""
        if fused_loss and kwargs.get("compute_loss_func") is not None:
            raise ValueError("a fused loss computes no logits, so no `compute_loss_func` can be used with it")
        if not fused_loss:
            kwargs.setdefault("compute_loss_func", causal_lm_loss)
        super().__init__(*args, **kwargs)
        if fused_loss:
            # The Trainer passes `num_items_in_batch` to models that declare they accept loss kwargs; Liger's fused
            # forwards take it for every family, including those whose stock forward declares they do not.
            self.model_accepts_loss_kwargs = True
        # A mixture-of-experts model with `output_router_logits` on returns its router's load-balancing loss; the
        # fused loss is the model's own, which already holds it, so only hellbender's cross-entropy needs it added.
        self.router_aux_coefficient = router_aux_coefficient(self.model.config)
        if self.router_aux_coefficient is not None and self.compute_loss_func is not None:
            self.compute_loss_func = with_router_aux_loss(self.compute_loss_func, self.router_aux_coefficient)
        self._router_aux: torch.Tensor | None = None  # summed over the micro-batches since the last log
        self._router_aux_batches = 0

    def compute_loss(self, model, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch=None):
        real_tokens = inputs.pop(REAL_TOKENS_KEY, None)
        stream_rows = inputs.pop(STREAM_ROW_KEY, None)
        # Context parallelism: the Trainer has cut the row into this process's slice, its next tokens shifted first.
        shift_labels = inputs.pop("shift_labels", None)
        if model.training and real_tokens is not None:
            if shift_labels is None:
                real, trained = real_tokens.sum(), (inputs["labels"][..., 1:] != IGNORE_INDEX).sum()
            else:  # this slice's counts: the token counter sums them over the processes
                # Packed rows carry no padding mask; `row_split` counted the slice's real tokens instead.
                real = inputs["attention_mask"].sum() if "attention_mask" in inputs else real_tokens.sum()
                trained = (shift_labels != IGNORE_INDEX).sum()
            self.token_counter().add(real, trained)  # tensors: counting waits for nothing
        if model.training and stream_rows is not None:
            self._callback(StreamPosition).advance(int(stream_rows.max()))
        inputs.update(forward_kwargs(inputs))
        inputs.update(packed_attention_mask(model, inputs))
        inputs.update(packed_vision_inputs(model, inputs))
        inputs.update(pixels_in_model_dtype(model, inputs))
        with self._labels_of_slice(shift_labels):
            if self.router_aux_coefficient is None:
                return super().compute_loss(
                    model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                )
            loss, outputs = super().compute_loss(
                model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
        aux = outputs.get("aux_loss") if isinstance(outputs, dict) else None
        if model.training and aux is not None:
            aux = aux.detach().float()
            self._router_aux = aux if self._router_aux is None else self._router_aux + aux
            self._router_aux_batches += 1
        return (loss, outputs) if return_outputs else loss

    def _prepare_context_parallel_inputs(self, model, inputs: dict[str, Any]) -> tuple[Callable, dict[str, Any]]:
        """Context parallelism over packed rows: this process's share of the rows, cut here, and the split its
        attention reads (`models/split_attention.py`); padded rows under SDPA go to the Trainer's ring attention."""
        if text_config(model)._attn_implementation != SPLIT_ATTENTION:
            return super()._prepare_context_parallel_inputs(model, inputs)
        mesh = self.accelerator.torch_device_mesh["cp"]
        inputs, split = split_rows(inputs, mesh.get_group(), mesh.size(), mesh.get_local_rank())
        return functools.partial(splitting_rows, split), inputs

    @contextlib.contextmanager
    def _labels_of_slice(self, shift_labels: torch.Tensor | None) -> Iterator[None]:
        """Context parallelism: the loss function gets the slice's next tokens, shifted before the row was cut."""
        if shift_labels is None:
            yield
            return
        loss_func = self.compute_loss_func
        self.compute_loss_func = functools.partial(loss_func, shift_labels=shift_labels)
        try:
            yield
        finally:
            self.compute_loss_func = loss_func

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._router_aux is not None:  # a training log: every process is here
            mean = self.accelerator.gather(self._router_aux[None]).mean() / self._router_aux_batches
            logs["aux_loss"] = round(float(mean), 6)  # before its weight, the mean over the micro-batches
            self._router_aux, self._router_aux_batches = None, 0
        super().log(logs, start_time)


def superseded_outputs(final: Path, staging: Path) -> list[str]:
    """Top-level names in `final` that the final model in `staging` replaces without overwriting: what the previous
    final manifest listed and the new model lacks, and files of the other kind (an adapter beside a whole model)."""
    new = {path.name for path in staging.iterdir()}
    old = {name.split("/")[0] for name in listed_files(final, FINAL_MANIFEST)}
    if "adapter_config.json" in new:
        other = {p.name for p in final.iterdir() if p.is_file() and p.name.startswith(MODEL_FILE_PREFIXES)}
    else:
        other = {name for name in ADAPTER_FILES if (final / name).exists()}
    return sorted((old | other) - new)
