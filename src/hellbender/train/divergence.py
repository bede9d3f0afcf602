"""Stop a run whose loss, gradients or weights stop being finite numbers, keeping its last good checkpoint.

The Trainer by itself keeps going: it replaces a NaN / inf loss by the running average in its logs
(`logging_nan_inf_filter`), so a run whose weights became NaN ends with exit 0 and a report whose loss seems to
fall. `HellbenderTrainer` checks, at the end of every optimizer step and before anything is logged, evaluated or
saved: the micro-batch losses of the step and the gradient norm (both already computed), and at a save or the last
step the trainable weights. On the first non-finite value the step is neither logged nor saved, training stops, no
final model is written, and the run exits with `DIVERGED_EXIT_CODE` (as the loss watchdog does). Checkpoints saved
before that step keep finite weights and, no newer one being saved, rotation never removes the newest of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

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


def not_finite(value: Any) -> bool:
    """`value` (a tensor, a float or None) holds a NaN or an infinity."""
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        return not bool(torch.isfinite(value.detach()).all())
    return not torch.isfinite(torch.tensor(float(value))).item()


def weights_not_finite(parameters: Iterable[torch.nn.Parameter]) -> bool:
    """Any trainable weight (this process's shard of it, under FSDP) holds a NaN or an infinity."""
    for parameter in parameters:
        if not parameter.requires_grad or parameter.numel() == 0:
            continue
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        if not bool(torch.isfinite(local.detach()).all()):  # checked at saves only: one sync per tensor is cheap there
            return True
    return False


def agreed(flags: list[bool], device: torch.device) -> list[bool]:
    """The flags or-ed over every training process, so that all of them stop at the same step."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flags
    tensor = torch.tensor([int(f) for f in flags], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]
