"""Sample packing: several tokenized rows share one `sequence_len` bin.

Bins are filled best-fit-decreasing (the longest rows first, each into the fullest bin it still fits), which
wastes few tokens, or, with `sample_packing_sequentially`, in row order (each row into the current bin, or the
next one when it does not fit), which keeps the rows' order at the cost of emptier bins. Both are deterministic,
so packed data can be cached and resumed exactly. Each packed row
keeps `seq_lens`, the length of every document in it: the collator uses them to restart position ids and
to keep attention inside each document. Packed vision-language rows also keep `documents`, each document's rendered
text and images in order, which the collator processes again at batch time (`data/multimodal_packed_collator.py`).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Iterable, Sequence
from typing import Any

from hellbender.data.formats.base import IGNORE_INDEX
from hellbender.data.progress import quiet_progress
from hellbender.data.teacher_targets import TARGET_COLUMNS


def pack_lengths(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group row indices into bins whose total length is at most `capacity` (best-fit decreasing: each row, longest
    first, goes into the bin with the least room that still fits it, the earliest such bin on a tie)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    # Bins by the room they have left: `waiting[r]` holds the ids of the bins with r tokens of room (a heap, so the
    # earliest comes first), and bit r of `roomy` is set while there are any, so the tightest bin that fits n is
    # the lowest set bit at or above n: a few integer operations instead of a search through every bin.
    waiting: dict[int, list[int]] = {}
    roomy = 0
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"row {i} has {n} tokens, more than the bin capacity {capacity}")
        fitting = roomy >> n
        if fitting:
            room = n + (fitting & -fitting).bit_length() - 1
            bin_id = heapq.heappop(waiting[room])
            if not waiting[room]:
                roomy &= ~(1 << room)
            bins[bin_id].append(i)
        else:
            room, bin_id = capacity, len(bins)
            bins.append([i])
        heapq.heappush(waiting.setdefault(room - n, []), bin_id)
        roomy |= 1 << (room - n)
    return bins


def pack_lengths_in_order(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group row indices into bins whose total length is at most `capacity`, keeping their order (next fit): every
    bin holds consecutive rows, and bin k's rows all come before bin k+1's."""
    bins: list[list[int]] = []
    remaining = 0
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"row {i} has {n} tokens, more than the bin capacity {capacity}")
        if bins and n <= remaining:
            bins[-1].append(i)
            remaining -= n
        else:
            bins.append([i])
            remaining = capacity - n
    return bins


def concat_documents(input_ids: Sequence[list[int]], labels: Sequence[list[int]]) -> dict[str, list]:
    """One packed row from documents in order.

    The first label of every document is masked: in a packed row it would otherwise be predicted from the
    previous document's last token, which the unpacked row never does.
    """
    ids: list[int] = []
    labs: list[int] = []
    for doc_ids, doc_labels in zip(input_ids, labels, strict=True):
        ids += doc_ids
        labs += [IGNORE_INDEX] + list(doc_labels[1:])
    return {"input_ids": ids, "labels": labs, "seq_lens": [len(x) for x in input_ids]}


# What a prepared vision-language row keeps for batch time besides its tokens (`formats/multimodal_chat.vision_row`).
DOCUMENT_KEYS = ("text", "images", "image_base_dir", "pixels")


def pack_dataset(ds, capacity: int, num_proc: int | None = None, in_order: bool = False):
    """Pack a tokenized `datasets.Dataset` (with a `length` column) into bins of at most `capacity` tokens; with
    `in_order`, keeping the rows' order (`pack_lengths_in_order`). Vision-language rows (a `text` column) keep
    their documents' texts and images in `documents`; `length` counts their image tokens, so bins are filled by
    each row's whole length."""
    import datasets

    # Read whole: `datasets` hands a column out lazily, one Arrow lookup per element (1.7 s for 20,000 rows).
    lengths = ds.with_format("arrow")["length"].to_pylist()
    bins = (pack_lengths_in_order if in_order else pack_lengths)(lengths, capacity)
    index = datasets.Dataset.from_dict({"rows": bins})
    if "text" in ds.column_names:  # vision-language rows: documents kept for batch time, packed in Python
        gather, features = _document_gatherer(ds), _packed_features(ds)
    else:  # token rows: joined column by column in Arrow, without a Python list per token
        # A teacher's per-token targets (knowledge distillation) are concatenated like the tokens, so each
        # document's targets stay on its own tokens.
        targets = [key for key in TARGET_COLUMNS if key in ds.column_names]
        index = index.with_format("arrow")
        gather, features = _token_gatherer(ds, targets), _packed_target_features(ds) if targets else None
        num_proc = None  # joined in Arrow faster than worker processes start (and receive the dataset)
    with quiet_progress():
        return index.map(
            gather,
            batched=True,
            remove_columns=["rows"],
            num_proc=num_proc,
            desc="Packing",
            features=features,
        ).with_format(None)  # rows as Python lists again, whatever the batch function read


def _document_gatherer(ds):
    """`pack_dataset`'s batch function for vision-language rows: each bin's documents concatenated
    (`concat_documents`), with their texts and images kept in `documents`. (They carry no teacher targets:
    distillation of vision-language models is refused.)"""

    def gather(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "seq_lens": [], "documents": []}
        for rows in batch["rows"]:
            docs = ds[rows]
            packed = concat_documents(docs["input_ids"], docs["labels"])
            packed["documents"] = [{k: docs[k][j] for k in DOCUMENT_KEYS} for j in range(len(rows))]
            for key in out:
                out[key].append(packed[key])
        return out

    return gather


def _token_gatherer(ds, targets: list[str]):
    """`pack_dataset`'s batch function for text rows, in Arrow: a batch of bins becomes one `take` of their rows in
    bin order, whose token lists are re-cut at the bins' boundaries. The same packed rows as `concat_documents`
    (each document's first label masked), at a small fraction of the time for long rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    source = ds.with_format("arrow")

    def gather(batch: pa.Table) -> pa.Table:
        bins = batch.column("rows").to_pylist()
        docs = source[[row for members in bins for row in members]]
        doc_lengths = pc.list_value_length(docs.column("input_ids")).to_numpy().astype(np.int64)
        doc_starts = np.concatenate(([0], np.cumsum(doc_lengths)))
        bin_docs = np.concatenate(([0], np.cumsum([len(members) for members in bins])))
        bin_tokens = pa.array(doc_starts[bin_docs], pa.int32())

        def per_bin(column: pa.ChunkedArray, value_type: pa.DataType | None = None) -> pa.Array:
            values = pc.list_flatten(column).combine_chunks()
            return pa.ListArray.from_arrays(bin_tokens, values if value_type is None else values.cast(value_type))

        labels = pc.list_flatten(docs.column("labels")).to_numpy().astype(np.int64)  # a copy, to mask in place
        labels[doc_starts[:-1]] = IGNORE_INDEX  # never predicted from the previous document's last token
        columns = {
            "input_ids": per_bin(docs.column("input_ids"), pa.int64()),
            "labels": pa.ListArray.from_arrays(bin_tokens, pa.array(labels)),
            "seq_lens": pa.ListArray.from_arrays(pa.array(bin_docs, pa.int32()), pa.array(doc_lengths)),
        }
        for key in targets:  # per token a list of the teacher's k entries: re-cut like the tokens
            columns[key] = per_bin(docs.column(key))
        return pa.table(columns)

    return gather


def _packed_features(ds):
    """Column types of packed vision-language rows, given up front (an empty image list would otherwise fix its
    column's type before a row with images arrives)."""
    import datasets

    ints = datasets.List(datasets.Value("int64"))
    document = {key: ds.features[key] for key in DOCUMENT_KEYS}
    return datasets.Features(
        {"input_ids": ints, "labels": ints, "seq_lens": ints, "documents": datasets.List(document)}
    )


def _packed_target_features(ds):
    """Column types of packed text rows that carry a teacher's targets (kept at their prepared precision)."""
    import datasets

    ints = datasets.List(datasets.Value("int64"))
    targets = {key: ds.features[key] for key in TARGET_COLUMNS}
    return datasets.Features({"input_ids": ints, "labels": ints, "seq_lens": ints, **targets})


def pack_stream(documents: Iterable[dict[str, list[int]]], capacity: int, separate_documents: bool = True):
    """Pack an iterator of `{"input_ids", "labels"}` documents, in order, into full bins.

    For streamed pretraining: every bin is filled to `capacity` (a document that does not fit continues in
    the next bin), so no position is padding except in the very last bin. With `separate_documents`, each piece
    of a document is its own attention block and its first label is masked like any document start; without,
    the whole bin is one causal sequence (`pretrain_multipack_attn: false`): a document's first token is
    predicted from the end of the one before it, as in plain concatenated pretraining.
    """
    ids: list[int] = []
    labs: list[int] = []
    lens: list[int] = []
    for doc in documents:
        doc_ids, doc_labels = doc["input_ids"], doc["labels"]
        start = 0
        while start < len(doc_ids):
            take = min(capacity - len(ids), len(doc_ids) - start)
            first = doc_labels[start] if ids and not separate_documents else IGNORE_INDEX
            ids += doc_ids[start : start + take]
            labs += [first] + list(doc_labels[start + 1 : start + take])
            lens.append(take)
            start += take
            if len(ids) == capacity:
                yield {"input_ids": ids, "labels": labs, "seq_lens": lens if separate_documents else [capacity]}
                ids, labs, lens = [], [], []
    if ids:
        yield {"input_ids": ids, "labels": labs, "seq_lens": lens if separate_documents else [len(ids)]}


def pack_buffered(rows: Iterable[dict[str, Any]], capacity: int, buffer_size: int, rng: random.Random):
    """Pack streamed rows `buffer_size` at a time: each buffer is packed best-fit decreasing like prepared rows
    (a row is never split: its prompt and answer stay in one bin) and its bins are served in `rng`'s order, as
    the prepared path's sampler serves them. A larger buffer fills bins better; a smaller one keeps less in
    memory and starts training sooner."""
    rows = iter(rows)
    while buffer := list(itertools.islice(rows, buffer_size)):
        bins = pack_lengths([len(row["input_ids"]) for row in buffer], capacity)
        rng.shuffle(bins)
        for members in bins:
            yield concat_documents([buffer[i]["input_ids"] for i in members], [buffer[i]["labels"] for i in members])
