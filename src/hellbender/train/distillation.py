"""Knowledge distillation's trainer (`kd_trainer`): supervised fine-tuning whose loss is `train/distillation_loss.py`,
with the teacher's targets taken from the batch (offline: prepared with the rows) or from a teacher model (online:
`kd_teacher_model`). The two parts of the loss are logged as `kd_loss` and `ce_loss` (each before its weight), which
the run report plots. With `fused` (`kd_fused_loss`) the student's forward stops at its last hidden states and the loss
projects them a chunk at a time (`train/fused_distillation_loss.py`)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from hellbender.data.teacher_targets import TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK
from hellbender.models.output_head import chunked_head
from hellbender.train.distillation_loss import DistillationLoss, distillation_loss
from hellbender.train.fused_distillation_loss import fused_distillation_loss
from hellbender.train.teacher import Teacher
from hellbender.train.trainer import HellbenderTrainer

TARGET_KEYS = (TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK)
LOGGED_PARTS = ("kd_loss", "ce_loss")


def fused_distillation(cfg: Any) -> bool:
    """`kd_fused_loss`, or unset: on where it pays, when training on a GPU (the logits it never builds would take
    [tokens x vocabulary] floats of GPU memory), unless the config rules it out."""
    from hellbender.config.distillation_checks import fused_loss_blocker

    if cfg.kd_fused_loss is not None:
        return cfg.kd_fused_loss
    return torch.cuda.is_available() and fused_loss_blocker(cfg) is None


class DistillationTrainer(HellbenderTrainer):
    def __init__(
        self,
        *args: Any,
        distillation: DistillationLoss,
        teacher: Teacher | None = None,
        fused: bool = False,
        fused_required: bool = False,
        **kwargs: Any,
    ):
        """`distillation`: the loss settings; `teacher`: the online teacher, or None when batches carry targets;
        `fused`: the chunked loss from the last hidden states where the model allows it (`fused_required`: or a
        ConfigError). The other keywords are `HellbenderTrainer`'s."""
        self.distillation = distillation
        self.teacher = teacher
        self._targets: dict[str, torch.Tensor] | None = None
        self._parts: torch.Tensor | None = None  # (kd, ce) summed over the micro-batches since the last log
        self._parts_since_step: int | None = None
        super().__init__(*args, compute_loss_func=self._loss, **kwargs)
        self.head = chunked_head(self.model, "the student", "kd_fused_loss", fused_required) if fused else None

    def compute_loss(self, model, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch=None):
        stored = {key: inputs.pop(key) for key in TARGET_KEYS if key in inputs}
        self._targets = self.teacher.targets(inputs) if self.teacher is not None else stored
        if len(self._targets) != len(TARGET_KEYS):
            raise ValueError("a distillation batch holds no teacher targets and no teacher is set")
        try:
            with self.head.capturing() if self.head is not None else nullcontext():
                return super().compute_loss(
                    model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                )
        finally:
            self._targets = None

    def _loss(self, outputs: Any, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        targets = [self._targets[key] for key in TARGET_KEYS]
        if self.head is None:
            parts = distillation_loss(logits, labels, *targets, self.distillation, num_items_in_batch)
        else:  # `logits` are the last position's only; the loss projects the hidden states itself
            hidden = self.head.hidden_states()
            parts = fused_distillation_loss(self.head, hidden, labels, *targets, self.distillation, num_items_in_batch)
        if self.model.training:
            both = torch.stack([parts.kd, parts.ce]).float()
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                both = both * self.accelerator.num_processes  # as the Trainer scales the loss itself
            self._parts = both if self._parts is None else self._parts + both
            if self._parts_since_step is None:
                self._parts_since_step = self.state.global_step
        return parts.loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._parts is not None:  # a training log: every process is here
            steps = max(self.state.global_step - (self._parts_since_step or 0), 1)
            mean = self.accelerator.gather(self._parts[None]).mean(0) / steps
            logs.update({name: round(float(value), 4) for name, value in zip(LOGGED_PARTS, mean, strict=True)})
            self._parts, self._parts_since_step = None, None
        super().log(logs, start_time)
