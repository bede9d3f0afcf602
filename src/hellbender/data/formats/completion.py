"""`type: completion`: raw text, every token trained, EOS appended (continued pretraining)."""

from __future__ import annotations

from typing import Any

from hellbender.data.formats.base import FormatContext, require_eos, text_value


def tokenize_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, list[int]]:
    text = text_value(row, ctx.text_field)
    if not text:
        return {"input_ids": [], "labels": []}
    ids = ctx.tokenizer(text, add_special_tokens=True)["input_ids"] + [require_eos(ctx.tokenizer)]
    return {"input_ids": ids, "labels": list(ids)}
