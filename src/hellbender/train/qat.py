"""`qat.fake_quant_after_n_steps`: the first N optimizer steps train without fake quantization, the rest with it."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from hellbender.models.qat import set_fake_quantization

logger = logging.getLogger("hellbender")


class FakeQuantAfterSteps(TrainerCallback):
    """Before each step: fake quantization is on from step `after` (counted in optimizer steps, as `max_steps` is).
    Decided from the step number alone, so a resumed run switches it as the uninterrupted run did."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.enabled: bool | None = None  # as last set; None before the first step

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        enabled = state.global_step >= self.after
        if enabled == self.enabled:
            return
        if not set_fake_quantization(model, enabled):
            raise RuntimeError("qat.fake_quant_after_n_steps: the model has no fake-quantized layer to switch")
        if enabled:
            logger.info("qat: fake quantization on from step %d", state.global_step)
        else:
            logger.info("qat: fake quantization off until step %d", self.after)
        self.enabled = enabled
