"""Preference data prepared for TRL's trainers: one row per pair (`prompt_ids`, `chosen_ids`, `rejected_ids`) or,
for KTO, per labelled answer (`prompt_ids`, `completion_ids`, `label`).

The answers' ids are the tokens after the prompt: `prompt_ids + chosen_ids` is the tokenized full conversation, and
the prompt is tokenized once, so chosen and rejected continue the same prompt tokens. A tokenizer or template that
tokenizes the prompt differently when an answer follows (tokens merging across the boundary, a template that renders
the last turn another way) is refused for the row, naming it, instead of shifting the answer silently.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hellbender.chat_templates import resolve_chat_template
from hellbender.config import DatasetEntry, HellbenderConfig
from hellbender.config.data import USER_DEFINED_KEYS
from hellbender.data.contexts import template_source
from hellbender.data.formats.base import DROP_TOO_LONG, FormatContext, RowError
from hellbender.data.formats.chat_template import DEFAULT_ROLE_ALIASES
from hellbender.data.formats.preference_rows import (
    FAMILY_MARKERS,
    PreferenceContext,
    PreferenceText,
    answer_names,
    read_preference_row,
)
from hellbender.data.progress import quiet_progress
from hellbender.data.tokenize import DROP_TOO_SHORT, TokenizeStats
from hellbender.errors import ConfigError, DataError

DROP_PROMPT_TOO_LONG = "prompt longer than max_prompt_len"
# Bump whenever the preference formats or their tokenization change what a prepared row holds.
PREFERENCE_FORMAT_VERSION = 1


def is_kto(cfg: HellbenderConfig) -> bool:
    """KTO's unpaired rows are read when the run is `rl: kto` (the same types give pairs otherwise)."""
    return getattr(cfg, "rl", None) == "kto"


@dataclass(frozen=True)
class Limits:
    """`sequence_len`, `max_prompt_len`, `excess_length_strategy` and `min_sample_len` as rows are fitted to them."""

    sequence_len: int
    max_prompt_len: int | None
    strategy: str
    min_len: int


def preference_context(entry: DatasetEntry, cfg: HellbenderConfig, tokenizer: Any) -> PreferenceContext:
    kind = entry.type
    mappings = {"role": "role", "content": "content", **(entry.message_property_mappings or {})}
    role_map = None
    if entry.roles:
        role_map = {role: role for role in DEFAULT_ROLE_ALIASES.values()}
        for target, aliases in entry.roles.items():
            role_map.update({alias: target for alias in aliases})
    messages = FormatContext(
        tokenizer=tokenizer,
        train_on_inputs=False,
        chat_template=None,
        field_messages=entry.field_messages,
        role_key=mappings["role"],
        content_key=mappings["content"],
        role_map=role_map,
        roles_to_train=("assistant",),
        train_on_eos=None,
        eot_ids=frozenset(),
        drop_system_message=bool(entry.drop_system_message),
        text_field=None,
        vision=None,
    )
    family = kind.partition(".")[0]
    if family in FAMILY_MARKERS:
        _check_family_markers(kind, family, tokenizer)
    template = source = None
    if kind.startswith(("chat_template.", "bradley_terry.")):
        name = entry.chat_template or cfg.chat_template
        jinja = entry.chat_template_jinja if entry.chat_template_jinja is not None else cfg.chat_template_jinja
        template = resolve_chat_template(name, jinja, tokenizer)
        source = template_source(name, jinja, False)
    fields = {key: getattr(entry, key) or default for key, default in USER_DEFINED_KEYS.items()}
    return PreferenceContext(
        tokenizer=tokenizer,
        kind=kind,
        kto=is_kto(cfg),
        fields=fields,
        messages=messages,
        template=template,
        template_source=source or "`chat_template`",
    )


def _check_family_markers(kind: str, family: str, tokenizer: Any) -> None:
    """A fixed-format type's markers must be single tokens; split into ordinary text, the model would learn its
    turns as prose."""
    known = set(tokenizer.get_added_vocab()) | set(getattr(tokenizer, "all_special_tokens", ()))
    missing = [m for m in FAMILY_MARKERS[family] if m not in known]
    if missing:
        raise ConfigError(
            f"`type: {kind}` writes the marker tokens {', '.join(f'`{m}`' for m in missing)}, which this tokenizer "
            "does not have as single tokens: training would see them as ordinary text. Use the type of the model's "
            "family (`chatml.*` for ChatML models, `llama3.*` for Llama 3), `chat_template.default` (the model's own "
            "template), or add the tokens with `special_tokens`."
        )


def _ids(tokenizer: Any, text: str, special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special_tokens)["input_ids"])


def tokenize_texts(texts: PreferenceText, tokenizer: Any) -> dict[str, Any]:
    """The prompt's ids and each answer's ids after them; refuses answers whose tokens do not continue the prompt's."""
    prompt_ids = _ids(tokenizer, texts.prompt, texts.special_tokens)
    out: dict[str, Any] = {"prompt_ids": prompt_ids}
    for name, full in texts.full.items():
        full_ids = _ids(tokenizer, full, texts.special_tokens)
        if not full.startswith(texts.prompt):
            raise RowError(
                f"the {name} conversation does not start with the prompt as rendered alone (the chat template renders "
                "the turns before an answer differently from the prompt it renders with a generation prompt, e.g. a "
                "thinking template that adds an empty reasoning block to the last answer), so the answer would not "
                "continue the prompt the model is given; use a template that renders the prompt the same way in both"
            )
        if full_ids[: len(prompt_ids)] != prompt_ids:
            raise RowError(
                f"the {name} answer's first tokens merge with the prompt's last ones (the prompt tokenized alone ends "
                f"{tokenizer.decode(prompt_ids[-3:])!r}; with the answer after it, those tokens read "
                f"{tokenizer.decode(full_ids[max(len(prompt_ids) - 3, 0) : len(prompt_ids)])!r}), so the answer "
                "would not continue the prompt's tokens; end the prompt on a token boundary (a newline or a special "
                "token, not a space)"
            )
        out[f"{name}_ids"] = full_ids[len(prompt_ids) :]
    if texts.label is not None:
        out["label"] = texts.label
    return out


def fit_preference_row(out: dict[str, Any], names: tuple[str, ...], limits: Limits, where: str, index: int) -> str:
    """Fit `out` to `max_prompt_len` and `sequence_len` in place as `excess_length_strategy` says; returns a drop
    reason or ''."""
    prompt = out["prompt_ids"]
    if limits.max_prompt_len is not None and len(prompt) > limits.max_prompt_len:
        if limits.strategy == "raise":
            raise DataError(
                f"{where}, row {index}: its prompt is {len(prompt)} tokens, more than `max_prompt_len: "
                f"{limits.max_prompt_len}`. Raise `max_prompt_len`, shorten the prompt, or set "
                "`excess_length_strategy: drop` or `truncate` (which keeps the prompt's last tokens)."
            )
        if limits.strategy == "drop":
            return DROP_PROMPT_TOO_LONG
        out["prompt_ids"] = prompt = prompt[-limits.max_prompt_len :]  # the end, next to the answer, is kept
    room = limits.sequence_len - len(prompt)
    for name in names:
        answer = out[f"{name}_ids"]
        if len(answer) <= room:
            continue
        if limits.strategy == "raise":
            raise DataError(
                f"{where}, row {index}: its prompt and {name} answer are {len(prompt) + len(answer)} tokens, more "
                f"than `sequence_len: {limits.sequence_len}`. Raise `sequence_len`, shorten the row, or set "
                "`excess_length_strategy: drop` or `truncate`."
            )
        if limits.strategy == "drop" or room <= 0:  # a prompt that fills `sequence_len` leaves no answer to keep
            return DROP_TOO_LONG
        out[f"{name}_ids"] = answer[:room]
    if any(len(prompt) + len(out[f"{name}_ids"]) < limits.min_len for name in names):
        return DROP_TOO_SHORT
    return ""


def encode_preference_row(
    row: dict[str, Any], index: int, ctx: PreferenceContext, limits: Limits, where: str
) -> dict[str, Any]:
    """One row as the trainers take it, plus `drop_reason` ('' for a kept row)."""
    try:
        out = tokenize_texts(read_preference_row(row, ctx), ctx.tokenizer)
    except RowError as exc:
        raise DataError(f"{where}, row {index}: {exc}.") from None
    reason = fit_preference_row(out, answer_names(ctx.kto), limits, where, index)
    return {**out, "drop_reason": reason}


def preference_features(kto: bool):
    import datasets

    ints = datasets.List(datasets.Value("int64"))
    columns = {"prompt_ids": ints}
    if kto:
        columns |= {"completion_ids": ints, "label": datasets.Value("bool")}
    else:
        columns |= {"chosen_ids": ints, "rejected_ids": ints}
    return datasets.Features({**columns, "drop_reason": datasets.Value("string")})


def row_token_counts(row: dict[str, Any]) -> tuple[int, int]:
    """(tokens, trained tokens) of a prepared row: each answer is a sequence of prompt and answer; the answers'
    tokens are the trained ones."""
    answers = [row[key] for key in ("chosen_ids", "rejected_ids", "completion_ids") if key in row]
    return sum(len(row["prompt_ids"]) + len(a) for a in answers), sum(len(a) for a in answers)


def tokenize_preference_dataset(
    ds: Any,
    ctx: PreferenceContext,
    limits: Limits,
    where: str,
    num_proc: int | None,
    encode_row: Callable[..., dict[str, Any]] | None = None,
    features: Any = None,
):
    """Every row of one dataset entry tokenized; returns the kept rows and their stats. `encode_row` and `features`:
    another row encoder (with `encode_preference_row`'s arguments) and its columns, for rows whose prompts hold
    images (`data/preference_images.py`); by default text rows."""
    encode_row = encode_row or encode_preference_row

    def encode(row: dict[str, Any], index: int) -> dict[str, Any]:
        return encode_row(row, index, ctx, limits, where)

    encoded = ds.map(
        encode,
        features=features or preference_features(ctx.kto),
        with_indices=True,
        remove_columns=ds.column_names,
        num_proc=num_proc,
        desc=f"Tokenizing {where}",
    )
    stats = TokenizeStats(rows_in=len(encoded), dropped=Counter(r for r in encoded["drop_reason"] if r))
    with quiet_progress():
        kept = encoded.filter(lambda r: not r, input_columns="drop_reason", num_proc=num_proc)
    kept = kept.remove_columns(["drop_reason"])
    stats.rows_kept = len(kept)
    for row in kept:
        tokens, trained = row_token_counts(row)
        stats.tokens += tokens
        stats.trainable_tokens += trained
    return kept, stats
