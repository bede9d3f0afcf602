"""Qwen3-VL: what hellbender needs for this family, checked against the installed transformers.

Processor: like Qwen2.5-VL's (`fixes/qwen2_5_vl.py`), `Qwen3VLProcessor` always loads a video processor
(`Qwen3VLVideoProcessor`) that needs torchvision, so without it `load_processor` loads the directory through
`ImageOnlyQwen3VLProcessor` (image processor and tokenizer only; videos are refused), which saves the files a stock
`Qwen3VLProcessor` writes. What it overrides and calls in transformers is `PROCESSOR_CONTRACT`, checked when loaded.

Batches: the model builds its interleaved 3-D (M-RoPE) positions from `mm_token_type_ids` and `image_grid_thw` for a
whole unpacked row, as Qwen2.5-VL does; a packed row gets each document's own through the same
`qwen2_5_vl.packed_rope_positions`, checked against `PACKED_POSITIONS_CONTRACT`. Its DeepStack features (vision
layers added to the first language layers at the image tokens) follow the image tokens in order, so they need nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase, Qwen3VLModel, Qwen3VLProcessor

from hellbender.models.fixes.contract import Contract, Requirement

MODEL_TYPES = ("qwen3_vl",)


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` without a video processor, for machines without torchvision."""

    def __init__(self, image_processor=None, tokenizer=None, video_processor=None, chat_template=None, **kwargs):
        # `from_pretrained` passes the saved video processor settings (a dict) here; they are kept for saving.
        self.video_processor_config = video_processor if isinstance(video_processor, dict) else None
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    @classmethod
    def get_attributes(cls):
        return ["image_processor", "tokenizer"]

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError(
                "This Qwen3-VL processor was loaded without torchvision, so it has no video processor "
                "(Qwen3VLVideoProcessor needs torchvision). Install torchvision to process videos."
            )
        return super().__call__(images=images, text=text, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """What a stock `Qwen3VLProcessor` saves: its own class name and a video processor entry (the stock class
        cannot load a directory without one)."""
        output = super().to_dict()
        output["processor_class"] = "Qwen3VLProcessor"
        output["video_processor"] = dict(self.video_processor_config or self._video_config_from_images())
        return output

    def _video_config_from_images(self) -> dict[str, Any]:
        images = self.image_processor
        return {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "patch_size": images.patch_size,
            "merge_size": images.merge_size,
            "temporal_patch_size": images.temporal_patch_size,
        }

    def save_pretrained(self, save_directory, *args, **kwargs):
        files = super().save_pretrained(save_directory, *args, **kwargs)
        self.tokenizer._set_processor_class("Qwen3VLProcessor")
        self.tokenizer.save_pretrained(save_directory)
        return files


# What `ImageOnlyQwen3VLProcessor` relies on in transformers, checked when the processor is built.
PROCESSOR_CONTRACT = Contract(
    "hellbender's Qwen3-VL processor without torchvision",
    (
        Requirement(
            Qwen3VLProcessor,
            "__init__",
            "called with the image processor and tokenizer, and no video processor",
            parameters=("image_processor", "tokenizer", "video_processor", "chat_template"),
        ),
        Requirement(
            Qwen3VLProcessor, "__call__", "overridden so that videos are refused clearly", parameters=("images", "text")
        ),
        Requirement(
            Qwen3VLProcessor, "get_attributes", "overridden so that loading and saving skip the missing video processor"
        ),
        Requirement(Qwen3VLProcessor, "to_dict", "overridden so that the saved config names `Qwen3VLProcessor`"),
        Requirement(
            Qwen3VLProcessor,
            "save_pretrained",
            "overridden so that the saved tokenizer config names `Qwen3VLProcessor`",
        ),
        Requirement(
            PreTrainedTokenizerBase,
            "_set_processor_class",
            "makes the saved tokenizer config name `Qwen3VLProcessor`",
        ),
    ),
)


def load_processor(path: str | Path, **kwargs: Any):
    """`AutoProcessor.from_pretrained` where torchvision is installed; the image-only processor elsewhere."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(path), **kwargs)
    PROCESSOR_CONTRACT.check()
    return ImageOnlyQwen3VLProcessor.from_pretrained(str(path), **kwargs)


# What packed batches rely on in transformers: the model's own 3-D position builder, called once per document.
PACKED_POSITIONS_CONTRACT = Contract(
    "hellbender's Qwen3-VL sample packing",
    (
        Requirement(
            Qwen3VLModel,
            "get_rope_index",
            "builds each packed document's 3-D (M-RoPE) positions as if it were alone",
            parameters=("input_ids", "mm_token_type_ids", "image_grid_thw"),
        ),
    ),
)
