"""What every row format shares: its inputs and its error type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IGNORE_INDEX = -100


class RowError(Exception):
    """A row that cannot be turned into training tokens; the message says why and what to fix."""


@dataclass(frozen=True)
class FormatContext:
    tokenizer: Any
    train_on_inputs: bool
    # chat_template only
    chat_template: str | None = None
    field_messages: str | None = None
    role_key: str = "role"
    content_key: str = "content"
    role_map: dict[str, str] | None = None
    roles_to_train: tuple[str, ...] = ("assistant",)
    train_on_eos: str = "turn"
    # completion only
    text_field: str = "text"


def require_eos(tokenizer: Any) -> int:
    if tokenizer.eos_token_id is None:
        raise RowError("the tokenizer has no EOS token; set one with `special_tokens: {eos_token: ...}`")
    return tokenizer.eos_token_id


def text_value(row: dict[str, Any], key: str) -> str:
    if key not in row:
        raise RowError(f"column `{key}` is missing (columns: {', '.join(sorted(row))})")
    value = row[key]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RowError(f"column `{key}` must hold text, not {type(value).__name__}")
    return value
