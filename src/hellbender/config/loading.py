"""Reading a YAML config: overrides, unknown and not-yet-supported keys, type errors, conflicts, defaults."""

from __future__ import annotations

import difflib
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from hellbender.config.checks import find_conflicts
from hellbender.config.defaults import apply_derived_defaults
from hellbender.config.schema import DatasetEntry, HellbenderConfig, PretrainingDatasetEntry
from hellbender.errors import ConfigError

# Where each list of entries is validated by which model, for key checks inside entries.
ENTRY_MODELS: dict[str, type[BaseModel]] = {
    "datasets": DatasetEntry,
    "test_datasets": DatasetEntry,
    "pretraining_dataset": PretrainingDatasetEntry,
}


@cache
def _axolotl_keys(filename: str) -> frozenset[str]:
    text = resources.files("hellbender.config").joinpath(filename).read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"Config file `{path}` does not exist. Pass the path of a YAML config (see `hellbender examples`)."
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"Config file `{path}` is not valid YAML{where}: {getattr(exc, 'problem', exc)}.") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"Config file `{path}` must be a YAML mapping of keys to values, not a {type(data).__name__}."
        )
    return data


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `--set key=value` overrides. Values are parsed as YAML; dotted keys reach into lists and mappings
    (`datasets.0.path=data.jsonl`)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"Override `{item}` is not of the form KEY=VALUE (e.g. `--set learning_rate=1e-4`).")
        try:
            value = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            raise ConfigError(f"Override `{item}`: the value is not valid YAML; quote it if it is text.") from None
        parts = key.split(".")
        node: Any = raw
        for depth, part in enumerate(parts[:-1]):
            nxt = _child(node, part, item)
            if nxt is None:
                nxt = {}
                _assign(node, part, nxt, item)
            node = nxt
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"Override `{item}`: `{'.'.join(parts[: depth + 1])}` is not a mapping or list.")
        _assign(node, parts[-1], value, item)
    return raw


def _child(node: Any, part: str, item: str) -> Any:
    if isinstance(node, list):
        index = _index(node, part, item)
        return node[index]
    return node.get(part)


def _assign(node: Any, part: str, value: Any, item: str) -> None:
    if isinstance(node, list):
        node[_index(node, part, item)] = value
    else:
        node[part] = value


def _index(node: list, part: str, item: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"Override `{item}`: `{part}` is not an index of a list with {len(node)} entries.")
    return int(part)


def _is_unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def _check_keys(raw: dict[str, Any], model: type[BaseModel], axolotl_keys: frozenset[str], where: str) -> list[str]:
    """Unknown keys get a did-you-mean; keys Axolotl defines that we do not implement are refused by name.

    An unimplemented key set to an empty or false value asks for nothing, so it is accepted (configs
    written for Axolotl often carry `load_in_8bit: false` and the like)."""
    problems = []
    known = set(model.model_fields)
    for key in list(raw):
        if key in known:
            continue
        if key in axolotl_keys:
            if _is_unset(raw[key]):
                del raw[key]
                continue
            problems.append(
                f"{where}`{key}` is not supported yet: hellbender does not implement it, and ignoring it would "
                f"silently change your run. Remove it, or set it to false / null if you do not need it."
            )
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6) or difflib.get_close_matches(
            key, sorted(axolotl_keys), n=1, cutoff=0.6
        )
        hint = f" Did you mean `{close[0]}`?" if close else " See `hellbender schema` or docs/config.md for every key."
        problems.append(f"{where}`{key}` is not a config key.{hint}")
    return problems


def _format_validation_error(exc: ValidationError) -> list[str]:
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        value = err.get("input")
        shown = repr(value) if not isinstance(value, dict) else "a mapping"
        if err["type"] == "missing":
            problems.append(f"`{loc}` is required but missing.")
        else:
            problems.append(f"`{loc}`: {err['msg'].rstrip('.')} (got {shown}).")
    return problems


def validate_config(raw: dict[str, Any]) -> HellbenderConfig:
    problems = _check_keys(raw, HellbenderConfig, _axolotl_keys("axolotl_keys.txt"), "")
    for list_key, model in ENTRY_MODELS.items():
        entries = raw.get(list_key)
        if isinstance(entries, dict):  # Axolotl accepts a single mapping for pretraining_dataset
            entries = raw[list_key] = [entries]
        if isinstance(entries, list):
            for i, entry in enumerate(entries):
                if isinstance(entry, dict):
                    where = f"In `{list_key}[{i}]`: "
                    problems += _check_keys(entry, model, _axolotl_keys("axolotl_dataset_keys.txt"), where)
    if problems:
        raise ConfigError("\n\n".join(problems))
    try:
        cfg = HellbenderConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("\n\n".join(_format_validation_error(exc))) from None
    conflicts = find_conflicts(cfg)
    if conflicts:
        raise ConfigError("\n\n".join(conflicts))
    return apply_derived_defaults(cfg)


def load_config(path: str | Path, overrides: list[str] | None = None) -> HellbenderConfig:
    raw = apply_overrides(read_yaml(path), overrides or [])
    return validate_config(raw)


def dump_config(cfg: HellbenderConfig) -> str:
    """The resolved config as YAML, every key included, in schema order."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
