"""The run's precision: the one rule that turns `bf16` / `fp16` into the dtype the model is loaded and trained in.

`bf16: auto` is decided on the machine that runs: bfloat16 where a CUDA GPU supports it, otherwise float16 when
`fp16: true`, otherwise float32. Everything that needs the precision (loading, QLoRA's compute dtype, the Trainer's
mixed-precision flags, DeepSpeed's `bf16.enabled`, FSDP2's norm policy, `validate`'s note) asks here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from hellbender.config.machine import Machine, this_machine

if TYPE_CHECKING:
    from hellbender.config.schema import HellbenderConfig

Precision = Literal["bf16", "fp16", "fp32"]


def run_precision(cfg: HellbenderConfig, machine: Machine | None = None) -> Precision:
    """The precision a run of `cfg` uses on `machine` (default: this one)."""
    if cfg.bf16 is True:
        return "bf16"
    if cfg.bf16 == "auto" and (machine or this_machine()).bf16:
        return "bf16"
    return "fp16" if cfg.fp16 else "fp32"


def precision_known_without_the_machine(cfg: HellbenderConfig) -> tuple[bool | None, bool | None]:
    """(bf16 on, fp16 on) as far as the config alone decides them; None where `bf16: auto` leaves it to the GPU."""
    if cfg.bf16 == "auto":
        return None, (False if not cfg.fp16 else None)
    return bool(cfg.bf16), bool(cfg.fp16) and not cfg.bf16


def torch_dtype(cfg: HellbenderConfig, machine: Machine | None = None) -> Any:
    """`run_precision` as a torch dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[run_precision(cfg, machine)]
