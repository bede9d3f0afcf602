"""Streamed training data; the run's length comes from `max_steps`, and every stream cycles through its data
(pass p shuffled with `seed + p`) until then, so the Trainer sees one endless epoch.

Raw text (`pretraining_dataset:`): documents are read lazily, tokenized with EOS appended, and packed in order
into full `sequence_len` bins (long documents continue in the next bin). A resumed run replays the stream up to
its position (the Trainer skips the batches already trained on), which is exact because every pass is the
same for the same seed.

Supervised rows (`datasets:` with `streaming: true`): see `streaming_sft`.

Raw image+text (`multimodal_pretrain`): each row is encoded like a prepared row (images checked, tokens
expanded), cached under `dataset_prepared_path` (see `stream_cache`), and carries its position in the stream,
`stream_row`. The trainer records how many rows it has
trained on in every checkpoint, so a resumed run starts at the next unseen row: the rows before it are read
and skipped without opening, decoding or processing a single image.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count
from typing import Any

import torch

from hellbender.config import DatasetEntry, HellbenderConfig, PretrainingDatasetEntry
from hellbender.data.contexts import format_context
from hellbender.data.formats import FORMATTERS, RowDropped, RowError
from hellbender.data.formats.base import RowTooLong
from hellbender.data.packing import pack_stream
from hellbender.data.sources import load_rows, stream_rows
from hellbender.data.stream_cache import StreamCache, stream_cache_dir
from hellbender.data.streaming_sft import StreamingSFTDataset, open_sft_streams
from hellbender.errors import DataError

STREAM_ROW_KEY = "stream_row"


def _where(i: int, entry: PretrainingDatasetEntry) -> str:
    return f"Dataset pretraining_dataset[{i}] `{entry.path}`"


def shuffle_buffer(cfg: HellbenderConfig) -> int | None:
    """The shuffle buffer of every stream: `streaming_multipack_buffer_size` rows, none without shuffling."""
    return cfg.streaming_multipack_buffer_size if cfg.shuffle_merged_datasets else None


class StreamingPretrainDataset(torch.utils.data.IterableDataset):
    """Raw text, packed into full bins, cycling without end."""

    def __init__(self, cfg: HellbenderConfig, tokenizer: Any) -> None:
        self.entries = cfg.pretraining_dataset
        self.tokenizer = tokenizer
        self.sequence_len = cfg.sequence_len
        self.seed = cfg.seed
        self.buffer = shuffle_buffer(cfg)
        self.separate_documents = cfg.pretrain_multipack_attn

    def _documents_of_pass(self, epoch: int) -> Iterator[dict[str, list[int]]]:
        eos = self.tokenizer.eos_token_id
        for i, entry in enumerate(self.entries):
            for number, row in enumerate(stream_rows(entry, _where(i, entry), self.seed + epoch, self.buffer)):
                if entry.text_column not in row:
                    raise DataError(
                        f"pretraining_dataset[{i}] `{entry.path}`, row {number}: column `{entry.text_column}` is "
                        f"missing (columns: {', '.join(sorted(row))}). Set `text_column`."
                    )
                text = row[entry.text_column]
                if not text:
                    continue
                ids = self.tokenizer(text, add_special_tokens=True)["input_ids"] + [eos]
                yield {"input_ids": ids, "labels": ids}

    def _documents(self) -> Iterator[dict[str, list[int]]]:
        for epoch in count():
            empty = True
            for document in self._documents_of_pass(epoch):
                empty = False
                yield document
            if empty:
                raise DataError(
                    "Every document of the streamed `pretraining_dataset` is empty; nothing is left to train on. "
                    "Check `text_column` (default `text`)."
                )

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        return pack_stream(self._documents(), self.sequence_len, self.separate_documents)


class StreamingMultimodalDataset(torch.utils.data.IterableDataset):
    """Raw image+text rows, one sample each, numbered in stream order and cycling without end."""

    def __init__(self, cfg: HellbenderConfig, tokenizer: Any, processor: Any, start_row: int = 0) -> None:
        self.entries = cfg.pretraining_dataset
        self.contexts = [
            format_context(
                DatasetEntry(**e.model_dump(exclude={"type"}), type="multimodal_pretrain"), cfg, tokenizer, processor
            )
            for e in self.entries
        ]
        self.seed = cfg.seed
        self.sequence_len, self.raise_too_long = cfg.sequence_len, cfg.excess_length_strategy == "raise"
        self.buffer = shuffle_buffer(cfg)
        self.start_row = start_row  # rows already trained on (from the checkpoint being resumed)
        self.cache = StreamCache(stream_cache_dir(cfg, tokenizer, processor))

    def _raw_rows(self) -> Iterator[tuple[int, int, int, dict[str, Any]]]:
        """(pass, entry index, row number within the entry, row), forever: pass p shuffles with seed + p."""
        for epoch in count():
            for i, entry in enumerate(self.entries):
                for number, row in enumerate(stream_rows(entry, _where(i, entry), self.seed + epoch, self.buffer)):
                    yield epoch, i, number, row

    def _encode(self, i: int, number: int, row: dict[str, Any], position: int) -> dict[str, Any] | None:
        try:
            sample = FORMATTERS["multimodal_pretrain"](row, self.contexts[i])
        except RowError as exc:
            raise DataError(f"pretraining_dataset[{i}] `{self.entries[i].path}`, row {number}: {exc}.") from None
        except RowTooLong as exc:  # found before its images were decoded
            sample = self._too_long(i, number, f"at least {exc.tokens}")
        except RowDropped:
            sample = None
        if sample is not None and len(sample["input_ids"]) > self.sequence_len:
            sample = self._too_long(i, number, str(len(sample["input_ids"])))
        self.cache.append(position, sample)
        return sample

    def _too_long(self, i: int, number: int, tokens: str) -> None:
        """A row longer than `sequence_len` is dropped (never truncated through an image), or refused by name."""
        if self.raise_too_long:
            raise DataError(
                f"pretraining_dataset[{i}] `{self.entries[i].path}`, row {number}: {tokens} tokens with its images "
                f"expanded, more than `sequence_len: {self.sequence_len}`. Raise `sequence_len`, shorten the row, or "
                "set `excess_length_strategy: drop`."
            )
        return None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        known = self.cache.load()
        current_pass, usable_in_pass = 0, 0
        for position, (epoch, i, number, row) in enumerate(self._raw_rows()):
            if epoch != current_pass:
                if usable_in_pass == 0:
                    raise DataError(
                        "Every row of the streamed `pretraining_dataset` was dropped; nothing is left to train on."
                    )
                current_pass, usable_in_pass = epoch, 0
            if position < self.start_row:
                usable_in_pass += 1
                continue  # trained on before the checkpoint: skipped without touching its images
            sample = known[position] if position in known else self._encode(i, number, row, position)
            if sample is None:
                continue  # dropped by skip_bad_images
            usable_in_pass += 1
            yield {"pixels": [], **sample, STREAM_ROW_KEY: position}


class StreamingPackedMultimodalDataset(torch.utils.data.IterableDataset):
    """Streamed image+text rows packed as they arrive: each row joins the current bin while it fits, else starts the
    next (next fit, the rows' order kept), so a bin always begins at the row after the previous bin's last. A run
    resumed at the next unseen row (`rows_consumed`) therefore rebuilds exactly the bins the uninterrupted run had,
    without opening the images of any row before it. Only the bin being filled is held: a best fit over a buffer of
    rows would put later rows into earlier bins, and no single row would then mark where a resumed run starts. A row
    is never split; every row already fits `sequence_len` (longer ones were dropped or refused by
    `StreamingMultimodalDataset`)."""

    def __init__(self, rows: StreamingMultimodalDataset, capacity: int) -> None:
        self.rows, self.capacity = rows, capacity

    def __iter__(self) -> Iterator[dict[str, Any]]:
        docs: list[dict[str, Any]] = []
        used = 0
        for sample in self.rows:
            n = len(sample["input_ids"])
            if docs and used + n > self.capacity:
                yield _bin(docs)
                docs, used = [], 0
            docs.append(sample)
            used += n
        if docs:  # the stream cycles without end; kept for a finite one
            yield _bin(docs)


def _bin(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"seq_lens": [len(d["input_ids"]) for d in docs], "documents": docs}


def streaming_dataset(cfg: HellbenderConfig, tokenizer: Any, processor: Any = None, start_row: int = 0):
    if cfg.streams_datasets:
        return StreamingSFTDataset(cfg, tokenizer, open_sft_streams(cfg, tokenizer))
    if tokenizer.eos_token_id is None:
        raise DataError("The tokenizer has no EOS token to end documents with; set `special_tokens: {eos_token: ...}`.")
    # Rows are read lazily, at the first training step; open every source now, so that a missing, empty or
    # unreadable file fails before the model is loaded and anything is written.
    for i, entry in enumerate(cfg.pretraining_dataset):
        load_rows(entry, streaming=True, where=_where(i, entry))
    if processor is not None:
        rows = StreamingMultimodalDataset(cfg, tokenizer, processor, start_row)
        return StreamingPackedMultimodalDataset(rows, cfg.sequence_len) if cfg.sample_packing else rows
    return StreamingPretrainDataset(cfg, tokenizer)
