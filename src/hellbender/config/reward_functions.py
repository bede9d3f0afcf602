"""Reward functions named in `trl.reward_funcs` and prompt transforms named as a dataset's `type` (online RL):
`module.function` is the function `function` of the Python file
`module.py` (`pkg.module.function`: `pkg/module.py`) in `trl.reward_funcs_dir`. Importing the file runs its code, as
Axolotl does; that is what naming it in the config asks for (docs/rl.md). An entry that is a directory (absolute, or
relative to `trl.reward_funcs_dir`) or a hub id `org/name` is a reward model instead: a sequence-classification
checkpoint with one score, such as `reward_model: true` saves; here it is only checked, never loaded."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hellbender.errors import ConfigError


def reward_file(name: str, directory: str | Path) -> Path:
    module = name.rpartition(".")[0]
    return Path(directory, *module.split(".")).with_suffix(".py")


# What a reward function is called with, for the paragraph about a name that is not a function.
REWARD_CALL = "called with `prompts`, `completions` and the dataset's other columns as keywords; docs/rl.md"
# What a prompt transform (`datasets[i].type: module.function`) is called with, as Axolotl calls it.
TRANSFORM_CALL = (
    'called as `function(cfg, dataset_idx=i)`, returning the row transform, or it and `{"remove_columns": [...]}`; '
    "docs/rl.md"
)


def load_reward_function(name: str, directory: str | Path) -> Callable[..., Any]:
    """The reward function `name` (`module.function`) of `trl.reward_funcs`; see `load_user_function`."""
    return load_user_function(name, directory, "trl.reward_funcs", REWARD_CALL)


def load_user_function(name: str, directory: str | Path, key: str, called: str) -> Callable[..., Any]:
    """The function `name` (`module.function`, named by the config key `key`; `called`: how hellbender calls it),
    its file imported once per process (under a name of its own, so two configs' `rewards.py` files do not meet); a
    ConfigError of one paragraph when the file or the function is missing, the file fails to import, or the name is
    not callable."""
    module, _, function = name.rpartition(".")
    if not module or not function:
        raise ConfigError(
            f"`{key}` names `{name}`, which is not `module.function`: write the Python file's name (without `.py`) "
            "and the function's, e.g. `rewards.answer_is_correct` for `answer_is_correct` in `rewards.py` next to "
            "the config."
        )
    path = reward_file(name, directory).resolve()
    if not path.is_file():
        raise ConfigError(
            f"`{key}` names `{name}`, and there is no file `{path}` for it: the Python files of reward functions and "
            f"prompt transforms are read from `trl.reward_funcs_dir` (`{directory}`, the config file's directory by "
            "default). Put the file there, or correct the name."
        )
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    unique = f"hellbender_user_{digest}"
    loaded = sys.modules.get(unique)
    if loaded is None:
        spec = importlib.util.spec_from_file_location(unique, path)
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(loaded)
        except Exception as exc:  # the user's file: any failure is reported as theirs
            raise ConfigError(
                f"`{key}`: importing `{path}` (for `{name}`) failed: {type(exc).__name__}: {exc}. Fix the file, or "
                f"remove `{name}` from `{key}`."
            ) from None
        sys.modules[unique] = loaded
    found = getattr(loaded, function, None)
    if found is None or not callable(found):
        what = "has no" if found is None else "has a non-callable"
        raise ConfigError(
            f"`{key}` names `{name}`, and `{path}` {what} `{function}`: name a function of that file ({called})."
        )
    return found


def reward_model_source(name: str, directory: str | Path) -> str | None:
    """The reward model a `trl.reward_funcs` entry names (a local directory, resolved, or a hub id), or None for a
    `module.function` (which never holds a `/`)."""
    local = _local_path(name, directory)
    if local.is_dir():
        return str(local.resolve())
    return name if "/" in name or "\\" in name else None


def _local_path(name: str, directory: str | Path) -> Path:
    path = Path(name).expanduser()
    return path if path.is_absolute() else Path(directory, path)


def _looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and "\\" not in name


def reward_model_problem(name: str, directory: str | Path) -> str | None:
    """Why the reward model entry `name` cannot score completions, one paragraph; None when it can (or is a hub id
    that only the download at training can check)."""
    local = _local_path(name, directory)
    if local.is_dir():
        return _checkpoint_problem(name, local / "config.json")
    if not _looks_like_hub_id(name):
        return (
            f"`trl.reward_funcs` names `{name}`, and there is no directory `{local}`: an entry with a `/` is a reward "
            f"model, a directory (absolute, or relative to `trl.reward_funcs_dir`, `{directory}`) or a hub id "
            "`org/name`. Point it at the directory the reward model was saved to, or correct the name."
        )
    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json")
    if isinstance(cached, str):
        return _checkpoint_problem(name, Path(cached))
    if constants.HF_HUB_OFFLINE:
        return (
            f"`trl.reward_funcs` names `{name}`, which is neither a directory (relative to `trl.reward_funcs_dir`, "
            f"`{directory}`) nor a hub model in the local cache, and the hub is offline here (`HF_HUB_OFFLINE`). "
            "Download the reward model first, or point the entry at its directory."
        )
    return None


def _checkpoint_problem(name: str, config_file: Path) -> str | None:
    where = f"`trl.reward_funcs` names `{name}` as a reward model"
    if not config_file.is_file():
        if (config_file.parent / "adapter_config.json").is_file():
            return (
                f"{where}, and `{config_file.parent}` holds a LoRA adapter without its base model. Merge it first "
                "(`hellbender merge-lora` with the reward model's config writes the whole model), and name the merged "
                "directory."
            )
        return (
            f"{where}, and `{config_file.parent}` has no `config.json`: name the directory a sequence-classification "
            "model was saved to (`reward_model: true` saves one)."
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return f"{where}, and its `{config_file}` cannot be read ({exc}). Save the reward model again."
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        shown = ", ".join(map(str, architectures)) or "no architecture"
        return (
            f"{where}, and it is a {shown}, not a sequence-classification model: a reward model scores a prompt and "
            "its completion with one number. Train one with `reward_model: true` (docs/preference.md), or name a "
            "reward function `module.function`."
        )
    labels = len(config.get("id2label") or {}) or 2  # transformers' default is two labels
    if labels != 1:
        return (
            f"{where}, and it scores {labels} labels: TRL reads one score per completion, so a reward model has "
            "`num_labels: 1` (as `reward_model: true` trains by default). Name a reward model with one score."
        )
    return None


# What TRL passes every reward function itself, beside the dataset's columns (none of them is a column to check for).
TRL_PASSED = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments", "images"}
)


def required_columns(function: Callable[..., Any]) -> list[str]:
    """The dataset columns a reward function cannot be called without: its named parameters without a default,
    other than those TRL passes itself (`TRL_PASSED`)."""
    import inspect

    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        p.name
        for p in parameters
        if p.kind in named and p.default is inspect.Parameter.empty and p.name not in TRL_PASSED
    ]
