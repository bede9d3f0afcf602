"""Copy a `transformers.TrainingArguments` into the configuration class of a TRL trainer."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from transformers import TrainingArguments

ConfigT = TypeVar("ConfigT", bound=TrainingArguments)


def trl_config(config_class: type[ConfigT], args: TrainingArguments, **method_keys: Any) -> ConfigT:
    """`config_class` (KTOConfig, ORPOConfig, ...) holding every field of `args`, then `method_keys`.

    TRL's configs change several TrainingArguments defaults (gradient checkpointing on, bf16 on, learning rate 1e-6,
    logging every 10 steps); copying every field keeps the values hellbender resolved, so none of those defaults
    applies. `to_dict` turns enums and the accelerator config into plain values the constructor accepts again; it
    hides token fields and serialises the parallelism config, so those are taken from `args` itself.
    """
    known = {f.name for f in dataclasses.fields(config_class) if f.init}
    unknown = sorted(set(method_keys) - known)
    if unknown:
        raise TypeError(f"{config_class.__name__} has no field(s) {unknown}")
    values = args.to_dict()
    for name in values:
        if name.endswith("_token") or name == "parallelism_config":
            values[name] = getattr(args, name)
    values.update(method_keys)
    return config_class(**values)
