"""The prepared stream of a streamed multimodal dataset, cached under `dataset_prepared_path`.

Each encoded row (token ids, labels, text, image paths; never pixels) is appended as one JSON line, keyed by
its position in the stream, as soon as it is made; a row dropped by `skip_bad_images` is recorded too. A
later pass, a resumed run or a rerun with the same data, tokenizer, processor and settings reads the
encoding instead of opening, checking and expanding the row's images again. A line cut short by a kill is
ignored, so a partial write is never trusted. Each process appends to its own file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.data import cache
from hellbender.data.vision_tokens import processor_fingerprint

STREAM_SETTINGS = (
    "sequence_len",
    "excess_length_strategy",  # decides whether an over-long row is cached as dropped
    "image_size",
    "image_resize_algorithm",
    "max_image_pixels",
    "vision_tokens_to_mask",
    "seed",
    # The rows are keyed by position, and the shuffle decides which row sits where.
    "shuffle_merged_datasets",
    "streaming_multipack_buffer_size",
)
CACHED_KEYS = ("input_ids", "labels", "images", "text", "image_base_dir")


def stream_cache_dir(cfg: HellbenderConfig, tokenizer: Any, processor: Any) -> Path:
    key = cache.cache_key(
        {
            "stream": [e.model_dump() for e in cfg.pretraining_dataset],
            "files": [cache.files_fingerprint(e.path) for e in cfg.pretraining_dataset],
            "tokenizer": cache.tokenizer_fingerprint(tokenizer),
            "processor": processor_fingerprint(processor),
            "settings": {k: getattr(cfg, k) for k in STREAM_SETTINGS},
        }
    )
    return Path(cfg.dataset_prepared_path) / f"stream-{key}"


class StreamCache:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / f"rows-{os.getpid()}.jsonl"

    def load(self) -> dict[int, dict[str, Any] | None]:
        """Position -> encoded row (None for a dropped row), from every complete line of every process."""
        known: dict[int, dict[str, Any] | None] = {}
        for part in sorted(self.directory.glob("rows-*.jsonl")):
            for line in part.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the last line of a killed writer
                known[record["position"]] = record["row"]
        return known

    def append(self, position: int, row: dict[str, Any] | None) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        stored = {k: row[k] for k in CACHED_KEYS} if row is not None else None
        with open(self.path, "a") as f:
            f.write(json.dumps({"position": position, "row": stored}) + "\n")
