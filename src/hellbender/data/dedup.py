"""Exact deduplication of tokenized rows (`dataset_exact_deduplication`).

Two rows are duplicates when every column of the tokenized row is equal: the same tokens with different labels (one
dataset trains the prompt, another does not) are two rows. The first of each group of duplicates is kept, so the
result does not depend on the number of worker processes.
"""

from __future__ import annotations

import hashlib
from typing import Any

from hellbender.data.formats.base import IGNORE_INDEX
from hellbender.data.progress import quiet_progress
from hellbender.data.tokenize import DROP_DUPLICATE, TokenizeStats

HASH_COLUMN = "_row_hash"


def _row_hashes(batch: dict[str, list], columns: list[str]) -> dict[str, list[str]]:
    rows = zip(*(batch[c] for c in columns), strict=True)
    return {HASH_COLUMN: [hashlib.sha256(repr(row).encode()).hexdigest() for row in rows]}


def first_occurrences(hashes: list[str]) -> list[int]:
    """Indices of the rows whose hash has not been seen before them."""
    seen: set[str] = set()
    keep = []
    for i, h in enumerate(hashes):
        if h not in seen:
            seen.add(h)
            keep.append(i)
    return keep


def drop_exact_duplicates(ds: Any, stats: TokenizeStats, num_proc: int | None = None) -> Any:
    """`ds` without rows equal to an earlier row; the dropped rows are counted in `stats` as duplicates."""
    if len(ds) == 0:  # every row was dropped before; `map` would then add no hash column at all
        return ds
    columns = sorted(ds.column_names)
    with quiet_progress():
        hashes = ds.map(
            _row_hashes, batched=True, fn_kwargs={"columns": columns}, remove_columns=ds.column_names, num_proc=num_proc
        )[HASH_COLUMN]
    keep = first_occurrences(hashes)
    if len(keep) == len(ds):
        return ds
    kept = set(keep)
    dropped = ds.select([i for i in range(len(ds)) if i not in kept])
    if "labels" not in dropped.column_names:  # preference rows: prompt and answers instead of tokens and labels
        from hellbender.data.preference import row_token_counts

        counts = [row_token_counts(row) for row in dropped]
        stats.drop(DROP_DUPLICATE, len(dropped), sum(c[0] for c in counts), sum(c[1] for c in counts))
        return ds.select(keep).flatten_indices()
    trainable = sum(sum(1 for label in labels[1:] if label != IGNORE_INDEX) for labels in dropped["labels"])
    stats.drop(DROP_DUPLICATE, len(dropped), sum(dropped["length"]), trainable)
    return ds.select(keep).flatten_indices()
