"""Axolotl's prompt transforms of online RL (`datasets[i].type: module.function`): the function of a Python file in
`trl.reward_funcs_dir` is called as Axolotl calls it, `function(cfg, dataset_idx=i)`, and returns the row transform,
or the transform and the keywords of `datasets.map` (only `remove_columns` is read: a list, or `"__all__"` for every
original column). The transform maps one row (a dict) to the columns it sets; a `tokenizer` parameter receives the
run's tokenizer. Failures are the user's code: one paragraph naming the entry and the row."""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.config.reward_functions import TRANSFORM_CALL, load_user_function
from hellbender.errors import ConfigError, DataError

MAP_KEYWORDS = ("remove_columns",)


def transformed_rows(cfg: HellbenderConfig, index: int, rows: Any, tokenizer: Any, entries: str = "datasets") -> Any:
    """The rows of `<entries>[index]` (`datasets`, or `test_datasets`) after its `type: module.function` transform;
    as in Axolotl, the function is given the entry's index in its own list."""
    entry = getattr(cfg, entries)[index]
    key = f"{entries}[{index}].type"
    directory = cfg.trl.reward_funcs_dir if cfg.trl is not None and cfg.trl.reward_funcs_dir else "."
    factory = load_user_function(str(entry.type), directory, key, TRANSFORM_CALL)
    try:
        made = factory(cfg, dataset_idx=index)
    except Exception as exc:  # the user's code
        raise ConfigError(
            f"`{key}: {entry.type}` failed when called as `{entry.type}(cfg, dataset_idx={index})`: "
            f"{type(exc).__name__}: {exc}. Fix the function (docs/rl.md)."
        ) from None
    transform, options = made if isinstance(made, tuple) and len(made) == 2 else (made, {})
    if not callable(transform) or not isinstance(options, dict):
        raise ConfigError(
            f"`{key}: {entry.type}` returned {type(made).__name__}: it must return the row transform (a function of "
            'one row), or it and a dict such as `{"remove_columns": ["question"]}` (docs/rl.md).'
        )
    unknown = sorted(str(k) for k in options if k not in MAP_KEYWORDS)
    if unknown:
        raise ConfigError(
            f"`{key}: {entry.type}` returned the map options {', '.join(f'`{k}`' for k in unknown)}, which hellbender "
            "does not apply to prompt rows (it reads `remove_columns` only). Remove them from what the function returns."
        )
    if "tokenizer" in inspect.signature(transform).parameters:
        transform = partial(transform, tokenizer=tokenizer)
    removed = options.get("remove_columns") or []
    removed = list(rows.column_names) if removed == "__all__" else [c for c in removed if c in rows.column_names]
    where = f"`{entries}[{index}]` (`{entry.path}`)"

    def one_row(row: dict[str, Any], position: int) -> dict[str, Any]:
        try:
            result = transform(row)
        except Exception as exc:  # the user's code, reported with the row it failed on
            raise DataError(
                f"The transform `{entry.type}` of {where} failed on row {position}: {type(exc).__name__}: {exc}. Fix "
                "the function, or the row."
            ) from None
        if not isinstance(result, dict):
            raise DataError(
                f"The transform `{entry.type}` of {where} returned {type(result).__name__} for row {position}: it "
                'must return a dict of the columns it sets (e.g. `{"prompt": [...], "answer": "42"}`).'
            )
        return result

    # Kept in memory, never in datasets' cache: the transform's file may change between runs unnoticed.
    return rows.map(one_row, with_indices=True, remove_columns=removed, keep_in_memory=True, load_from_cache_file=False)
