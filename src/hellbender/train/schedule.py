"""Defaults that depend on the prepared data: steps per epoch, save / eval / log intervals, warm-up."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError


@dataclass(frozen=True)
class Schedule:
    total_steps: int
    steps_per_epoch: int | None
    save_steps: int
    eval_steps: int  # used only when there is evaluation data
    logging_steps: int
    warmup_steps: int
    cosine_floor_from: int  # the step where the cosine reaches its floor (the last step unless held earlier)


def plan_schedule(cfg: HellbenderConfig, train_rows: int | None, world_size: int = 1) -> Schedule:
    """`train_rows` is the number of training rows (packed bins with packing), None for streamed data."""
    steps_per_epoch = None
    if train_rows is not None:
        batches = math.ceil(train_rows / (cfg.micro_batch_size * world_size))
        # A last, shorter accumulation still makes a step, as in transformers: every row is trained each epoch.
        steps_per_epoch = math.ceil(batches / cfg.gradient_accumulation_steps)
    total = cfg.max_steps or math.ceil(steps_per_epoch * cfg.num_epochs)

    def interval(steps: int | None, per_epoch: int | None) -> int:
        """An explicit step interval, else `per_epoch` times an epoch (once by default). Streamed data has no epochs:
        the whole run (`max_steps`) counts as one, as in Axolotl, and the default is every tenth of it."""
        if steps:
            return steps
        if steps_per_epoch is None:
            return max(1, total // (per_epoch or 10))
        return max(1, steps_per_epoch // (per_epoch or 1))

    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else math.ceil(total * (cfg.warmup_ratio or 0.0))
    floor_from = total
    if cfg.cosine_constant_lr_ratio is not None:
        floor_from = int(total * cfg.cosine_constant_lr_ratio)  # rounded down, as in Axolotl
        if floor_from <= warmup:
            raise ConfigError(
                f"`cosine_constant_lr_ratio: {cfg.cosine_constant_lr_ratio}` holds the learning rate from step "
                f"{floor_from} of {total}, which is not after the {warmup} warm-up steps, so the cosine has no step to "
                "decay in. Raise `cosine_constant_lr_ratio`, or shorten the warm-up."
            )
    save_steps, eval_steps = (
        interval(cfg.save_steps, cfg.saves_per_epoch),
        interval(cfg.eval_steps, cfg.evals_per_epoch),
    )
    if cfg.early_stopping_patience is not None and save_steps % eval_steps:
        # The best checkpoint is kept and loaded at the end, so each checkpoint must follow an evaluation.
        raise ConfigError(
            f"`early_stopping_patience` needs every checkpoint to follow an evaluation, and this run would save every "
            f"{save_steps} steps and evaluate every {eval_steps}"
            + (f" ({steps_per_epoch} steps per epoch)" if steps_per_epoch else "")
            + f". Set `save_steps` to a multiple of `eval_steps` (e.g. `eval_steps: "
            f"{eval_steps}`, `save_steps: {eval_steps * max(1, save_steps // eval_steps)}`)."
        )
    return Schedule(
        total_steps=total,
        steps_per_epoch=steps_per_epoch,
        save_steps=save_steps,
        eval_steps=eval_steps,
        logging_steps=cfg.logging_steps or max(1, min(10, total // 10)),
        warmup_steps=warmup,
        cosine_floor_from=floor_from,
    )
