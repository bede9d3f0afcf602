"""DeepSpeed ZeRO through transformers' Trainer: hellbender checks the `deepspeed:` JSON file and that the optional
package is installed, then hands the path to the Trainer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError, EnvironmentProblem


def deepspeed_config(cfg: HellbenderConfig) -> str | None:
    """The checked path of the DeepSpeed JSON config, or None without `deepspeed:`."""
    if not cfg.deepspeed:
        return None
    path = Path(cfg.deepspeed)
    if not path.is_file():
        raise ConfigError(f"`deepspeed: {cfg.deepspeed}`: no such file. Point it at a DeepSpeed JSON config.")
    if importlib.util.find_spec("deepspeed") is None:
        raise EnvironmentProblem(
            "`deepspeed` is set but the `deepspeed` package is not installed. Install it with "
            "`pip install 'hellbender[deepspeed]'`, or remove `deepspeed:` to train without it."
        )
    return str(path)
