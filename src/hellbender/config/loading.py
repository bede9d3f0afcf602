"""From a YAML file (and `--set` overrides) to a validated config: key names, types, combinations, defaults, paths.
Each step lives in its own module; this one runs them in order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hellbender.config.checks import find_conflicts, find_path_problems
from hellbender.config.defaults import apply_derived_defaults, machine_defaults
from hellbender.config.keys import key_problems
from hellbender.config.machine import Machine
from hellbender.config.overrides import apply_overrides
from hellbender.config.schema import HellbenderConfig
from hellbender.config.validation_errors import describe_validation_error
from hellbender.config.yaml_file import read_yaml
from hellbender.errors import ConfigError


def validate_config(raw: dict[str, Any]) -> HellbenderConfig:
    problems = key_problems(raw)
    if problems:
        raise ConfigError("\n\n".join(problems))
    try:
        cfg = HellbenderConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("\n\n".join(describe_validation_error(exc, raw))) from None
    conflicts = find_conflicts(cfg)
    if conflicts:
        raise ConfigError("\n\n".join(conflicts))
    prepared_path_is_default = cfg.dataset_prepared_path is None
    cfg = apply_derived_defaults(cfg)
    problems = find_path_problems(cfg, prepared_path_is_default)  # after the defaults, which place the cache
    if problems:
        raise ConfigError("\n\n".join(problems))
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> HellbenderConfig:
    raw = read_yaml(path)
    if not raw and not overrides:
        raise ConfigError(
            f"Config file `{path}` is empty: `base_model` is required, and `datasets:` to train on (see "
            "`hellbender examples` for complete configs)."
        )
    return validate_config(apply_overrides(raw, overrides or []))


def dump_config(cfg: HellbenderConfig, machine: Machine | None = None) -> str:
    """The resolved config as YAML, every key included, in schema order. With `machine`, the keys decided on the
    machine that runs (`bf16`, `optimizer`, `dataloader_num_workers`) say what they will be on it, as comments."""
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
    if machine is None:
        return text
    notes = {
        key: f"on this machine ({machine.describe()}): {value}" for key, value in machine_defaults(cfg, machine).items()
    }
    lines = []
    for line in text.splitlines():
        key = line.partition(":")[0]
        lines.append(f"{line}  # {notes[key]}" if key in notes else line)
    return "\n".join(lines) + "\n"
