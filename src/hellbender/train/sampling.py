"""The order of the training rows: shuffled (the Trainer's default), in dataset order (`curriculum_sampling`), or
grouped by length (`group_by_length`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from transformers.trainer_pt_utils import LengthGroupedSampler

from hellbender.config import HellbenderConfig


def sampling_strategy(cfg: HellbenderConfig) -> str:
    """transformers' `train_sampling_strategy` for the config."""
    if cfg.curriculum_sampling:
        return "sequential"
    return "group_by_length" if cfg.group_by_length else "random"


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """transformers' length-grouped sampler with its shuffle drawn from `seed + epoch` rather than the global random
    state: every process draws the same order, and a resumed run the order of the uninterrupted one."""

    def __init__(self, batch_size: int, lengths: Sequence[int], seed: int) -> None:
        super().__init__(batch_size, lengths=list(lengths), generator=torch.Generator())
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # called by the Trainer (through accelerate) before every epoch
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.generator.manual_seed(self.seed + self.epoch)
        return super().__iter__()
