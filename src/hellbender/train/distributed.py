"""The few things hellbender itself does differently when several processes train together (torchrun,
`hellbender train --nproc N`): one process prepares what all of them read, and counters are summed over all.

The process group is the one accelerate sets up from torchrun's environment (`WORLD_SIZE`, `RANK`, ...); the
Trainer uses the same one for DDP.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def one_gpu_for_one_process() -> str | None:
    """A process that no launcher started sees every GPU of the machine, and the transformers Trainer would then
    wrap the model in `nn.DataParallel`, which splits each batch over the GPUs (packed rows' masks, images and their
    tokens no longer line up, and the loss is averaged per GPU). Before CUDA starts, such a process is given the
    first GPU only; returns the notice saying so, or None when there is nothing to restrict."""
    if "WORLD_SIZE" in os.environ:
        return None  # torchrun / `--nproc` / Ray gave this process its own GPU
    import torch

    count = torch.cuda.device_count()  # read from NVML: CUDA is not started, so the restriction still applies
    if count < 2 or torch.cuda.is_initialized():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = visible.split(",")[0].strip() if visible else "0"
    os.environ["CUDA_VISIBLE_DEVICES"] = first
    return (
        f"This machine has {count} GPUs and one training process, which trains on GPU {first} only (one process per "
        f"GPU: `--nproc {count}` trains on all of them with DDP)."
    )


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


@contextmanager
def main_process_first() -> Iterator[None]:
    """The main process runs the block first (preparing and caching data, building a tiny model, tidying
    `output_dir`); the others wait for it and then run it too, finding its results in place."""
    if world_size() == 1:
        yield
        return
    with process_state().main_process_first():
        yield


def process_state():
    """accelerate's process state, created from torchrun's environment on first use. Without a GPU the processes
    talk over gloo, which accelerate sets up only when told it runs on CPU (as `TrainingArguments(use_cpu=True)`
    tells it, which `training_arguments` then passes)."""
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def runs_on_cpu_processes() -> bool:
    import torch

    return world_size() > 1 and not torch.cuda.is_available()


def reduced_over_processes(values: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`values` reduced element-wise over all processes, by `op` ("sum" or "max"; every process must call this at the
    same point). Under NCCL the reduction is queued on the GPU's stream and its result stays there: the host does not
    wait for it."""
    import torch
    import torch.distributed as dist

    if world_size() == 1 or not dist.is_initialized():
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    reduced = values.to(device, copy=True)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return reduced


def close_process_group() -> None:
    """Every process waits for the others, then the process group is closed. Called once a process has nothing
    left to do with the others: a process that exits with the group open can be torn down while a peer still talks
    to it, which kills that peer (torch asks for `destroy_process_group` before exit)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
