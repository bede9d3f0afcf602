"""Batches of vision-language rows: images are opened and processed here, at batch time.

Prepared rows hold the rendered text, the expanded token ids, the labels and the image paths. The
processor turns the text and images of the whole batch into the model's inputs (pixel values and whatever
else the family needs); the token ids it produces must equal the prepared ones, so a changed image or
processor is caught instead of silently shifting the labels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hellbender.data.collator import REAL_TOKENS_KEY
from hellbender.data.formats.base import IGNORE_INDEX, UNEXPANDED_KEY, RowError
from hellbender.data.formats.multimodal_chat import align_labels
from hellbender.data.images import ImagePolicy, ImageProblem, open_image, unpack_pixels
from hellbender.data.streaming import STREAM_ROW_KEY
from hellbender.errors import DataError

BASE_DIR_KEY = "image_base_dir"


@dataclass
class MultimodalCollator:
    processor: Any
    policy: ImagePolicy
    vision_ids: frozenset[int] = frozenset()

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        texts = [row["text"] for row in rows]
        images = [prepared_images(row, self.policy) for row in rows]
        has_images = any(images)
        batch = self.processor(
            text=texts,
            images=images if has_images else None,
            padding=True,
            # labels are placed from the left; some processors pad on the left by default (Aya Vision, Cohere 2
            # Vision, InternVL), which a per-call setting overrides and the tokenizer's own setting does not
            padding_side="right",
            add_special_tokens=False,
            return_tensors="pt",
        )
        input_ids = batch["input_ids"]
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        for i, row in enumerate(rows):
            n = lengths[i]
            ids = input_ids[i, :n].tolist()
            if row.get(UNEXPANDED_KEY):
                row_labels = self._labels_for_user_tokens(row, ids)
            elif ids != list(row["input_ids"]):
                raise DataError(
                    f"The processor now expands the images of a prepared row differently ({', '.join(row['images'])}). "
                    "The images or the processor changed since the data was prepared; delete the prepared data "
                    "(`dataset_prepared_path`) and run again."
                )
            else:
                row_labels = row["labels"]
            labels[i, :n] = torch.as_tensor(row_labels)
        out = dict(batch)
        out["labels"] = labels
        out[REAL_TOKENS_KEY] = torch.tensor(lengths)
        if STREAM_ROW_KEY in rows[0]:
            out[STREAM_ROW_KEY] = torch.tensor([row[STREAM_ROW_KEY] for row in rows])
        return out

    def _labels_for_user_tokens(self, row: dict[str, Any], ids: list[int]) -> list[int]:
        try:
            labels = align_labels(list(row["input_ids"]), list(row["labels"]), ids)
        except RowError as exc:
            raise DataError(
                f"A pre-tokenized row ({row['text'][:60]!r}) does not match its `_mm_text`: {exc}. Its `input_ids` "
                "must be the processor tokenizer's tokens of `_mm_text`."
            ) from None
        return [IGNORE_INDEX if token in self.vision_ids else label for token, label in zip(ids, labels, strict=True)]


def prepared_images(row: dict[str, Any], policy: ImagePolicy) -> list[Any]:
    """The images of a prepared row, decoded again (or as stored, with `cache_images`). Each file is checked again
    to lie inside the row's `image_base_dir` (or the stored remote images): a file swapped for a symlink that
    leads out after preparation is refused as it would have been then."""
    try:
        if row.get("pixels"):
            return unpack_pixels(row["pixels"])
        if not row["images"]:
            return []
        if not row.get(BASE_DIR_KEY):
            raise DataError(
                f"A prepared row with images ({', '.join(row['images'])}) names no `{BASE_DIR_KEY}` to check them "
                "against; it was prepared by an older version. Delete the prepared data (`dataset_prepared_path`) and "
                "run again."
            )
        row_policy = replace(policy, base_dir=Path(row[BASE_DIR_KEY]))
        return [open_image(Path(p), row_policy) for p in row["images"]]
    except ImageProblem as exc:
        raise DataError(
            f"An image of a prepared row can no longer be used: {exc}. The images changed since the data was "
            "prepared; restore them, or delete the prepared data (`dataset_prepared_path`) and run again."
        ) from None
