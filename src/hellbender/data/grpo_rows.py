"""The prompt rows of online RL (`rl: grpo`, `rl: rloo`): each `datasets` entry's rows as they are, or as its
`type: module.function` transform makes them (`prompt_transforms.py`): a `prompt` column, text or a list of chat
messages, and whatever other columns the reward functions read; for a vision-language model, the prompt's images
(`grpo_images.py`). The entries are joined in order, with each row's index added so a failing reward function can
name the row. Nothing is tokenized here: TRL applies the run's tokenizer
and chat template to each prompt as it generates."""

from __future__ import annotations

from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.config.data import is_transform_type
from hellbender.data.grpo_images import TRL_IMAGE_COLUMNS, prompt_image_rows
from hellbender.data.prompt_transforms import transformed_rows
from hellbender.data.sources import load_rows
from hellbender.errors import DataError

# Each prompt row's index in the training data, so a failing reward function can name the row; the trainer strips it.
ROW_COLUMN = "hellbender_row"


def grpo_rows(cfg: HellbenderConfig, tokenizer: Any = None) -> Any:
    """`tokenizer`: the run's, for transforms that take one."""
    parts = []
    for i, entry in enumerate(cfg.datasets):
        where = f"`datasets[{i}]` (`{entry.path}`)"
        rows = load_rows(entry, where=where)
        transformed = is_transform_type(entry.type)
        if transformed:
            rows = transformed_rows(cfg, i, rows, tokenizer)
        if "prompt" not in rows.column_names:
            made = f" after its transform `{entry.type}`" if transformed else ""
            fix = "Make the transform return a `prompt`." if transformed else "Rename the column, or add it."
            raise DataError(
                f"{where} has no `prompt` column{made} (its columns: {', '.join(rows.column_names)}): `rl: {cfg.rl}` "
                f"generates from each row's `prompt`, text or a list of chat messages. {fix}"
            )
        if ROW_COLUMN in rows.column_names:
            raise DataError(f"{where} has a column `{ROW_COLUMN}`, a name hellbender uses itself. Rename it.")
        if cfg.is_multimodal:
            rows = prompt_image_rows(rows, entry, cfg, where)
        elif images := [c for c in TRL_IMAGE_COLUMNS if c in rows.column_names]:
            raise DataError(
                f"{where} has a column `{images[0]}`, which TRL reads as the prompt's images, and this config trains a "
                "text model. Set `processor_type` to train a vision-language model on them, or rename the column."
            )
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
