"""Token counters that travel with checkpoints, and the throughput they log."""

from __future__ import annotations

import time

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from hellbender.train.distributed import sum_over_processes


class TokenCounter(TrainerCallback, ExportableState):
    """Counts input tokens (no padding) and trained tokens (labels that count towards the loss).

    The trainer adds to it every micro-batch; after each optimizer step the step's counts are summed over all
    training processes, so the totals (and tokens/s) are the whole run's on every process. As an
    `ExportableState` its totals are saved in each checkpoint's trainer_state.json and restored on resume, so
    counts continue instead of restarting.
    """

    def __init__(self) -> None:
        self.input_tokens = 0
        self.trained_tokens = 0
        self._step_input = 0
        self._step_trained = 0
        self._window_tokens = 0
        self._window_start = time.perf_counter()

    def add(self, input_tokens: int, trained_tokens: int) -> None:
        self._step_input += input_tokens
        self._step_trained += trained_tokens

    def on_step_end(self, args, state, control, **kwargs):
        step_input, step_trained = sum_over_processes([self._step_input, self._step_trained])
        self.input_tokens += step_input
        self.trained_tokens += step_trained
        self._window_tokens += step_input
        self._step_input = self._step_trained = 0

    def throughput_logs(self) -> dict[str, float]:
        """Totals plus tokens/s since the previous call (one log interval)."""
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        logs = {
            "tokens_per_second": round(self._window_tokens / elapsed, 1),
            "input_tokens": self.input_tokens,
            "trained_tokens": self.trained_tokens,
        }
        self._window_tokens, self._window_start = 0, now
        return logs

    def state(self) -> dict:
        return {"args": {}, "attributes": {"input_tokens": self.input_tokens, "trained_tokens": self.trained_tokens}}


class StreamPosition(TrainerCallback, ExportableState):
    """How many rows of a streamed multimodal dataset training has consumed, saved in every checkpoint so a
    resumed run starts at the next unseen row instead of replaying (and re-loading the images of) the rest."""

    def __init__(self) -> None:
        self.rows_consumed = 0

    def advance(self, last_row: int) -> None:
        self.rows_consumed = max(self.rows_consumed, last_row + 1)

    def state(self) -> dict:
        return {"args": {}, "attributes": {"rows_consumed": self.rows_consumed}}
