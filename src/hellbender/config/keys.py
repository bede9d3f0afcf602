"""Key names: an unknown key gets a did-you-mean, a key Axolotl defines that hellbender does not implement is refused
by name, and a key written at the wrong level says where it belongs."""

from __future__ import annotations

import difflib
from functools import cache
from importlib import resources
from typing import Any

from pydantic import BaseModel

from hellbender.config.schema import DatasetEntry, HellbenderConfig, PretrainingDatasetEntry

# Where each list of entries is validated by which model, for key checks inside entries.
ENTRY_MODELS: dict[str, type[BaseModel]] = {
    "datasets": DatasetEntry,
    "test_datasets": DatasetEntry,
    "pretraining_dataset": PretrainingDatasetEntry,
}


@cache
def axolotl_keys(filename: str) -> frozenset[str]:
    text = resources.files("hellbender.config").joinpath(filename).read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


def _is_unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def check_keys(raw: dict[str, Any], model: type[BaseModel], axolotl_keys: frozenset[str], where: str) -> list[str]:
    """Unknown keys get a did-you-mean; keys Axolotl defines that we do not implement are refused by name. Each key
    with a problem is removed from `raw`, so the rest of the config can still be checked in the same pass.

    An unimplemented key set to an empty or false value asks for nothing, so it is accepted (configs
    written for Axolotl often carry `load_in_8bit: false` and the like). A known key left blank (`special_tokens:`)
    is unset: it takes its default, as in Axolotl."""
    problems = []
    known = set(model.model_fields)
    for key in list(raw):
        if key in known:
            if raw[key] is None:
                del raw[key]
            continue
        if key in axolotl_keys:
            if _is_unset(raw[key]):
                del raw[key]
                continue
            problems.append(
                f"{where}`{key}` is not supported yet: hellbender does not implement it, and ignoring it would "
                f"silently change your run. Remove it, or set it to false / null if you do not need it."
            )
        elif misplaced := _misplaced(key, model):
            problems.append(f"{where}{misplaced}")
        else:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6) or difflib.get_close_matches(
                key, sorted(axolotl_keys), n=1, cutoff=0.6
            )
            hint = (
                f" Did you mean `{close[0]}`?" if close else " See `hellbender schema` or docs/config.md for every key."
            )
            problems.append(f"{where}`{key}` is not a config key.{hint}")
        del raw[key]
    return problems


def _misplaced(key: str, model: type[BaseModel]) -> str | None:
    """A key written at the wrong level: a dataset-entry key at the top (an entry's indentation lost) or a top-level
    key inside an entry."""
    if model is HellbenderConfig and key in DatasetEntry.model_fields:
        layout = "`- path: ...`" if key == "path" else f"`- path: ...` then `  {key}: ...`"
        return (
            f"`{key}` is not a top-level key: it is a key of a dataset entry. Indent it under the entry of "
            f"`datasets:` it belongs to ({layout})."
        )
    if model is not HellbenderConfig and key in HellbenderConfig.model_fields:
        return f"`{key}` is a top-level key, not a key of a dataset entry: move it out of the dataset entry."
    return None


def key_problems(raw: dict[str, Any]) -> list[str]:
    """Every key problem of the raw config, its dataset entries included. Keys with a problem, unimplemented keys
    set to nothing and known keys left blank are removed from `raw`."""
    problems = check_keys(raw, HellbenderConfig, axolotl_keys("axolotl_keys.txt"), "")
    for list_key, model in ENTRY_MODELS.items():
        entries = raw.get(list_key)
        if isinstance(entries, dict):  # Axolotl accepts a single mapping for pretraining_dataset
            entries = raw[list_key] = [entries]
        if isinstance(entries, list):
            for i, entry in enumerate(entries):
                if isinstance(entry, dict):
                    where = f"In `{list_key}[{i}]`: "
                    problems += check_keys(entry, model, axolotl_keys("axolotl_dataset_keys.txt"), where)
    return problems
