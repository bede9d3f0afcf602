"""The prompt rows of `rl: grpo`: each `datasets` entry's rows as they are (a `prompt` column, text or a list of chat
messages, and whatever other columns the reward functions read), joined in order, with each row's index added so a
failing reward function can name the row. Nothing is tokenized here: TRL applies the run's tokenizer and chat
template to each prompt as it generates."""

from __future__ import annotations

from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.data.sources import load_rows
from hellbender.errors import DataError

# Each prompt row's index in the training data, so a failing reward function can name the row; the trainer strips it.
ROW_COLUMN = "hellbender_row"


def grpo_rows(cfg: HellbenderConfig) -> Any:
    parts = []
    for i, entry in enumerate(cfg.datasets):
        where = f"`datasets[{i}]` (`{entry.path}`)"
        rows = load_rows(entry, where=where)
        if "prompt" not in rows.column_names:
            raise DataError(
                f"{where} has no `prompt` column (its columns: {', '.join(rows.column_names)}): `rl: grpo` generates "
                "from each row's `prompt`, text or a list of chat messages. Rename the column, or add it."
            )
        if ROW_COLUMN in rows.column_names:
            raise DataError(f"{where} has a column `{ROW_COLUMN}`, a name hellbender uses itself. Rename it.")
        parts.append(rows)
    joined = parts[0] if len(parts) == 1 else _joined(parts)
    return joined.add_column(ROW_COLUMN, list(range(len(joined))))


def _joined(parts: list[Any]) -> Any:
    import datasets

    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as exc:
        raise DataError(
            f"The `datasets` entries of `rl: grpo` have different columns or column types ({exc}); the reward "
            "functions read one set of columns, so give every entry the same ones."
        ) from None
