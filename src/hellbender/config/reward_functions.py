"""Reward functions named in `trl.reward_funcs` as `module.function`: the function `function` of the Python file
`module.py` (`pkg.module.function`: `pkg/module.py`) in `trl.reward_funcs_dir`. Importing the file runs its code, as
Axolotl does; that is what naming it in the config asks for (docs/rl.md)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hellbender.errors import ConfigError


def reward_file(name: str, directory: str | Path) -> Path:
    module = name.rpartition(".")[0]
    return Path(directory, *module.split(".")).with_suffix(".py")


def load_reward_function(name: str, directory: str | Path) -> Callable[..., Any]:
    """The function `name` names, its file imported once per process (under a name of its own, so two configs'
    `rewards.py` files do not meet); a ConfigError of one paragraph when the file or the function is missing, the
    file fails to import, or the name is not callable."""
    module, _, function = name.rpartition(".")
    if not module or not function:
        raise ConfigError(
            f"`trl.reward_funcs` names `{name}`, which is not `module.function`: write the Python file's name "
            "(without `.py`) and the function's, e.g. `rewards.answer_is_correct` for `answer_is_correct` in "
            "`rewards.py` next to the config."
        )
    path = reward_file(name, directory).resolve()
    if not path.is_file():
        raise ConfigError(
            f"`trl.reward_funcs` names `{name}`, and there is no file `{path}` for it: reward functions are read "
            f"from Python files in `trl.reward_funcs_dir` (`{directory}`, the config file's directory by default). "
            "Put the file there, or correct the name."
        )
    key = f"hellbender_reward_{hashlib.sha256(str(path).encode()).hexdigest()[:16]}"
    loaded = sys.modules.get(key)
    if loaded is None:
        spec = importlib.util.spec_from_file_location(key, path)
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(loaded)
        except Exception as exc:  # the user's file: any failure is reported as theirs
            raise ConfigError(
                f"`trl.reward_funcs`: importing `{path}` (for `{name}`) failed: {type(exc).__name__}: {exc}. Fix the "
                "file, or remove the name from `trl.reward_funcs`."
            ) from None
        sys.modules[key] = loaded
    found = getattr(loaded, function, None)
    if found is None or not callable(found):
        what = "has no" if found is None else "has a non-callable"
        raise ConfigError(
            f"`trl.reward_funcs` names `{name}`, and `{path}` {what} `{function}`: name a function of that file "
            "(called with `prompts`, `completions` and the dataset's other columns as keywords; docs/rl.md)."
        )
    return found
