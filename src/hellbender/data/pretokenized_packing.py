"""`sample_packing: true` with already-tokenized `multimodal_pretrain` rows (`skip_prepare_dataset: true`).

Their `input_ids` hold one token per image; the processor expands the images only at batch time. Bins are filled by
each row's full length, so that length is measured once, before training, by running the row through the same
collator that batches it (every image is opened once then), and cached under `dataset_prepared_path`, keyed by the
data files, the tokenizer, the processor and the image settings. A packed row is the list of its documents, each as
`PretokenizedMultimodalRows` gives it; `PackedMultimodalCollator` processes each alone and joins them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from hellbender.config import HellbenderConfig
from hellbender.data import cache
from hellbender.data.collator import REAL_TOKENS_KEY
from hellbender.data.packing import pack_lengths, pack_lengths_in_order
from hellbender.data.vision_tokens import processor_fingerprint
from hellbender.errors import DataError

logger = logging.getLogger(__name__)

# Settings that change how many tokens an image expands into.
IMAGE_SETTINGS = ("image_size", "image_resize_algorithm", "max_image_pixels", "vision_tokens_to_mask")


class PackedPretokenizedRows(torch.utils.data.Dataset):
    """Bins of pre-tokenized rows; `dropped` counts the rows longer than `sequence_len` that were left out."""

    def __init__(self, rows: Any, lengths: list[int], cfg: HellbenderConfig) -> None:
        too_long = [i for i, n in enumerate(lengths) if n > cfg.sequence_len]
        if too_long and cfg.excess_length_strategy == "raise":
            i = too_long[0]
            raise DataError(
                f"Pre-tokenized row {i} has {lengths[i]} tokens with its images expanded, more than `sequence_len: "
                f"{cfg.sequence_len}`; rows are never truncated through an image. Raise `sequence_len`, shorten the "
                "row, or set `excess_length_strategy: drop`."
            )
        if too_long:
            logger.warning("Dropped %d pre-tokenized row(s) longer than sequence_len", len(too_long))
        kept = [i for i, n in enumerate(lengths) if n <= cfg.sequence_len]
        if not kept:
            raise DataError(
                f"Every pre-tokenized row is longer than `sequence_len: {cfg.sequence_len}` with its images "
                "expanded; nothing is left to train on. Raise `sequence_len`."
            )
        pack = pack_lengths_in_order if cfg.sample_packing_sequentially else pack_lengths
        bins = pack([lengths[i] for i in kept], cfg.sequence_len)
        self.rows, self.lengths, self.dropped = rows, lengths, len(too_long)
        self.bins = [[kept[j] for j in members] for members in bins]

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, Any]:
        members = self.bins[index]
        return {"seq_lens": [self.lengths[i] for i in members], "documents": [self.rows[i] for i in members]}


def full_lengths(rows: Any, documents: Any, cfg: HellbenderConfig) -> list[int]:
    """Every row's length with its images expanded, as `documents` (the batch collator) expands them; cached."""
    processor = documents.processor
    key = cache.cache_key(
        {
            "pretokenized": [e.model_dump() for e in cfg.datasets],
            "files": [cache.files_fingerprint(e.path) for e in cfg.datasets],
            "tokenizer": cache.tokenizer_fingerprint(processor.tokenizer),
            "processor": processor_fingerprint(processor),
            "settings": {k: getattr(cfg, k) for k in IMAGE_SETTINGS},
        }
    )
    path = Path(cfg.dataset_prepared_path) / f"pretokenized-lengths-{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    lengths = [int(documents([rows[i]])[REAL_TOKENS_KEY][0]) for i in range(len(rows))]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")  # every rank of a multi-GPU run measures and writes
    partial.write_text(json.dumps(lengths))
    partial.replace(path)  # a crash mid-write never leaves a cache that looks complete
    return lengths


def packed_pretokenized_rows(cfg: HellbenderConfig, rows: Any, tokenizer: Any, processor: Any):
    """The pre-tokenized training rows packed into `sequence_len` bins by their full lengths."""
    from hellbender.data.batching import build_collator

    documents = build_collator(cfg, tokenizer, processor).documents
    return PackedPretokenizedRows(rows, full_lengths(rows, documents, cfg), cfg)
