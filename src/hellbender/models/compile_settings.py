"""The compiler settings a run asks for, held while it trains: `activation_memory_budget`.

The budget is read where torch's partitioner splits a compiled graph into forward and backward, which happens at a
compiled layer's first call (and at each recompile), inside the training loop. Holding the setting for the whole of
`train` covers every such point, hellbender's compiled layers and the Trainer's whole-model compile alike, and gives
the process its own setting back afterwards.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any


def compile_settings(cfg: Any) -> AbstractContextManager:
    if cfg.activation_memory_budget is None:
        return nullcontext()
    import torch._functorch.config as functorch_config  # the setting exists from torch 2.4; hellbender needs 2.6

    return functorch_config.patch(activation_memory_budget=cfg.activation_memory_budget)
