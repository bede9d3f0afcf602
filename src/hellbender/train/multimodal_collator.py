"""Batches of vision-language rows: images are opened and processed here, at batch time.

Prepared rows hold the rendered text, the expanded token ids, the labels and the image paths. The
processor turns the text and images of the whole batch into the model's inputs (pixel values and whatever
else the family needs); the token ids it produces must equal the prepared ones, so a changed image or
processor is caught instead of silently shifting the labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hellbender.data.formats.base import IGNORE_INDEX
from hellbender.data.images import ImagePolicy, ImageProblem, open_image
from hellbender.errors import DataError
from hellbender.train.collator import REAL_TOKENS_KEY


@dataclass
class MultimodalCollator:
    processor: Any
    policy: ImagePolicy

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        texts = [row["text"] for row in rows]
        try:
            images = [[open_image(Path(p), self.policy) for p in row["images"]] for row in rows]
        except ImageProblem as exc:
            raise DataError(
                f"An image of a prepared row can no longer be used: {exc}. The images changed since the data was "
                "prepared; restore them, or delete the prepared data (`dataset_prepared_path`) and run again."
            ) from None
        has_images = any(images)
        batch = self.processor(
            text=texts,
            images=images if has_images else None,
            padding=True,
            add_special_tokens=False,
            return_tensors="pt",
        )
        input_ids = batch["input_ids"]
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            if input_ids[i, :n].tolist() != list(row["input_ids"]) or batch["attention_mask"][i, n:].any():
                raise DataError(
                    f"The processor now expands the images of a prepared row differently ({', '.join(row['images'])}). "
                    "The images or the processor changed since the data was prepared; delete the prepared data "
                    "(`dataset_prepared_path`) and run again."
                )
            labels[i, :n] = torch.as_tensor(row["labels"])
        out = dict(batch)
        out["labels"] = labels
        out[REAL_TOKENS_KEY] = torch.tensor([len(row["input_ids"]) for row in rows])
        return out
