"""Streamed raw-text continued pretraining (`pretraining_dataset:` with `streaming: true`).

Documents are read lazily, tokenized with EOS appended, and packed in order into `sequence_len` bins (long
documents are split across bins). Nothing is cached; the run's length comes from `max_steps`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hellbender.config import HellbenderConfig, PretrainingDatasetEntry
from hellbender.data.packing import pack_stream
from hellbender.data.sources import load_rows
from hellbender.errors import DataError

SHUFFLE_BUFFER = 10_000


class StreamingPretrainDataset(torch.utils.data.IterableDataset):
    def __init__(self, entries: list[PretrainingDatasetEntry], tokenizer: Any, sequence_len: int, seed: int) -> None:
        self.entries = entries
        self.tokenizer = tokenizer
        self.sequence_len = sequence_len
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _documents(self) -> Iterator[dict[str, list[int]]]:
        eos = self.tokenizer.eos_token_id
        for i, entry in enumerate(self.entries):
            rows = load_rows(entry, streaming=True).shuffle(seed=self.seed + self.epoch, buffer_size=SHUFFLE_BUFFER)
            for number, row in enumerate(rows):
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

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        return pack_stream(self._documents(), self.sequence_len)


def streaming_dataset(cfg: HellbenderConfig, tokenizer: Any) -> StreamingPretrainDataset:
    if tokenizer.eos_token_id is None:
        raise DataError("The tokenizer has no EOS token to end documents with; set `special_tokens: {eos_token: ...}`.")
    return StreamingPretrainDataset(cfg.pretraining_dataset, tokenizer, cfg.sequence_len, cfg.seed)
