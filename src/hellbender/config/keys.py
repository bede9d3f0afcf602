"""Key names: an unknown key gets a did-you-mean, a key Axolotl defines that hellbender does not implement is refused
by name, and a key written at the wrong level says where it belongs."""

from __future__ import annotations

import difflib
from functools import cache
from importlib import resources
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from hellbender.config.schema import DatasetEntry, HellbenderConfig, PretrainingDatasetEntry
from hellbender.config.unsupported import (
    AXOLOTL_TOOLING,
    CLOUD_LAUNCHER,
    DESCRIBES_HELLBENDER,
    NOT_AXOLOTL_KEYS,
    not_offered_reason,
    not_offered_refusal,
    planned_feature,
    refusal,
)
from hellbender.config.yaml_file import yaml_word

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


# Axolotl keys that only tune a feature hellbender does not implement: with the feature off they ask for nothing.
PARAMETER_OF: dict[str, str] = {
    "eval_max_new_tokens": "eval_table_size",
    "eval_causal_lm_metrics": "do_causal_lm_eval",
    "bench_dataset": "do_bench_eval",
    "bench_split": "do_bench_eval",
    "swanlab_completion_log_interval": "swanlab_log_completions",
    "swanlab_completion_max_buffer": "swanlab_log_completions",
}


def check_keys(
    raw: dict[str, Any], model: type[BaseModel], axolotl_keys: frozenset[str], where: str, notices: list[str]
) -> list[str]:
    """Unknown keys get a did-you-mean; keys Axolotl defines that we do not implement are refused by name. Each key
    with a problem is removed from `raw`, so the rest of the config can still be checked in the same pass.

    A key that asks for nothing is accepted, with a notice where the reader may want to know: a known key left blank
    (`special_tokens:`) takes its default, as in Axolotl; an unimplemented key set to an empty or false value
    (`load_in_8bit: false`), a blank unknown key (`debug:`), or a parameter of an unimplemented feature that is off
    (`eval_max_new_tokens` without `eval_table_size`) changes nothing."""
    problems = []
    not_offered: dict[str, list[str]] = {}  # reason -> its keys, refused in one paragraph
    known = set(model.model_fields)
    for key in list(raw):
        value = raw[key]
        if key in known:
            if value is None:
                del raw[key]
            continue
        if key in DESCRIBES_HELLBENDER:
            wanted, why = DESCRIBES_HELLBENDER[key]
            if value is not None and value != wanted:
                problems.append(f"{where}`{key}: {yaml_word(value)}` cannot be honoured: {why}. Remove it.")
            del raw[key]
            continue
        feature = PARAMETER_OF.get(key)
        known_elsewhere = key in axolotl_keys or planned_feature(key)  # plugin keys are not in Axolotl's own list
        if known_elsewhere and (_is_unset(value) or (feature and _is_unset(raw.get(feature)))):
            if not _is_unset(value):
                notices.append(f"{where}`{key}` tunes `{feature}`, which is off, so it changes nothing.")
        elif key in AXOLOTL_TOOLING:
            notices.append(f"{where}`{key}` steers {AXOLOTL_TOOLING[key]}; it changes nothing here.")
        elif reason := not_offered_reason(key):
            not_offered.setdefault(reason, []).append(key)
        elif key in axolotl_keys or planned_feature(key):
            problems.append(refusal(key, where))
        elif key in NOT_AXOLOTL_KEYS and model is HellbenderConfig:
            problems.append(f"{where}{_not_axolotl(key, value, raw)}")
        elif misplaced := _misplaced(key, model):
            problems.append(f"{where}{misplaced}")
        else:
            close = _suggestions(key, value, model, sorted(known)) or _suggestions(
                key, value, model, sorted(axolotl_keys)
            )
            hint = (
                f" Did you mean `{close[0]}`?" if close else " See `hellbender schema` or docs/config.md for every key."
            )
            if value is None:
                notices.append(f"{where}`{key}` is not a config key; left blank, it asks for nothing.{hint}")
            else:
                problems.append(f"{where}`{key}` is not a config key.{hint}")
        del raw[key]
    return problems + [not_offered_refusal(keys, reason, where) for reason, keys in not_offered.items()]


def _number(value: Any) -> float | None:
    """A number as YAML may give it (`7e-7` is text to YAML 1.1 readers), or None."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _not_axolotl(key: str, value: Any, raw: dict[str, Any]) -> str:
    """A key that is not Axolotl's either: refused, since Axolotl silently ignored it, with what to use instead (for
    `eta_min`, the `cosine_min_lr_ratio` it amounts to with this config's `learning_rate`)."""
    hint = ""
    floor, rate = _number(value), _number(raw.get("learning_rate"))
    if key == "eta_min" and floor is not None and rate and 0 <= floor <= rate:
        hint = f" Here that is `cosine_min_lr_ratio: {floor / rate:.4g}` ({floor:g} / `learning_rate` {rate:g})."
    return f"`{key}` is not a key of hellbender, nor of Axolotl: it is {NOT_AXOLOTL_KEYS[key]}.{hint} Remove `{key}`."


# A name this close to an unknown key is a slip of a letter or two: suggested whatever the value.
_SLIP = 0.8


def _suggestions(key: str, value: Any, model: type[BaseModel], names: list[str]) -> list[str]:
    """The closest of `names` to a mistyped `key`. A name less close is suggested only if it could hold the value
    (`test_value: true` is not a misspelt `test_datasets`, which holds a list)."""
    return [
        name
        for name in difflib.get_close_matches(key, names, n=3, cutoff=0.6)
        if difflib.SequenceMatcher(None, key, name).ratio() >= _SLIP or _could_hold(model, name, value)
    ][:1]


def _could_hold(model: type[BaseModel], name: str, value: Any) -> bool:
    field = model.model_fields.get(name)
    if field is None or value is None:
        return True
    try:
        TypeAdapter(field.annotation).validate_python(value)
    except ValidationError:
        return False
    return True


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


def key_problems(raw: dict[str, Any], notices: list[str]) -> list[str]:
    """Every key problem of the raw config, its dataset entries included; keys that ask for nothing add to
    `notices`. Keys with a problem and keys that ask for nothing are removed from `raw`."""
    process_reward_model = not _is_unset(raw.get("process_reward_model"))
    problems = check_keys(raw, HellbenderConfig, axolotl_keys("axolotl_keys.txt"), "", notices)
    if process_reward_model:  # refused above (planned); its `num_labels` sizes its head, not a reward model's
        raw.pop("num_labels", None)
    for list_key, model in ENTRY_MODELS.items():
        entries = raw.get(list_key)
        if isinstance(entries, dict):  # Axolotl accepts a single mapping for pretraining_dataset
            entries = raw[list_key] = [entries]
        if isinstance(entries, list):
            for i, entry in enumerate(entries):
                if isinstance(entry, dict):
                    where = f"In `{list_key}[{i}]`: "
                    problems += check_keys(entry, model, axolotl_keys("axolotl_dataset_keys.txt"), where, notices)
    return problems


def is_cloud_launch_file(raw: dict[str, Any]) -> bool:
    """An Axolotl cloud launcher file (machines only, no training key): its missing `base_model` is not worth a
    paragraph."""
    launcher = {key for key in raw if not_offered_reason(str(key)) == CLOUD_LAUNCHER}
    return bool(launcher) and not any(key in HellbenderConfig.model_fields for key in set(raw) - launcher)
