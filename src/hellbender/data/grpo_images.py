"""Prompt rows with images for online RL on a vision-language model (`rl: grpo` / `rl: rloo` with `processor_type`).

A row's images are image parts of its `prompt` messages (`{"type": "image", "path": ...}`) or the entry's
`image_column` (placed before the text of the first user message, as for multimodal SFT chat rows). Every image is
found and checked here, before training, through hellbender's image sandbox: paths start from `image_base_dir` (the
data file's directory by default) and may not leave it, and a missing, unreadable or oversized file refuses the row
by number. The rows then keep the prompt with bare image placeholders and the images' checked paths; at batch time
`with_opened_images` decodes them (the sandbox checks each path again) into TRL's `images` column, whose images TRL
puts into the placeholders in order. TRL never opens a path itself."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from hellbender.config import DatasetEntry, HellbenderConfig
from hellbender.data.contexts import image_base_dir, image_policy
from hellbender.data.formats.base import RowError
from hellbender.data.formats.multimodal_chat import attach_column_images, image_parts
from hellbender.data.images import (
    ImagePolicy,
    ImageProblem,
    image_header_size,
    image_reference,
    open_image,
    resolve_image,
)
from hellbender.errors import DataError

IMAGE_PATHS = "hellbender_image_paths"  # the checked paths of a row's images, in placeholder order
IMAGE_BASE = "hellbender_image_base_dir"  # the directory they must still lie inside when opened
TRL_IMAGE_COLUMNS = ("image", "images")  # columns TRL reads as images by their names


def prompt_image_rows(rows: Any, entry: DatasetEntry, cfg: HellbenderConfig, where: str) -> Any:
    """`rows` with each prompt's messages in parts (image parts as bare placeholders), the image column dropped, and
    the checked image paths beside them. A problem stops with one paragraph naming the row."""
    base = image_base_dir(entry, where)
    policy = image_policy(cfg, base_dir=base)
    column = entry.image_column
    others = [c for c in TRL_IMAGE_COLUMNS if c in rows.column_names and c != column]
    if others:
        raise DataError(
            f"{where} has a column `{others[0]}`, and its images are read from `image_column: {column}`. Set "
            f"`image_column: {others[0]}` if it holds the prompt's images, or rename the column."
        )

    def located(row: dict[str, Any], index: int) -> dict[str, Any]:
        try:
            messages = _messages(row["prompt"])
            refs = row.get(column)
            if refs:
                messages = attach_column_images(messages, [refs] if isinstance(refs, str) else list(refs))
            paths = [resolve_image(image_reference(p), policy) for p in image_parts(messages)]
            for path in paths:
                image_header_size(path, policy)  # refuses an unreadable or oversized file before training
        except (RowError, ImageProblem) as exc:
            raise DataError(
                f"{where}, row {index}: {exc}. Fix the row (images are paths relative to `image_base_dir`, by default "
                "the data file's directory; docs/rl.md)."
            ) from None
        return {"prompt": _placeholders(messages), IMAGE_PATHS: [str(p) for p in paths], IMAGE_BASE: str(base)}

    drop = [column] if column in rows.column_names else []
    return rows.map(located, with_indices=True, remove_columns=drop, keep_in_memory=True, load_from_cache_file=False)


def _messages(prompt: Any) -> list[dict[str, Any]]:
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise RowError(
            'a prompt with images must be a list of chat messages (`{"role": ..., "content": ...}`), not text'
        )
    return [{k: v for k, v in m.items() if v is not None} for m in prompt]


def _placeholders(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every content as parts (one Arrow type for all rows), each image part a bare placeholder for TRL to fill."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        else:
            parts = [
                {"type": "image"} if p.get("type") == "image" else {k: v for k, v in p.items() if v is not None}
                for p in content or []
            ]
        out.append({**message, "content": parts})
    return out


def with_opened_images(row: dict[str, Any], policy: ImagePolicy) -> dict[str, Any]:
    """A prepared row as TRL reads it: its images decoded into `images`, placeholders without Arrow's empty keys."""
    paths, base = row[IMAGE_PATHS], row[IMAGE_BASE]
    rest = {k: v for k, v in row.items() if k not in (IMAGE_PATHS, IMAGE_BASE)}
    row_policy = replace(policy, base_dir=Path(base))
    try:
        images = [open_image(Path(p), row_policy) for p in paths]
    except ImageProblem as exc:  # checked before training: changed on disk since
        raise DataError(f"{exc} (it changed since the data was checked). Restore the file, then resume.") from None
    prompt = [
        {**m, "content": [{k: v for k, v in p.items() if v is not None} for p in m["content"]]} for m in rest["prompt"]
    ]
    return {**rest, "prompt": prompt, "images": images}
