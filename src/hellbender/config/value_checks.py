"""Values that are each valid alone but cannot work with another key's value (a resize target larger than the image
size limit, a minimum row length above the maximum). Each problem is one paragraph naming both keys."""

from __future__ import annotations

from hellbender.config.schema import HellbenderConfig


def value_conflicts(cfg: HellbenderConfig) -> list[str]:
    problems = []
    size = cfg.image_size
    if size is not None:
        width, height = (size, size) if isinstance(size, int) else size
        if width * height > cfg.max_image_pixels:
            shown = size if isinstance(size, int) else f"[{width}, {height}]"
            problems.append(
                f"`image_size: {shown}` resizes every image to {width * height:,} pixels, more than "
                f"`max_image_pixels: {cfg.max_image_pixels}` allows any image (the limit that keeps one image from "
                "exhausting memory). Lower `image_size`, or raise `max_image_pixels` if images this large are meant."
            )
    if cfg.min_sample_len > cfg.sequence_len:
        problems.append(
            f"`min_sample_len: {cfg.min_sample_len}` is above `sequence_len: {cfg.sequence_len}`: every row would be "
            "dropped as too short or too long. Lower `min_sample_len` (its default 2 drops only rows with nothing "
            "to train)."
        )
    return problems
