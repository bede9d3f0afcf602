"""Preference-tuning methods and reward models on TRL's trainers, one small module per method.

Each module exposes `arguments(cfg)` (the TRL config class and the fields the config sets, for `training_arguments`)
and `build_trainer(cfg, model, args, train, eval, tokenizer, **hellbender)`, which takes the model hellbender built
(LoRA applied, or not) and the prepared, already tokenized rows, and `TRAINER`, the trainer class (which
`hellbender evaluate` builds on a trained model). TRL never loads, wraps, quantizes or re-tokenizes
anything here. What the trainers share is in `shared.py`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from hellbender.config import HellbenderConfig

# `rl` value (or `reward_model`) -> the module of this package that binds it. Imported on use: TRL is not loaded for
# supervised fine-tuning.
METHOD_MODULES = {
    "dpo": "dpo",
    "ipo": "dpo",
    "kto": "kto",
    "orpo": "orpo",
    "simpo": "simpo",
    "grpo": "grpo",
    "gdpo": "grpo",
    "rloo": "rloo",
    "reward_model": "reward_model",
}


def preference_method(cfg: HellbenderConfig) -> ModuleType | None:
    """The module of the config's preference method, or None for supervised fine-tuning."""
    name = "reward_model" if cfg.reward_model else cfg.rl
    if name is None:
        return None
    return importlib.import_module(f"{__name__}.{METHOD_MODULES[name]}")
