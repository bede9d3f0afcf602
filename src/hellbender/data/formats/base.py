"""What every row format shares: its inputs and its error type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IGNORE_INDEX = -100
# Rows of `skip_prepare_dataset` data carry this flag: their ids were tokenized by the user, possibly without the
# images expanded, so the collator aligns their labels to the processor's ids instead of checking them.
UNEXPANDED_KEY = "unexpanded"


class RowError(Exception):
    """A row that cannot be turned into training tokens; the message says why and what to fix."""


class RowDropped(Exception):
    """A row to leave out and count (the config asked to skip rows like it); the message is the reason."""


DROP_TOO_LONG = "longer than sequence_len"


class RowTooLong(RowDropped):
    """A row found longer than `sequence_len` before its expensive steps (decoding images, the processor); `tokens`
    is a lower bound on its length. Dropped or refused as `excess_length_strategy` says."""

    def __init__(self, tokens: int) -> None:
        super().__init__(DROP_TOO_LONG)
        self.tokens = tokens


@dataclass(frozen=True)
class VisionContext:
    """What rows of vision-language datasets need beyond the tokenizer."""

    processor: Any
    policy: Any  # hellbender.data.images.ImagePolicy
    vision_ids: frozenset[int]  # never trained: image tokens plus the config's `vision_tokens_to_mask`
    image_ids: frozenset[int]  # the processor's own image / video tokens
    placeholder_id: int
    image_column: str
    skip_bad_images: bool
    max_tokens: int  # `sequence_len`; multimodal_pretrain refuses longer rows itself
    cache_images: bool  # store the decoded images in the prepared row (`cache_images`)


@dataclass(frozen=True)
class FormatContext:
    """A dataset entry's settings as its format reads them, built by `data.contexts.format_context` from the entry
    with its defaults filled (`config/defaults.py`); a setting a format does not use is None."""

    tokenizer: Any
    train_on_inputs: bool
    # chat_template only
    chat_template: str | None
    field_messages: str | None  # None: `messages`, else `conversations`, whichever the row holds
    role_key: str | None
    content_key: str | None
    role_map: dict[str, str] | None  # None: the built-in role names
    roles_to_train: tuple[str, ...]
    train_on_eos: str | None
    eot_ids: frozenset[int]  # `eot_tokens`; empty: the first special token after a turn ends it
    drop_system_message: bool  # leave system messages out of the conversation
    # completion / multimodal_pretrain only
    text_field: str | None
    # vision-language rows only
    vision: VisionContext | None
    # chat_template: the message key holding an assistant's reasoning (`field_thinking`) and the name the template
    # reads it under (`template_thinking_key`); None: messages carry no reasoning
    thinking_field: str | None = None
    thinking_key: str | None = None
    # chat_template: where the template came from, for errors (`chat_template_jinja`, `chat_template: chatml`, ...)
    template_source: str = "`chat_template`"
    # chat_template: the column holding a row's tool list (`field_tools`); None: rows carry no tools
    tools_field: str | None = None
    # knowledge distillation: how the rows carry the teacher's top-k (`data/teacher_targets.TeacherTargets`); None:
    # they carry none
    teacher: Any = None
    # The tokenizer's special token ids, which labelling reads for every row, computed once by `format_context` (with
    # hundreds of added tokens they cost about 150 µs a row); None: computed where needed (`special_ids_of`).
    special_ids: frozenset[int] | None = None


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special tokens: its named ones and every added token marked special."""
    added = {i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False)}
    return frozenset(tokenizer.all_special_ids) | added


def special_ids_of(ctx: FormatContext) -> frozenset[int]:
    return ctx.special_ids if ctx.special_ids is not None else special_token_ids(ctx.tokenizer)


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
