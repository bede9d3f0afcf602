"""SIGTERM / SIGINT during training: save a checkpoint at the end of the current step, then stop.

Preempted machines get SIGTERM and a grace period; Ctrl-C sends SIGINT. Either way the run finishes the optimizer
step it is in, saves `checkpoint-N` (complete, with its manifest) and stops, so `auto_resume_from_checkpoints`
continues exactly there. A second signal stops at once, as without hellbender.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger("hellbender")
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal(TrainerCallback):
    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self.stopped_at_step: int | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # the second signal: stop now
            self._restore()
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum)
        logger.warning(
            "Received %s: saving a checkpoint at the end of this step, then stopping (send it again to stop now).",
            self.received.name,
        )

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread
            self._previous = {s: signal.signal(s, self._handle) for s in HANDLED_SIGNALS}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.received is not None and self.stopped_at_step is None:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at_step = state.global_step

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._restore()

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process stopped by a signal: 128 + its number."""
        return 128 + int(self.received) if self.received is not None else 0
