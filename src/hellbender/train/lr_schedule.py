"""The learning-rate schedule beyond transformers' named ones: Axolotl's cosine with a floor
(`cosine_min_lr_ratio`), a hold at the floor (`cosine_constant_lr_ratio`) and quadratic warm-up
(`lr_quadratic_warmup`). A floor alone is transformers' own `cosine_with_min_lr`; the others need a factor of our own,
given to the Trainer as a `LambdaLR`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.train.schedule import Schedule


@dataclass
class CosineFactor:
    """The fraction of the peak learning rate after `step` optimizer steps: warm-up (linear or quadratic) to 1, a
    half cosine down to `floor` reached at `floor_from`, then `floor` to the end. A callable object, not a function,
    so `LambdaLR` stores its fields in the checkpoint's scheduler state."""

    warmup_steps: int
    floor_from: int
    floor: float = 0.0
    quadratic_warmup: bool = False

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            rising = step / self.warmup_steps
            return rising * rising if self.quadratic_warmup else rising
        progress = (min(step, self.floor_from) - self.warmup_steps) / max(1, self.floor_from - self.warmup_steps)
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def needs_own_factor(cfg: HellbenderConfig) -> bool:
    return cfg.lr_scheduler == "cosine" and (cfg.lr_quadratic_warmup or cfg.cosine_constant_lr_ratio is not None)


def own_lr_factor(cfg: HellbenderConfig, schedule: Schedule) -> CosineFactor | None:
    """The factor for a cosine schedule transformers does not name, or None where its own scheduler serves."""
    if not needs_own_factor(cfg):
        return None
    return CosineFactor(
        warmup_steps=schedule.warmup_steps,
        floor_from=schedule.cosine_floor_from,
        floor=cfg.cosine_min_lr_ratio or 0.0,
        quadratic_warmup=cfg.lr_quadratic_warmup,
    )


def scheduler_arguments(cfg: HellbenderConfig) -> dict[str, Any]:
    """`lr_scheduler_type` and `lr_scheduler_kwargs` of TrainingArguments. With a factor of our own the type stays
    `cosine` (the Trainer's scheduler is replaced, and the resolved arguments still say what kind it is)."""
    if cfg.cosine_min_lr_ratio is not None and not needs_own_factor(cfg):
        return {
            "lr_scheduler_type": "cosine_with_min_lr",
            "lr_scheduler_kwargs": {"min_lr_rate": cfg.cosine_min_lr_ratio},
        }
    return {"lr_scheduler_type": cfg.lr_scheduler}
