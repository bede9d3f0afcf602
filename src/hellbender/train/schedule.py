"""Defaults that depend on the prepared data: steps per epoch, save / eval / log intervals, warm-up."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hellbender.config import HellbenderConfig


@dataclass(frozen=True)
class Schedule:
    total_steps: int
    steps_per_epoch: int | None
    save_steps: int | None
    eval_steps: int | None
    logging_steps: int
    warmup_steps: int


def plan_schedule(cfg: HellbenderConfig, train_rows: int | None, world_size: int = 1) -> Schedule:
    """`train_rows` is the number of training rows (packed bins with packing), None for streamed data."""
    steps_per_epoch = None
    if train_rows is not None:
        batches = math.ceil(train_rows / (cfg.micro_batch_size * world_size))
        steps_per_epoch = max(1, batches // cfg.gradient_accumulation_steps)
    total = cfg.max_steps or math.ceil(steps_per_epoch * cfg.num_epochs)

    def per_epoch(count: int | None) -> int | None:
        return max(1, steps_per_epoch // count) if count and steps_per_epoch else None

    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else math.ceil(total * (cfg.warmup_ratio or 0.0))
    return Schedule(
        total_steps=total,
        steps_per_epoch=steps_per_epoch,
        save_steps=cfg.save_steps or per_epoch(cfg.saves_per_epoch),
        eval_steps=cfg.eval_steps or per_epoch(cfg.evals_per_epoch),
        logging_steps=cfg.logging_steps or max(1, min(10, total // 10)),
        warmup_steps=warmup,
    )
