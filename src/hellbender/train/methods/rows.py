"""The prepared preference rows the method trainers take as they are.

Paired rows (ORPO, SimPO, reward model): `prompt_ids`, `chosen_ids`, `rejected_ids`, where chosen and rejected are
the completion tokens only, continuing the prompt. Unpaired rows (KTO): `prompt_ids`, `completion_ids`, `label`.
The prompt is never trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from datasets import Dataset

PAIRED_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
UNPAIRED_COLUMNS = ("prompt_ids", "completion_ids", "label")
IGNORE_INDEX = -100


def require_columns(dataset: Dataset, columns: Sequence[str], method: str) -> None:
    """A programming error, not a user one: the data layer prepares these columns for every preference format."""
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"{method} takes prepared rows with columns {list(columns)}; this dataset lacks {missing} "
            f"(it has {dataset.column_names})."
        )


def legacy_pair_columns(row: dict[str, Any]) -> dict[str, list[int]]:
    """The columns TRL's legacy pair trainers (ORPO, CPO) read after their own `tokenize_row`, built from one
    prepared pair without adding, dropping or truncating a token: each answer's sequence is the prompt followed by
    the answer, and its labels hide the prompt (-100) so that only answer tokens are scored."""
    prompt = list(row["prompt_ids"])
    columns = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
    for side in ("chosen", "rejected"):
        answer = list(row[f"{side}_ids"])
        columns[f"{side}_input_ids"] = prompt + answer
        columns[f"{side}_attention_mask"] = [1] * (len(prompt) + len(answer))
        columns[f"{side}_labels"] = [IGNORE_INDEX] * len(prompt) + answer
    return columns


class PreTokenizedPairs:
    """For TRL's legacy pair trainers (ORPO, CPO): their `tokenize_row`, which tokenizes text and adds BOS/EOS
    tokens and truncates, becomes the column conversion of a prepared pair. Their initialisation maps it over the
    datasets; the prompt-extraction and chat-template passes before it leave rows without text columns unchanged."""

    def tokenize_row(self, feature: dict[str, Any], model: Any = None) -> dict[str, list[int]]:
        return legacy_pair_columns(feature)
