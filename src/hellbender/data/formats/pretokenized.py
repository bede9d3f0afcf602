"""Rows that already hold `input_ids` (and optionally `attention_mask` and `labels`) are passed through."""

from __future__ import annotations

from typing import Any

from hellbender.data.formats.base import IGNORE_INDEX, FormatContext, RowError


def _int_list(row: dict[str, Any], key: str) -> list[int]:
    value = row[key]
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise RowError(f"column `{key}` must be a list of integers")
    return value


def tokenize_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, list[int]]:
    if "input_ids" not in row:
        raise RowError(f"column `input_ids` is missing (columns: {', '.join(sorted(row))})")
    ids = _int_list(row, "input_ids")
    vocab = len(ctx.tokenizer)
    if any(i < 0 or i >= vocab for i in ids):
        raise RowError(f"`input_ids` holds ids outside the tokenizer's vocabulary of {vocab}")
    labels = _int_list(row, "labels") if row.get("labels") is not None else list(ids)
    if len(labels) != len(ids):
        raise RowError(f"`labels` has {len(labels)} entries but `input_ids` has {len(ids)}")
    if row.get("attention_mask") is not None:
        mask = _int_list(row, "attention_mask")
        if len(mask) != len(ids):
            raise RowError(f"`attention_mask` has {len(mask)} entries but `input_ids` has {len(ids)}")
        # Padding baked into the row is removed; the collator pads each batch itself.
        keep = [i for i, m in enumerate(mask) if m]
        ids = [ids[i] for i in keep]
        labels = [labels[i] for i in keep]
    return {"input_ids": ids, "labels": [label if label >= 0 else IGNORE_INDEX for label in labels]}
