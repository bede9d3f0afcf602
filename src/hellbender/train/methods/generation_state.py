"""Exact resume of online RL (GRPO, RLOO) in a new process. TRL's online trainers generate once per
`steps_per_generation` x `num_iterations` micro-steps and train the following micro-steps on the buffered
completions; they count micro-steps in `_step` and keep the buffer in memory only. A checkpoint taken between two
generations (`num_iterations` > 1) would resume with `_step` at 0 and no buffer: the resumed run would generate again,
from the updated model, where the uninterrupted one trained on the buffered completions. Here each process saves its
buffer into the checkpoint when one is in use, and resume restores both."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("hellbender")
BUFFER_FILE = "generation_buffer_{}.pt"  # one per process: each holds the completions of its own prompts


class GenerationStateMixin:
    """Put before TRL's GRPOTrainer or RLOOTrainer (after `HellbenderMixin`, whose `_save_checkpoint` clears a stale
    checkpoint directory first)."""

    def _generation_in_progress(self) -> bool:
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self._buffered_inputs is not None and self._step % generate_every != 0

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self._generation_in_progress():
            folder = Path(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            torch.save(self._buffered_inputs, folder / BUFFER_FILE.format(self.args.process_index))
        # The main process lists the checkpoint's files next (its manifest): every process's buffer is written.
        self.accelerator.wait_for_everyone()

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            self._restore_generation(Path(resume_from_checkpoint))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _restore_generation(self, checkpoint: Path) -> None:
        """The micro-step count where the checkpoint was taken and, between two generations, the buffered
        completions the next micro-steps train on."""
        global_step = json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
        self._step = global_step * self.args.gradient_accumulation_steps
        buffer = checkpoint / BUFFER_FILE.format(self.args.process_index)
        if buffer.is_file():
            self._buffered_inputs = torch.load(buffer, map_location=self.args.device, weights_only=True)
        elif self._step % (self.args.steps_per_generation * self.num_iterations):
            logger.warning(
                "%s was saved between two generations (`trl.num_iterations: %d`) without their completions: the "
                "next steps train on new ones, so they differ from an uninterrupted run.",
                checkpoint,
                self.num_iterations,
            )
