"""`loss_watchdog_threshold` / `loss_watchdog_patience`: stop a run whose training loss has broken down.

When the logged training loss stays above the threshold for `patience` logged steps in a row, the run saves a
checkpoint at that step and stops without writing a final model (a diverged model is not a result); the message
says where it stopped and what to change. Every process sees the same logged loss (the Trainer averages it over the
processes), so all of them stop at the same step.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger("hellbender")
# The process exit code of a run stopped by the watchdog (a user error is 2, a signal 128 + its number).
DIVERGED_EXIT_CODE = 3


class LossWatchdog(TrainerCallback):
    def __init__(self, threshold: float, patience: int) -> None:
        self.threshold = threshold
        self.patience = patience
        self.high_in_a_row = 0
        self.stopped_at_step: int | None = None
        self.last_loss: float | None = None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs or self.stopped_at_step is not None:
            return
        loss = float(logs["loss"])
        self.high_in_a_row = self.high_in_a_row + 1 if loss > self.threshold else 0
        if self.high_in_a_row >= self.patience:
            self.last_loss = loss
            self.stopped_at_step = state.global_step
            control.should_save = True  # the Trainer saves after logging, in the same step
            control.should_training_stop = True

    def message(self) -> str:
        return (
            f"The training loss stayed above `loss_watchdog_threshold: {self.threshold:g}` for {self.patience} logged "
            f"steps in a row (last {self.last_loss:.4g}, at step {self.stopped_at_step}): training has broken down, so "
            f"the run stopped, saved checkpoint-{self.stopped_at_step} and wrote no final model. Lower "
            "`learning_rate` (or raise `warmup_steps`), check the data, or raise the threshold."
        )
