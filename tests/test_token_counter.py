"""The token counter: counts added as tensors, summed per step, read back only when a log or a save asks."""

from __future__ import annotations

import pytest
import torch

from hellbender.train import tokens
from hellbender.train.tokens import TokenCounter


def test_counts_are_summed_per_step_and_a_restored_total_is_not_throughput(monkeypatch: pytest.MonkeyPatch):
    clock = iter([10.0, 12.0, 14.0])  # the counter's creation, then one log after 2 s and another 2 s later
    monkeypatch.setattr(tokens.time, "perf_counter", lambda: next(clock))
    counter = TokenCounter()
    counter.input_tokens, counter.trained_tokens = 1000, 400  # as the Trainer restores them from a checkpoint
    counter.add(torch.tensor(8), torch.tensor(3))
    counter.add(torch.tensor(6), torch.tensor(2))
    counter.on_step_end(None, None, None)
    counter.add(torch.tensor(10), torch.tensor(5))  # a step still running: not counted yet
    assert counter.throughput_logs() == {"tokens_per_second": 7.0, "input_tokens": 1014, "trained_tokens": 405}
    counter.on_step_end(None, None, None)
    assert counter.throughput_logs() == {"tokens_per_second": 5.0, "input_tokens": 1024, "trained_tokens": 410}
    assert counter.state()["attributes"] == {"input_tokens": 1024, "trained_tokens": 410}
