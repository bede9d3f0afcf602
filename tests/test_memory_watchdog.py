"""The memory watchdog flags steady growth from step to step and stays quiet on a clean run. It watches
malloc's allocated memory on CPU and allocated memory on a GPU, so the injected leak lives where the watchdog looks."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from transformers import TrainerCallback

from hellbender.config import validate_config
from hellbender.train.memory_watchdog import MemoryLeak, fit_line
from hellbender.train.run import train
from tests.helpers import base_config

LEAK_BYTES = 4 * 1024 * 1024


class LeakEveryStep(TrainerCallback):
    """Keeps a new 4 MiB tensor alive after every step: the kind of reference that outlives its step."""

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.kept.append(torch.ones(LEAK_BYTES // 4, device=self.device))


def test_fit_line_gives_slope_and_fit():
    slope, fit = fit_line([1, 2, 3, 4], [10, 12, 14, 16])
    assert slope == pytest.approx(2.0) and fit == pytest.approx(1.0)
    assert fit_line([1, 2, 3, 4], [5, 5, 5, 5]) == (0.0, 0.0)
    _, noisy = fit_line([1, 2, 3, 4, 5, 6], [0, 3, 0, 3, 0, 3])
    assert noisy < 0.5


def test_a_leak_is_stopped_within_ten_steps_naming_its_growth(tmp_path):
    cfg = validate_config(base_config(tmp_path, max_steps=30, memory_watchdog="error", save_steps=1000))
    leak = LeakEveryStep()
    with pytest.raises(MemoryLeak) as caught:
        train(cfg, callbacks=[leak])
    message = str(caught.value)
    step = int(re.search(r"at step (\d+)", message).group(1))
    growth = float(re.search(r"grows by ([\d.]+) MiB per step", message).group(1))
    assert step <= 10 and len(leak.kept) in (step - 1, step)  # the training stopped there
    assert 3.5 <= growth <= 4.5  # the injected 4 MiB per step
    assert "runs out around step" in message and "activation checkpointing" in message
    assert "held by the allocator" in message


def test_a_clean_run_of_100_steps_raises_no_alarm(tmp_path, caplog):
    cfg = validate_config(
        base_config(
            tmp_path, max_steps=100, sample_packing=True, memory_watchdog="error", save_steps=1000, logging_steps=50
        )
    )
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        train(cfg)
    assert not [r for r in caplog.records if "Memory grows" in r.getMessage()]


def test_warn_mode_logs_and_lets_the_run_finish(tmp_path, caplog):
    cfg = validate_config(base_config(tmp_path, max_steps=12, save_steps=1000))
    assert cfg.memory_watchdog == "warn"  # on by default
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        train(cfg, callbacks=[LeakEveryStep()])
    warnings = [r.getMessage() for r in caplog.records if "Memory grows" in r.getMessage()]
    assert len(warnings) == 1
