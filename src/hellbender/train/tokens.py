"""Token counters that travel with checkpoints, and the throughput they log."""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from hellbender.train.distributed import reduced_over_processes


class TokenCounter(TrainerCallback, ExportableState):
    """Counts input tokens (no padding) and trained tokens (labels that count towards the loss).

    The trainer adds to it every micro-batch; after each optimizer step the step's counts are summed over all
    training processes, so the totals (and tokens/s) are the whole run's on every process. The counts stay on the
    device until they are read (a log, a save, the end of the run): reading them makes the host wait for the GPU,
    which an ordinary step should not. As an `ExportableState` its totals are saved in each checkpoint's
    trainer_state.json and restored on resume, so counts continue instead of restarting.
    """

    def __init__(self) -> None:
        self._read = [0, 0]  # (input, trained) tokens already read back to the host
        self._unread: torch.Tensor | None = None  # counts of the steps since, summed over processes, on the device
        self._step: torch.Tensor | None = None  # this step's counts on this process so far
        self._window_start_tokens = 0  # input tokens counted before this log interval
        self._window_start = time.perf_counter()

    def add(self, input_tokens: int | torch.Tensor, trained_tokens: int | torch.Tensor) -> None:
        """One micro-batch's counts: ints, or 0-d tensors on the device they were counted on."""
        counts = torch.stack([torch.as_tensor(input_tokens), torch.as_tensor(trained_tokens)]).to(torch.int64)
        self._step = counts if self._step is None else self._step + counts

    def on_step_end(self, args, state, control, **kwargs):
        step = self._step if self._step is not None else torch.zeros(2, dtype=torch.int64)
        step = reduced_over_processes(step)
        # A step that counted nothing adds zeros made on the host (moved once, where a real step's counts are).
        self._unread = step if self._unread is None else self._unread + step.to(self._unread.device)
        self._step = None

    def _read_back(self) -> list[int]:
        if self._unread is not None:
            self._read = [done + int(new) for done, new in zip(self._read, self._unread.tolist(), strict=True)]
            self._unread = None
        return self._read

    @property
    def input_tokens(self) -> int:
        return self._read_back()[0]

    @input_tokens.setter
    def input_tokens(self, value: int) -> None:  # restored from a checkpoint: not throughput of this interval
        self._window_start_tokens += int(value) - self._read_back()[0]
        self._read[0] = int(value)

    @property
    def trained_tokens(self) -> int:
        return self._read_back()[1]

    @trained_tokens.setter
    def trained_tokens(self, value: int) -> None:
        self._read_back()
        self._read[1] = int(value)

    def throughput_logs(self) -> dict[str, float]:
        """Totals plus tokens/s since the previous call (one log interval)."""
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        total = self.input_tokens
        logs = {
            "tokens_per_second": round((total - self._window_start_tokens) / elapsed, 1),
            "input_tokens": total,
            "trained_tokens": self.trained_tokens,
        }
        self._window_start_tokens, self._window_start = total, now
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
