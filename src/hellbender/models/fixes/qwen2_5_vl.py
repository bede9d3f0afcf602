"""Qwen2.5-VL: what hellbender needs for this family, checked against the installed transformers.

Processor: `Qwen2_5_VLProcessor` always loads a `Qwen2VLVideoProcessor`, which needs torchvision, so
`AutoProcessor.from_pretrained` fails on machines without it (ImportError). `load_processor` then loads the
same directory through `ImageOnlyQwen2_5_VLProcessor` (image processor and tokenizer only; videos are refused),
which saves the files a stock `Qwen2_5_VLProcessor` writes, so the saved directory loads anywhere. What it
overrides and calls in transformers is `PROCESSOR_CONTRACT`, checked when it is loaded.

Batches: the model builds its 3-D (M-RoPE) image positions from `mm_token_type_ids` together with
`image_grid_thw`; without `mm_token_type_ids` it silently falls back to 1-D positions. The processor returns
both, and the collator passes every processor output on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase, Qwen2_5_VLModel, Qwen2_5_VLProcessor

from hellbender.models.fixes.contract import Contract, Requirement

MODEL_TYPES = ("qwen2_5_vl",)


class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """`Qwen2_5_VLProcessor` without a video processor, for machines without torchvision."""

    def __init__(self, image_processor=None, tokenizer=None, video_processor=None, chat_template=None, **kwargs):
        # `from_pretrained` passes the saved video processor settings (a dict) here; they are kept for saving.
        self.video_processor_config = video_processor if isinstance(video_processor, dict) else None
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    @classmethod
    def get_attributes(cls):
        return ["image_processor", "tokenizer"]

    def __call__(self, images=None, text=None, videos=None, *args, **kwargs):
        if videos is not None:
            raise ValueError(
                "This Qwen2.5-VL processor was loaded without torchvision, so it has no video processor "
                "(Qwen2VLVideoProcessor needs torchvision). Install torchvision to process videos."
            )
        return super().__call__(images, text, None, *args, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """What a stock `Qwen2_5_VLProcessor` saves: its own class name and a video processor entry (the stock
        class cannot load a directory without one)."""
        output = super().to_dict()
        output["processor_class"] = "Qwen2_5_VLProcessor"
        output["video_processor"] = dict(self.video_processor_config or self._video_config_from_images())
        return output

    def _video_config_from_images(self) -> dict[str, Any]:
        images = self.image_processor
        return {
            "video_processor_type": "Qwen2VLVideoProcessor",
            "patch_size": images.patch_size,
            "merge_size": images.merge_size,
            "temporal_patch_size": images.temporal_patch_size,
            "size": dict(images.size),
        }

    def save_pretrained(self, save_directory, *args, **kwargs):
        files = super().save_pretrained(save_directory, *args, **kwargs)
        self.tokenizer._set_processor_class("Qwen2_5_VLProcessor")
        self.tokenizer.save_pretrained(save_directory)
        return files


# What `ImageOnlyQwen2_5_VLProcessor` relies on in transformers, checked when the processor is built.
PROCESSOR_CONTRACT = Contract(
    "hellbender's Qwen2.5-VL processor without torchvision",
    (
        Requirement(
            Qwen2_5_VLProcessor,
            "__init__",
            "called with the image processor and tokenizer, and no video processor",
            parameters=("image_processor", "tokenizer", "video_processor", "chat_template"),
        ),
        Requirement(
            Qwen2_5_VLProcessor,
            "__call__",
            "overridden so that videos are refused clearly",
            parameters=("images", "text", "videos"),
        ),
        Requirement(
            Qwen2_5_VLProcessor,
            "get_attributes",
            "overridden so that loading and saving skip the missing video processor",
        ),
        Requirement(Qwen2_5_VLProcessor, "to_dict", "overridden so that the saved config names `Qwen2_5_VLProcessor`"),
        Requirement(
            Qwen2_5_VLProcessor,
            "save_pretrained",
            "overridden so that the saved tokenizer config names `Qwen2_5_VLProcessor`",
        ),
        Requirement(
            PreTrainedTokenizerBase,
            "_set_processor_class",
            "makes the saved tokenizer config name `Qwen2_5_VLProcessor`",
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
    return ImageOnlyQwen2_5_VLProcessor.from_pretrained(str(path), **kwargs)


# What packed batches rely on in transformers: the model's own 3-D position builder, called once per document.
PACKED_POSITIONS_CONTRACT = Contract(
    "hellbender's Qwen2.5-VL sample packing",
    (
        Requirement(
            Qwen2_5_VLModel,
            "get_rope_index",
            "builds each packed document's 3-D (M-RoPE) positions as if it were alone",
            parameters=("input_ids", "mm_token_type_ids", "image_grid_thw"),
        ),
    ),
)


def packed_rope_positions(model: Any, batch: dict[str, Any]) -> Any:
    """Position ids for a packed batch of Qwen2.5-VL or Qwen3-VL (whose `get_rope_index` takes the same arguments
    and counts images the same way): `[4, batch, seq]`, the restarting 1-D positions first (the language model
    finds the documents there and keeps attention inside each) and then each document's own 3-D positions, built by
    the model's `get_rope_index` on the document alone, so every document is positioned as it is unpacked. Documents
    start where the collator's 1-D positions restart (`data/multimodal_packed_collator.py`); each takes the next
    grids of `image_grid_thw`, one per image it holds, in order."""
    import itertools

    import torch

    text_positions = batch["position_ids"]
    input_ids, token_types = batch["input_ids"], batch["mm_token_type_ids"]
    grids = iter(batch["image_grid_thw"]) if batch.get("image_grid_thw") is not None else iter(())
    rope = torch.zeros((3, *text_positions.shape), dtype=text_positions.dtype, device=text_positions.device)
    for row in range(text_positions.shape[0]):
        starts = (text_positions[row] == 0).nonzero().flatten().tolist() + [text_positions.shape[1]]
        for start, end in itertools.pairwise(starts):
            types = token_types[row, start:end]
            # One image per run of image tokens, as `get_rope_index` counts them.
            images = int(((types == 1) & (torch.nn.functional.pad(types, (1, 0))[:-1] != 1)).sum())
            doc_grids = [next(grids) for _ in range(images)]
            positions, _ = model.get_rope_index(
                input_ids=input_ids[row : row + 1, start:end],
                mm_token_type_ids=types[None],
                image_grid_thw=torch.stack(doc_grids) if doc_grids else None,
            )
            rope[:, row, start:end] = positions[:, 0]
    return torch.cat([text_positions[None], rope], dim=0)
