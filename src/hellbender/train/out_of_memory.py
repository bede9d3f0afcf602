"""The error for a training step that runs out of GPU memory: one paragraph naming the step, the budget the run was
planned for and what to change, in place of the allocator's traceback."""

from __future__ import annotations

from hellbender.config import HellbenderConfig
from hellbender.errors import UserError
from hellbender.plan.budget import shown_limit
from hellbender.plan.memory import GIB


class OutOfGpuMemory(UserError):
    """Training needed more GPU memory than the card had."""


def out_of_memory_error(cfg: HellbenderConfig, step: int) -> OutOfGpuMemory:
    import torch

    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0
    planned = (
        f"the run was planned to fit `gpu_memory_limit: {shown_limit(cfg.gpu_memory_limit)}`"
        if cfg.gpu_memory_limit is not None
        else "no `gpu_memory_limit` was planned for"
    )
    return OutOfGpuMemory(
        f"Training ran out of GPU memory at step {step} ({planned}; the run had allocated up to {peak:.1f} GiB). "
        "Checkpoint more layers (`gradient_checkpointing_layers`), lower `micro_batch_size`, or let the planner choose "
        "them (`auto`, with `gpu_memory_limit` set to what the card may use); `hellbender plan CONFIG` prints the "
        "predicted peak and its parts. Another process on the same GPU, or allocator settings other than "
        "hellbender's default (`PYTORCH_CUDA_ALLOC_CONF`), can leave less than planned."
    )
