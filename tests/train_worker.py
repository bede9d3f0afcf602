"""One training process of a multi-GPU test, started by torchrun: `hellbender.train.run.train` with a callback
that records parameter dtypes (stored, and as the forward uses them) after the first optimizer step.

Usage: train_worker.py CONFIG.json RESULT.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from hellbender.config import validate_config
from hellbender.train.run import train


class DtypeCapture(TrainerCallback):
    """After step 1: each parameter's stored dtype, and the dtype each module's own parameters have when its
    forward runs in step 2 (FSDP2 has gathered and cast them by then)."""

    def __init__(self) -> None:
        self.stored: dict[str, str] = {}
        self.compute: dict[str, str] = {}
        self._hooks: list[Any] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            self.stored = {name: str(p.dtype) for name, p in model.named_parameters()}
            for name, module in model.named_modules():
                self._hooks.append(module.register_forward_pre_hook(self._recorder(name)))
        elif state.global_step == 2:
            for hook in self._hooks:
                hook.remove()

    def _recorder(self, name: str):
        def record(module: torch.nn.Module, _args: tuple) -> None:
            for param_name, param in module.named_parameters(recurse=False):
                self.compute.setdefault(f"{name}.{param_name}", str(param.dtype))

        return record


class LengthCapture(TrainerCallback):
    """The sequence length of every training forward (under context parallelism: this process's slice)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self._hook: Any = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._hook = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and kwargs.get("input_ids") is not None:
            self.lengths.append(int(kwargs["input_ids"].shape[-1]))

    def on_train_end(self, args, state, control, **kwargs):
        self._hook.remove()


def main(config_path: str, result_path: str) -> None:
    cfg = validate_config(json.loads(Path(config_path).read_text()))
    capture, lengths = DtypeCapture(), LengthCapture()
    metrics = train(cfg, callbacks=[capture, lengths])
    if int(os.environ.get("RANK", "0")) == 0:
        result = {
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            "stored": capture.stored,
            "compute": capture.compute,
            "forward_lengths": lengths.lengths,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        }
        Path(result_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
