"""Stop a run whose loss, gradients or weights stop being finite numbers, keeping its last good checkpoint.

The Trainer by itself keeps going: it replaces a NaN / inf loss by the running average in its logs
(`logging_nan_inf_filter`), so a run whose weights became NaN ends with exit 0 and a report whose loss seems to
fall. `HellbenderTrainer` flags every micro-batch loss and every step's gradient norm (both already computed) and, at a
save or the last step, checks the trainable weights. On the first non-finite value training stops before anything
later is logged, evaluated or saved, no final model is written, and the run exits with `DIVERGED_EXIT_CODE` (as the
loss watchdog does). Checkpoints saved before that step keep finite weights and, no newer one being saved, rotation
never removes the newest of them.

Reading a flag makes the host wait for the GPU (`StepFlags` says how that wait is kept off ordinary steps).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hellbender.train.distributed import reduced_over_processes

# What went non-finite, by the bit the processes agree on (a bitwise-or over processes as a max of each bit).
WHAT = ("loss", "gradient norm", "weights")


@dataclass
class Divergence:
    """Where and how a run stopped being finite (set once; `step` None while it is finite)."""

    step: int | None = None
    what: str | None = None
    last_good_checkpoint: str | None = None

    def record(self, step: int, flags: list[bool], last_good_checkpoint: str | None) -> None:
        self.step = step
        names = [name for name, flag in zip(WHAT, flags, strict=True) if flag]
        self.what = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        self.last_good_checkpoint = last_good_checkpoint

    def message(self) -> str:
        kept = (
            f"`{self.last_good_checkpoint}` (the newest checkpoint, saved with finite weights) is kept"
            if self.last_good_checkpoint
            else "no checkpoint had been saved yet"
        )
        resume = (
            "; then resume from it with `auto_resume_from_checkpoints: true` (these keys may change on resume)"
            if self.last_good_checkpoint
            else ""
        )
        return (
            f"Training diverged at step {self.step}: the {self.what} became NaN or infinite. The run stopped without "
            f"logging or saving that step and wrote no final model; {kept}. Lower `learning_rate`, raise "
            f"`warmup_steps`, set `max_grad_norm`, or check the data for broken rows{resume}."
        )


def not_finite_flag(value: Any, device: torch.device) -> torch.Tensor:
    """A 0-d bool tensor on `value`'s device (`device` for a float or None): true where `value` holds a NaN or an
    infinity. Computed where the value is, so nothing waits for the GPU."""
    if hasattr(value, "full_tensor"):  # a DTensor (FSDP2's gradient norm): the whole value, reduced on the device
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):
        return ~torch.isfinite(value.detach()).all()
    return torch.full((), value is not None and not math.isfinite(float(value)), dtype=torch.bool, device=device)


class StepFlags:
    """Whether each optimizer step's loss and gradient norm are finite, read back without stalling the GPU.

    Reading a GPU value makes the host wait until the GPU has run everything queued before it; the GPU then idles
    while the host queues the next kernels. So each step's flags are copied to the host as soon as they are computed,
    and an ordinary step waits only for the previous step's copy (the GPU runs this step's kernels meanwhile). A step
    that logs, evaluates, saves or ends the run waits for its own: a non-finite step is never logged or saved, and
    is found at most one step late otherwise. The flags are or-ed over the processes on the device, so every process
    reads the same ones at the same steps.
    """

    def __init__(self) -> None:
        self._loss: torch.Tensor | None = None  # this step's micro-batch losses so far
        self._pending: list[tuple[int, torch.Tensor, torch.cuda.Event | None]] = []  # (step, flags on the host, copied)

    def add_loss(self, loss: torch.Tensor) -> None:
        flag = not_finite_flag(loss, loss.device)
        self._loss = flag if self._loss is None else self._loss | flag

    def end_step(self, step: int, grad_norm: Any, device: torch.device) -> None:
        loss = self._loss if self._loss is not None else not_finite_flag(None, device)
        flags = torch.stack([loss.to(device), not_finite_flag(grad_norm, device).to(device)]).to(torch.int32)
        self._loss = None
        flags = reduced_over_processes(flags, "max")  # or-ed over the processes
        event = None
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flags = host
        self._pending.append((step, flags, event))

    def first_not_finite(self, including_newest: bool) -> tuple[int, list[bool]] | None:
        """The earliest step read back whose (loss, gradient norm) flags are not both finite. Reads every step
        recorded, or all but the newest (whose copy the GPU may not have reached)."""
        ready = self._pending if including_newest else self._pending[:-1]
        self._pending = self._pending[len(ready) :]
        for step, host, event in ready:
            if event is not None:
                event.synchronize()
            flags = [bool(v) for v in host.tolist()]
            if any(flags):
                self._pending = []
                return step, flags
        return None


def weights_not_finite(parameters: Iterable[torch.nn.Parameter]) -> bool:
    """Any trainable weight (this process's shard of it, under FSDP) holds a NaN or an infinity."""
    for parameter in parameters:
        if not parameter.requires_grad or parameter.numel() == 0:
            continue
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        if not bool(torch.isfinite(local.detach()).all()):  # checked at saves only: one sync per tensor is cheap there
            return True
    return False


def agreed(flags: list[bool]) -> list[bool]:
    """The flags or-ed over every training process, so that all of them stop at the same step."""
    return [bool(v) for v in reduced_over_processes(torch.tensor([int(f) for f in flags]), "max").tolist()]
