"""Row formats (`type:` of a dataset entry). Each module turns one row into token ids and labels.

A formatter returns `{"input_ids": [...], "labels": [...]}` with -100 on tokens that are not trained, or raises
`RowError` for a row that cannot be used (the caller adds the dataset and row number).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hellbender.data.formats import (
    alpaca,
    chat_template,
    completion,
    mistral_chat,
    mistral_multimodal_chat,
    multimodal_chat,
    multimodal_pretrain,
    pretokenized,
)
from hellbender.data.formats.base import FormatContext, RowDropped, RowError, VisionContext

Formatter = Callable[[dict[str, Any], FormatContext], dict[str, list[int]]]


def _chat_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, list[int]]:
    # A mistral-common tokenizer (`tokenizer_use_mistral_common`) encodes conversations itself, without a template.
    if mistral_chat.is_mistral_common(ctx.tokenizer):
        return mistral_chat.tokenize_row(row, ctx)
    return chat_template.tokenize_row(row, ctx)


def _multimodal_chat_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, Any]:
    # With mistral-common, its own image encoder places the image tokens; otherwise the processor expands them.
    if mistral_chat.is_mistral_common(ctx.tokenizer):
        return mistral_multimodal_chat.tokenize_row(row, ctx)
    return multimodal_chat.tokenize_row(row, ctx)


FORMATTERS: dict[str, Formatter] = {
    "alpaca": alpaca.tokenize_row,
    "chat_template": _chat_row,
    "completion": completion.tokenize_row,
    "pretokenized": pretokenized.tokenize_row,
    "multimodal_chat": _multimodal_chat_row,
    "multimodal_pretrain": multimodal_pretrain.tokenize_row,
}
# Columns vision-language formats add beside input_ids / labels, with the value a dropped row gets.
VISION_COLUMNS: dict[str, Any] = {"images": [], "text": "", "pixels": [], "image_base_dir": ""}
EXTRA_COLUMNS: dict[str, dict[str, Any]] = {"multimodal_chat": VISION_COLUMNS, "multimodal_pretrain": VISION_COLUMNS}

__all__ = ["EXTRA_COLUMNS", "FORMATTERS", "FormatContext", "Formatter", "RowDropped", "RowError", "VisionContext"]
