"""Batches of Mistral vision rows encoded by mistral-common (`tokenizer_use_mistral_common` with `processor_type`).

The prepared rows already hold every token, image tokens included, and their labels; here they are padded like
text rows, and each image is encoded again by mistral-common's image encoder into the pixels the model takes.
Images of different sizes are padded at the bottom and right to the largest in the batch, and `image_sizes`
gives each one's own height and width, which is the layout transformers' Pixtral vision tower reads (it cuts
each image back to its size). The image tokens the encoder gives must be those of the prepared row, so a changed
image or tokenizer file is caught instead of feeding the model features that do not match its `[IMG]` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hellbender.data.collator import CausalLMCollator
from hellbender.data.images import ImagePolicy
from hellbender.data.multimodal_collator import prepared_images
from hellbender.errors import DataError


def pad_images(arrays: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """C x H x W pixel arrays as one zero-padded [images, C, max H, max W] float32 tensor, and their [images, 2]
    (height, width) sizes."""
    sizes = torch.tensor([a.shape[-2:] for a in arrays], dtype=torch.long)
    height, width = sizes.max(dim=0).values.tolist()
    pixels = torch.zeros((len(arrays), arrays[0].shape[0], height, width), dtype=torch.float32)
    for i, array in enumerate(arrays):
        pixels[i, :, : array.shape[-2], : array.shape[-1]] = torch.as_tensor(array, dtype=torch.float32)
    return pixels, sizes


@dataclass
class MistralImageCollator:
    processor: Any  # hellbender.models.mistral_processor.MistralCommonProcessor
    policy: ImagePolicy

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = CausalLMCollator(self.processor.tokenizer.pad_token_id)(rows)
        arrays = []
        image_ids = self.processor.image_token_ids
        for row in rows:
            tokens = []
            for image in prepared_images(row, self.policy):
                image_tokens, array = self.processor.encode_image(image)
                tokens += image_tokens
                arrays.append(array)
            if tokens != [t for t in row["input_ids"] if t in image_ids]:
                raise DataError(
                    f"mistral-common now encodes the images of a prepared row into other image tokens "
                    f"({', '.join(row['images']) or 'images stored with `cache_images`'}). The images or the "
                    "tokenizer file changed since the data was prepared; delete the prepared data "
                    "(`dataset_prepared_path`) and run again."
                )
        if arrays:
            batch["pixel_values"], batch["image_sizes"] = pad_images(arrays)
        return batch
