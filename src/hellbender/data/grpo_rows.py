"""The prompt rows of online RL (`rl: grpo`, `rl: rloo`): each `datasets` entry's rows as they are, or as its
`type: module.function` transform makes them (`prompt_transforms.py`): a `prompt` column, text or a list of chat
messages, and whatever other columns the reward functions read; for a vision-language model, the prompt's images
(`grpo_images.py`). The entries are joined in order, with each row's index added so a failing reward function can
name the row. Nothing is tokenized here: TRL applies the run's tokenizer
and chat template to each prompt as it generates.

Evaluation prompts are read the same way from `test_datasets`, or held out of the joined `datasets` rows by
`val_set_size`: a seeded random choice (`seed`), so the same config always holds out the same rows, and no held-out
row is trained on."""

from __future__ import annotations

import math
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.config.data import DatasetEntry, is_transform_type
from hellbender.config.reward_functions import load_reward_function, required_columns, reward_model_source
from hellbender.data.grpo_images import TRL_IMAGE_COLUMNS, prompt_image_rows
from hellbender.data.prompt_transforms import transformed_rows
from hellbender.data.sources import load_rows
from hellbender.errors import DataError

# Each prompt row's index in its data (`datasets`, or `test_datasets`), so a failing reward function can name the row;
# the trainer strips it. Rows held out by `val_set_size` keep their index in `datasets`.
ROW_COLUMN = "hellbender_row"


def grpo_rows(cfg: HellbenderConfig, tokenizer: Any = None) -> Any:
    """The training prompt rows (without those `val_set_size` holds out). `tokenizer`: the run's, for transforms that
    take one."""
    return grpo_split(cfg, tokenizer)[0]


def grpo_split(cfg: HellbenderConfig, tokenizer: Any = None) -> tuple[Any, Any]:
    """(training prompt rows, evaluation prompt rows or None): the evaluation rows are `test_datasets`' rows, or those
    `val_set_size` holds out of `datasets`, or None without either."""
    train = _joined_entries(cfg, cfg.datasets, "datasets", tokenizer)
    if cfg.test_datasets:
        return train, _joined_entries(cfg, cfg.test_datasets, "test_datasets", tokenizer)
    if cfg.val_set_size > 0:
        return _hold_out(cfg, train)
    return train, None


def _joined_entries(cfg: HellbenderConfig, entries: list[DatasetEntry], key: str, tokenizer: Any) -> Any:
    parts = []
    functions = _reward_functions(cfg)
    for i, entry in enumerate(entries):
        where = f"`{key}[{i}]` (`{entry.path}`)"
        rows = load_rows(entry, where=where)
        transformed = is_transform_type(entry.type)
        if transformed:
            rows = transformed_rows(cfg, i, rows, tokenizer, key)
        if "prompt" not in rows.column_names:
            made = f" after its transform `{entry.type}`" if transformed else ""
            fix = "Make the transform return a `prompt`." if transformed else "Rename the column, or add it."
            raise DataError(
                f"{where} has no `prompt` column{made} (its columns: {', '.join(rows.column_names)}): `rl: {cfg.rl}` "
                f"generates from each row's `prompt`, text or a list of chat messages. {fix}"
            )
        if ROW_COLUMN in rows.column_names:
            raise DataError(f"{where} has a column `{ROW_COLUMN}`, a name hellbender uses itself. Rename it.")
        _check_reward_columns(rows, functions, where)
        if cfg.is_multimodal:
            rows = prompt_image_rows(rows, entry, cfg, where)
        elif images := [c for c in TRL_IMAGE_COLUMNS if c in rows.column_names]:
            raise DataError(
                f"{where} has a column `{images[0]}`, which TRL reads as the prompt's images, and this config trains a "
                "text model. Set `processor_type` to train a vision-language model on them, or rename the column."
            )
        parts.append(rows)
    joined = parts[0] if len(parts) == 1 else _joined(parts, key)
    return joined.add_column(ROW_COLUMN, list(range(len(joined))))


def _reward_functions(cfg: HellbenderConfig) -> dict[str, Any]:
    """The config's reward functions by name (reward models read no columns)."""
    if cfg.trl is None:
        return {}
    directory = cfg.trl.reward_funcs_dir or "."
    return {
        name: load_reward_function(name, directory)
        for name in cfg.trl.reward_funcs
        if reward_model_source(name, directory) is None
    }


def _check_reward_columns(rows: Any, functions: dict[str, Any], where: str) -> None:
    """Every column a reward function cannot be called without is in `rows`, and has a value in each row."""
    for name, function in functions.items():
        for column in required_columns(function):
            if column not in rows.column_names:
                raise DataError(
                    f"{where} has no `{column}` column, and the reward function `{name}` reads it (its parameter "
                    f"`{column}` has no default; the rows' columns: {', '.join(rows.column_names)}). Add the column "
                    f"to these rows, or give the parameter a default (`{column}=None`)."
                )
            missing = next((i for i, value in enumerate(rows[column]) if value is None), None)
            if missing is not None:
                raise DataError(
                    f"Row {missing} of {where} has no value in `{column}`, which the reward function `{name}` reads "
                    f"(its parameter `{column}` has no default). Give the row a `{column}`, or remove the row."
                )


def _hold_out(cfg: HellbenderConfig, rows: Any) -> tuple[Any, Any]:
    """(training rows, evaluation rows): `val_set_size` of the rows (a fraction, rounded up, or a count), chosen at
    random with `seed`."""
    size = cfg.val_set_size if cfg.val_set_size < 1 else int(cfg.val_set_size)
    held = math.ceil(size * len(rows)) if size < 1 else size
    if held >= len(rows):
        raise DataError(
            f"`val_set_size: {cfg.val_set_size:g}` leaves no training prompts out of {len(rows)}: lower `val_set_size` "
            "(a fraction below 1, or a row count below the number of prompt rows), or add prompt rows."
        )
    split = rows.train_test_split(test_size=held, seed=cfg.seed, shuffle=True)
    return split["train"], split["test"]


def _joined(parts: list[Any], key: str) -> Any:
    import datasets

    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as exc:
        raise DataError(
            f"The `{key}` entries of online RL have different columns or column types ({exc}); the reward functions "
            "read one set of columns, so give every entry the same ones."
        ) from None
