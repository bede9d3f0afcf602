"""`hellbender evaluate` on a distillation config: the two parts of the distillation loss over the evaluation rows,
besides the token metrics. Targets come from the rows (offline) or from the config's teacher (online), as in
training; each part is summed over every trained token of the rows and divided by their number, so the scores do not
depend on how the rows are batched, padded or packed."""

from __future__ import annotations

from typing import Any

import torch

from hellbender.config import HellbenderConfig
from hellbender.data.teacher_targets import TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK
from hellbender.train.distillation_loss import DistillationLoss, distillation_loss

TARGET_KEYS = (TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK)


class DistillationScore:
    """Sums of the KD and cross-entropy parts over the batches `add` is given."""

    def __init__(self, settings: DistillationLoss, teacher: Any = None) -> None:
        self.settings = settings
        self.teacher = teacher  # train/teacher.py's Teacher, or None: the rows carry the targets
        self.kd_sum = 0.0
        self.ce_sum = 0.0

    @classmethod
    def from_config(cls, cfg: HellbenderConfig, tokenizer: Any) -> DistillationScore:
        teacher = None
        if cfg.kd_teacher_model:
            from hellbender.train.teacher import load_teacher

            teacher = load_teacher(cfg, tokenizer)
        return cls(DistillationLoss.from_config(cfg), teacher)

    def add(
        self, logits: torch.Tensor, labels: torch.Tensor, stored: dict[str, torch.Tensor], inputs: dict[str, Any]
    ) -> None:
        """One batch: `logits` [B, T, V] and `labels` [B, T] unshifted; `stored` the batch's targets (offline);
        `inputs` the model's inputs (what an online teacher reads)."""
        targets = self.teacher.targets(inputs) if self.teacher is not None else stored
        if len(targets) != len(TARGET_KEYS):
            raise ValueError("a distillation evaluation batch holds no teacher targets and no teacher is set")
        # Divided by 1: the parts come back as sums over the batch's trained tokens.
        parts = distillation_loss(
            logits, labels, targets[TARGET_IDS], targets[TARGET_LOGPROBS], targets[TARGET_MASK], self.settings, 1
        )
        self.kd_sum += float(parts.kd)
        self.ce_sum += float(parts.ce)

    def metrics(self, tokens: int) -> dict[str, float]:
        """Per trained token: the KD part, the cross-entropy part (each before its weight) and the weighted loss
        training minimises."""
        kd, ce = self.kd_sum / tokens, self.ce_sum / tokens
        return {
            "kd_loss": kd,
            "ce_loss": ce,
            "distillation_loss": self.settings.alpha * kd + self.settings.ce_alpha * ce,
        }
