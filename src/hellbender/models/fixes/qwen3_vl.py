"""Qwen3-VL: what hellbender needs for this family, checked against the installed transformers.

Processor: like Qwen2.5-VL's (`fixes/qwen2_5_vl.py`), `Qwen3VLProcessor` always loads a video processor
(`Qwen3VLVideoProcessor`) that needs torchvision, so without it `load_processor` loads the directory through
`ImageOnlyQwen3VLProcessor` (`fixes/image_only_processor.py`: image processor and tokenizer only; videos are refused), which saves the files a stock
`Qwen3VLProcessor` writes. What it overrides and calls in transformers is `PROCESSOR_CONTRACT`, checked when loaded.

Batches: the model builds its interleaved 3-D (M-RoPE) positions from `mm_token_type_ids` and `image_grid_thw` for a
whole unpacked row, as Qwen2.5-VL does; a packed row gets each document's own through the same
`qwen2_5_vl.packed_rope_positions`, checked against `PACKED_POSITIONS_CONTRACT`. Its DeepStack features (vision
layers added to the first language layers at the image tokens) follow the image tokens in order, so they need nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import Qwen3VLModel, Qwen3VLProcessor

from hellbender.models.fixes.contract import Contract, Requirement
from hellbender.models.fixes.image_only_processor import image_only, processor_contract
from hellbender.models.fixes.image_only_processor import load_processor as load_image_only
from hellbender.models.fixes.processor_families import types_using

# Qwen3-VL MoE, Qwen3.5 and others use the same processor class, so the same loader serves them.
MODEL_TYPES = types_using("Qwen3VLProcessor")


ImageOnlyQwen3VLProcessor = image_only(
    Qwen3VLProcessor, "Qwen3-VL", video_processor_type="Qwen3VLVideoProcessor", saves_video_size=False
)
PROCESSOR_CONTRACT = processor_contract(Qwen3VLProcessor, "Qwen3-VL")


def load_processor(path: str | Path, **kwargs: Any):
    """`AutoProcessor.from_pretrained` where torchvision is installed; the image-only processor elsewhere."""
    return load_image_only(ImageOnlyQwen3VLProcessor, PROCESSOR_CONTRACT, path, **kwargs)


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
