"""Streamed supervised fine-tuning: the `datasets:` rows of a config with `streaming: true`.

Each entry's rows are read lazily (shuffled through a buffer of `streaming_multipack_buffer_size` rows with
`shuffle_merged_datasets`), then formatted, tokenized, fitted to `sequence_len` and masked by the code that
prepares rows (`tokenize.encode_row`): a streamed row gets exactly the labels its prepared copy gets, and a row
that preparing would drop (too long, empty, nothing to train) is dropped here too. Entries are mixed row by
row in turn, each until it runs out. With `sample_packing`, rows are packed `streaming_multipack_buffer_size`
at a time (`packing.pack_buffered`).

The stream cycles through the data (pass p shuffled with `seed + p`) until `max_steps`, so the Trainer sees one
endless epoch, and a resumed run replays the stream up to its position (the Trainer skips the batches already
trained on): every pass is the same for the same seed, so the replay is exact.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from typing import Any

import torch

from hellbender.config import DatasetEntry, HellbenderConfig
from hellbender.data.contexts import format_context
from hellbender.data.formats import FORMATTERS, FormatContext, Formatter
from hellbender.data.packing import pack_buffered
from hellbender.data.prepare import DROP_HINTS, row_format
from hellbender.data.sources import load_rows, stream_rows
from hellbender.data.tokenize import encode_row
from hellbender.errors import DataError

logger = logging.getLogger("hellbender")


@dataclass(frozen=True)
class SFTStream:
    """One `datasets:` entry ready to stream: where it sits in the config, its row format and masking context."""

    entry: DatasetEntry
    where: str
    formatter: Formatter
    ctx: FormatContext


def open_sft_streams(cfg: HellbenderConfig, tokenizer: Any) -> list[SFTStream]:
    """Open every entry and read its first row now, so that a missing or empty source, or rows that do not fit
    the entry's `type`, fail before the model is loaded and anything is written."""
    streams = []
    for i, entry in enumerate(cfg.datasets):
        where = f"Dataset datasets[{i}] `{entry.path}`"
        first = next(iter(load_rows(entry, streaming=True, where=where)), None)
        if first is None:
            raise DataError(f"{where} has no rows. Check the file or the `split`.")
        fmt = row_format(entry, sorted(first), False, where)
        streams.append(SFTStream(entry, where, FORMATTERS[fmt], format_context(entry, cfg, tokenizer, None, where)))
    return streams


def in_turn(iterators: list[Iterator[Any]]) -> Iterator[Any]:
    """One item of each iterator in turn; an iterator that runs out leaves the rotation."""
    active = list(iterators)
    while active:
        for iterator in list(active):
            try:
                yield next(iterator)
            except StopIteration:
                active.remove(iterator)


class StreamingSFTDataset(torch.utils.data.IterableDataset):
    """Tokenized (and with `sample_packing`, packed) supervised rows, cycling without end."""

    def __init__(self, cfg: HellbenderConfig, tokenizer: Any, streams: list[SFTStream]) -> None:
        self.streams = streams
        self.seed = cfg.seed
        self.sequence_len = cfg.sequence_len
        self.excess_length_strategy = cfg.excess_length_strategy
        self.shuffle_buffer = cfg.streaming_multipack_buffer_size if cfg.shuffle_merged_datasets else None
        self.pack_buffer = cfg.streaming_multipack_buffer_size if cfg.sample_packing else None

    def _rows(self, stream: SFTStream, epoch: int, dropped: Counter) -> Iterator[dict[str, list[int]]]:
        rows = stream_rows(stream.entry, stream.where, self.seed + epoch, self.shuffle_buffer)
        for index, row in enumerate(rows):
            encoded = encode_row(
                row, index, stream.formatter, stream.ctx, self.sequence_len, self.excess_length_strategy, stream.where
            )
            if encoded["drop_reason"]:
                dropped[encoded["drop_reason"]] += 1
                continue
            yield {"input_ids": encoded["input_ids"], "labels": encoded["labels"]}

    def rows_of_pass(self, epoch: int, dropped: Counter | None = None) -> Iterator[dict[str, list[int]]]:
        """The kept rows of pass `epoch`, unpacked, the entries mixed in turn; `dropped` counts the others."""
        dropped = Counter() if dropped is None else dropped
        return in_turn([self._rows(stream, epoch, dropped) for stream in self.streams])

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        for epoch in count():
            dropped: Counter = Counter()
            rows = self.rows_of_pass(epoch, dropped)
            if self.pack_buffer:
                rows = pack_buffered(rows, self.sequence_len, self.pack_buffer, random.Random(self.seed + epoch))
            served = 0
            for sample in rows:
                served += 1
                yield sample
            if served == 0:
                raise DataError(f"Every streamed training row was dropped ({_reasons(dropped)}); {_hints(dropped)}")
            if epoch == 0 and dropped:
                logger.warning("Streamed training rows dropped in the first pass: %s.", _reasons(dropped))


def _reasons(dropped: Counter) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in dropped.items()) or "no rows were read"


def _hints(dropped: Counter) -> str:
    hints = [DROP_HINTS[reason] for reason in dropped if reason in DROP_HINTS]
    return (
        f"nothing is left to train on. To keep rows: {'; '.join(hints)}." if hints else "nothing is left to train on."
    )
