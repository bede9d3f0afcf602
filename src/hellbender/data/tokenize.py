"""Turn one dataset entry's rows into tokens and labels, dropping (and counting) rows that cannot train."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hellbender.data.formats import EXTRA_COLUMNS, FORMATTERS, FormatContext, RowDropped, RowError
from hellbender.data.formats.base import DROP_TOO_LONG, IGNORE_INDEX, RowTooLong
from hellbender.data.progress import quiet_progress
from hellbender.data.teacher_targets import TARGET_COLUMNS, target_features, with_teacher_targets
from hellbender.errors import DataError

DROP_EMPTY = "empty"
DROP_NO_TRAINABLE = "no trainable tokens"
DROP_TOO_SHORT = "shorter than min_sample_len"
DROP_DUPLICATE = "duplicate"
ENCODE_BATCH_ROWS = 100  # rows per `datasets.map` batch: few enough to keep a batch of image rows small


@dataclass
class TokenizeStats:
    """What happened to the rows of the datasets, for `preprocess` and the run summary."""

    rows_in: int = 0
    rows_kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    tokens: int = 0
    trainable_tokens: int = 0

    def add(self, other: TokenizeStats) -> None:
        self.rows_in += other.rows_in
        self.rows_kept += other.rows_kept
        self.dropped.update(other.dropped)
        self.tokens += other.tokens
        self.trainable_tokens += other.trainable_tokens

    def drop(self, reason: str, rows: int, tokens: int, trainable_tokens: int) -> None:
        """Count kept rows dropped by a later step (e.g. deduplication)."""
        self.dropped[reason] += rows
        self.rows_kept -= rows
        self.tokens -= tokens
        self.trainable_tokens -= trainable_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows_in": self.rows_in,
            "rows_kept": self.rows_kept,
            "rows_dropped": dict(self.dropped),
            "tokens": self.tokens,
            "trainable_tokens": self.trainable_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenizeStats:
        return cls(
            rows_in=data["rows_in"],
            rows_kept=data["rows_kept"],
            dropped=Counter(data["rows_dropped"]),
            tokens=data["tokens"],
            trainable_tokens=data["trainable_tokens"],
        )


def fit_length(ids: list[int], labels: list[int], max_len: int, strategy: str) -> tuple[list[int], list[int], str]:
    """Apply `excess_length_strategy`; returns the (maybe truncated) row and a drop reason or ''."""
    if len(ids) <= max_len:
        return ids, labels, ""
    if strategy == "truncate":
        return ids[:max_len], labels[:max_len], ""
    return ids, labels, DROP_TOO_LONG


def count_targets(labels: list[int]) -> int:
    """How many tokens a row trains: the model predicts labels[1:] from the tokens before them, so labels[0] is never
    a target. Counted with `list.count` (in C, without copying): a row has thousands of labels."""
    first = 1 if labels and labels[0] != IGNORE_INDEX else 0
    return len(labels) - labels.count(IGNORE_INDEX) - first


def output_features(extra: dict[str, Any]):
    """Column types of tokenized rows, given up front: inferred from the first rows, an empty list (a text-only
    row's images) would fix a column's type before rows with images arrive."""
    import datasets

    ints = datasets.List(datasets.Value("int64"))
    features = {
        "input_ids": ints,
        "labels": ints,
        "length": datasets.Value("int64"),
        "trainable": datasets.Value("int64"),
        "drop_reason": datasets.Value("string"),
    }
    vision = {
        "images": datasets.List(datasets.Value("string")),
        "text": datasets.Value("string"),
        "image_base_dir": datasets.Value("string"),
        "pixels": datasets.List(
            {"width": datasets.Value("int32"), "height": datasets.Value("int32"), "rgb": datasets.Value("binary")}
        ),
    }
    known = {**vision, **target_features()}
    return datasets.Features({**features, **{key: known[key] for key in extra}})


def encode_row(
    row: dict[str, Any],
    index: int,
    formatter: Any,
    ctx: FormatContext,
    max_len: int,
    strategy: str,
    where: str,
    min_len: int = 1,
) -> dict[str, Any]:
    """One row as training uses it: the formatter's output (extra columns included) with `input_ids` and `labels`
    fitted to `max_len`, their `length`, the `trainable` token count and a `drop_reason` ('' for a kept row; rows of
    fewer than `min_len` tokens, counted before any truncation, are dropped). Prepared and streamed rows both go
    through here, so they are tokenized and masked alike."""
    reason = ""
    try:
        out = formatter(row, ctx)
    except RowError as exc:
        raise DataError(f"{where}, row {index}: {exc}.") from None
    except RowTooLong as exc:
        if strategy == "raise":
            raise DataError(
                f"{where}, row {index}: at least {exc.tokens} tokens with its images expanded, more than `sequence_len: "
                f"{max_len}`. Raise `sequence_len`, shorten the row, or set `excess_length_strategy: drop`."
            ) from None
        out, reason = {"input_ids": [], "labels": []}, str(exc)
    except RowDropped as exc:
        out, reason = {"input_ids": [], "labels": []}, str(exc)
    ids, labels = out["input_ids"], out["labels"]
    full_length = len(ids)
    if not reason and not ids:
        reason = DROP_EMPTY
    elif not reason:
        ids, labels, reason = fit_length(ids, labels, max_len, strategy)
        if reason and strategy == "raise":
            # Rows with images are never truncated (it could cut through an image), so only `drop` is offered.
            others = "`excess_length_strategy: drop`"
            if getattr(ctx, "vision", None) is None:
                others += " or `truncate`"
            raise DataError(
                f"{where}, row {index}: {len(ids)} tokens, more than `sequence_len: {max_len}`. Raise "
                f"`sequence_len`, shorten the row, or set {others}."
            )
    for key in TARGET_COLUMNS:  # the teacher's targets stay with their tokens through truncation
        if key in out:
            out[key] = out[key][: len(ids)] if not reason else []
    trainable = count_targets(labels)
    if not reason and trainable == 0:
        reason = DROP_NO_TRAINABLE
    if not reason and full_length < min_len:
        reason = DROP_TOO_SHORT
    return {
        **out,
        "input_ids": ids,
        "labels": labels,
        "length": len(ids),
        "trainable": trainable,
        "drop_reason": reason,
    }


def tokenize_dataset(
    ds,
    fmt: str,
    ctx: FormatContext,
    max_len: int,
    strategy: str,
    where: str,
    num_proc: int | None,
    min_len: int = 1,
):
    """Tokenize every row with format `fmt`; returns the kept rows (input_ids, labels, length) and stats. Rows of
    fewer than `min_len` tokens (counted before any truncation) are dropped."""
    formatter = FORMATTERS[fmt]
    extra = EXTRA_COLUMNS.get(fmt, {})
    if ctx.teacher is not None:
        formatter = with_teacher_targets(formatter, ctx.teacher)
        extra = {**extra, **{key: [] for key in TARGET_COLUMNS}}
    kept_keys = ("input_ids", "labels", "length", "trainable", "drop_reason")

    def encode(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        names = list(batch)
        rows = (dict(zip(names, values, strict=True)) for values in zip(*batch.values(), strict=True))
        columns: dict[str, list[Any]] = {key: [] for key in (*kept_keys, *extra)}
        for index, row in zip(indices, rows, strict=True):
            encoded = encode_row(row, index, formatter, ctx, max_len, strategy, where, min_len)
            for key in kept_keys:
                columns[key].append(encoded[key])
            for key, default in extra.items():
                columns[key].append(encoded.get(key, default))
        return columns

    # Rows are handed over in batches: `datasets` converts a batch from and to Arrow in one go, which costs far less
    # than converting one row at a time; each row is still encoded alone (`encode_row`).
    encoded = ds.map(
        encode,
        features=output_features(extra),
        with_indices=True,
        batched=True,
        batch_size=ENCODE_BATCH_ROWS,
        remove_columns=ds.column_names,
        num_proc=num_proc,
        desc=f"Tokenizing {where}",
    )
    # The small columns are read whole (`datasets` hands a column out row by row otherwise), and the kept rows are
    # picked by their indices: a `filter` would read every row again, in `num_proc` new processes.
    names = ("drop_reason", "length", "trainable")
    columns = encoded.with_format("arrow").select_columns(list(names))[:]
    reasons, lengths, trainable = (columns.column(name).to_pylist() for name in names)
    keep = [i for i, reason in enumerate(reasons) if not reason]
    stats = TokenizeStats(
        rows_in=len(encoded),
        rows_kept=len(keep),
        dropped=Counter(reason for reason in reasons if reason),
        tokens=sum(lengths[i] for i in keep),
        trainable_tokens=sum(trainable[i] for i in keep),
    )
    with quiet_progress():
        kept = encoded.select(keep)
    return kept.remove_columns(["drop_reason", "trainable"]), stats
