"""From a YAML file (and `--set` overrides) to a validated config: key names, types, combinations, defaults, paths.
Each step lives in its own module; this one runs them in order."""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hellbender.config.checks import find_conflicts, find_notices, find_path_problems
from hellbender.config.deepspeed import use_deepspeed_preset
from hellbender.config.defaults import apply_derived_defaults, machine_defaults
from hellbender.config.fsdp1 import translate_fsdp1
from hellbender.config.keys import ENTRY_MODELS, is_cloud_launch_file, key_problems
from hellbender.config.lazy_preparation import read_skip_prepare_dataset
from hellbender.config.machine import Machine
from hellbender.config.overrides import apply_overrides
from hellbender.config.path_shapes import path_shape_problems
from hellbender.config.planned_keys import AUTO_KEYS, AutoChooser, stand_ins
from hellbender.config.schema import HellbenderConfig
from hellbender.config.spellings import read_older_spellings
from hellbender.config.strategies import read_strategies
from hellbender.config.validation_errors import describe_validation_error, user_path
from hellbender.config.values import lone_surrogate_problems
from hellbender.config.yaml_file import read_yaml
from hellbender.errors import ConfigError

logger = logging.getLogger("hellbender")
# Every key name of the config (top level and entries), to tell which keys a problem paragraph names.
_CONFIG_KEYS = frozenset(HellbenderConfig.model_fields) | frozenset(
    name for model in ENTRY_MODELS.values() for name in model.model_fields
)


def validate_config(raw: dict[str, Any], choose_auto: AutoChooser | None = None) -> HellbenderConfig:
    """The validated config, with every default filled in; or a ConfigError listing every problem of `raw` at once:
    key names, values, combinations of keys and paths, one paragraph each (a problem that follows from one already
    listed is left out). `choose_auto`: what resolves the `auto` values of `AUTO_KEYS` (the memory planner, which
    sits above this layer; hellbender's commands pass it)."""
    surrogates = lone_surrogate_problems(raw)
    if surrogates:  # before anything that may echo a value: such text cannot be printed
        raise ConfigError("\n\n".join(surrogates))
    problems: list[str] = []
    notices: list[str] = []
    # Axolotl's words, in hellbender's
    for translate in (read_older_spellings, read_strategies, translate_fsdp1, read_skip_prepare_dataset):
        more_problems, more_notices = translate(raw)
        problems, notices = problems + more_problems, notices + more_notices
    cloud_launch_file = is_cloud_launch_file(raw)
    problems += key_problems(raw, notices)  # removes the keys it reports, so the rest is still checked
    asked = [key for key in AUTO_KEYS if raw.get(key) == "auto"]
    if asked:  # validated with stand-ins first, then again with the planner's choice for the run that config makes
        if choose_auto is None:
            raise ConfigError(
                f"{', '.join(f'`{key}: auto`' for key in asked)} is chosen by the memory planner, which runs in "
                "hellbender's commands (`hellbender validate`, `train`, `plan`). Run one of them, or give a value."
            )
        quiet = logger.level
        logger.setLevel(logging.ERROR)  # its notices are the same as the final pass's
        try:
            provisional = validate_config(copy.deepcopy({**raw, **stand_ins(raw, asked)}))
        finally:
            logger.setLevel(quiet)
        return validate_config({**raw, **choose_auto(provisional, asked)})
    cfg, value_problems = _validated_values(raw)
    if cloud_launch_file:  # its keys' refusal says what the file is; that it names no model follows from that
        value_problems = [p for p in value_problems if not p.startswith("`base_model` is required")]
    problems += value_problems
    if cfg is not None:
        cfg, preset_notices = use_deepspeed_preset(cfg)  # an Axolotl `deepspeed_configs/` name not found here
        notices += preset_notices
        prepared_path_is_default = cfg.dataset_prepared_path is None
        shapes = path_shape_problems(cfg)
        if shapes:  # every later check may touch these paths, and the system refuses to
            raise ConfigError("\n\n".join(problems + shapes))
        later = find_conflicts(cfg)
        cfg = apply_derived_defaults(cfg)
        later += find_path_problems(cfg, prepared_path_is_default)  # after the defaults, which place the cache
        reported = _keys_named(problems)
        problems += [p for p in later if not _keys_named([p]) & reported]
    for notice in notices + (find_notices(cfg) if cfg is not None else []):  # before the errors, which may follow
        logger.warning(notice)  # from what a notice says (an FSDP1 config translated to FSDP2)
    if problems:
        raise ConfigError("\n\n".join(problems))
    return cfg


def _validated_values(raw: dict[str, Any]) -> tuple[HellbenderConfig | None, list[str]]:
    """The config and the problems of its values. When values are wrong, the config is built without them (their
    defaults stand in), so that combinations of the other keys can still be checked in the same pass; None when a
    required key is missing."""
    try:
        return HellbenderConfig.model_validate(raw), []
    except ValidationError as exc:
        problems = describe_validation_error(exc, raw)
        if any(err["type"] == "missing" for err in exc.errors()):
            return None, problems
        pruned = copy.deepcopy(raw)
        for path in sorted({user_path(err["loc"], raw) for err in exc.errors()}, key=len, reverse=True):
            _remove(pruned, path)
    try:
        return HellbenderConfig.model_validate(pruned), problems
    except ValidationError:
        return None, problems


def _remove(raw: dict[str, Any], path: tuple[Any, ...]) -> None:
    """Remove the value at `path` from the raw config: the mapping key it sits under (a wrong list item takes its
    whole list with it, so that no other index moves)."""
    keys = [i for i, part in enumerate(path) if isinstance(part, str)]
    if not keys:
        return
    *parents, last = path[: keys[-1] + 1]
    node: Any = raw
    for part in parents:
        node = node[part]
    node.pop(last, None)


def _keys_named(paragraphs: list[str]) -> set[str]:
    """The config keys a problem names (`key`, `key: value`, `datasets.0.key`: each key of the path)."""
    names = set()
    for quoted in re.findall(r"`([^`]+)`", "\n".join(paragraphs)):
        head = quoted.split(":")[0].strip()
        names |= {part for part in head.split(".") if part.isidentifier()}
    return names & _CONFIG_KEYS


def load_config(
    path: str | Path, overrides: list[str] | None = None, choose_auto: AutoChooser | None = None
) -> HellbenderConfig:
    raw = read_yaml(path)
    if not raw and not overrides:
        raise ConfigError(
            f"Config file `{path}` is empty: `base_model` is required, and `datasets:` to train on (see "
            "`hellbender examples` for complete configs)."
        )
    return validate_config(_reward_functions_beside(apply_overrides(raw, overrides or []), Path(path)), choose_auto)


def _reward_functions_beside(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """`trl.reward_funcs` files are found next to the config file (Axolotl's meaning), or in a relative
    `trl.reward_funcs_dir` taken from there; the resolved config names the absolute directory."""
    block = raw.get("trl")
    if isinstance(block, dict) and block.get("reward_funcs"):
        given = block.get("reward_funcs_dir")
        here = path.resolve().parent
        block["reward_funcs_dir"] = str(here / given) if isinstance(given, str) else str(here)
    return raw


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
