"""Qwen2-VL: its processor without torchvision, as for Qwen2.5-VL (`fixes/qwen2_5_vl.py`).

`Qwen2VLProcessor` always loads a `Qwen2VLVideoProcessor`, which needs torchvision, so `AutoProcessor.from_pretrained`
fails on machines without it (ImportError). `load_processor` then loads the directory through
`ImageOnlyQwen2VLProcessor` (`fixes/image_only_processor.py`: image processor and tokenizer only; videos are refused),
which saves the files a stock `Qwen2VLProcessor` writes. What it overrides and calls in transformers is
`PROCESSOR_CONTRACT`, checked when it is loaded. The model builds its 3-D (M-RoPE) positions from `mm_token_type_ids`
and `image_grid_thw`, which the processor returns and the collator passes on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import Qwen2VLProcessor

from hellbender.models.fixes.image_only_processor import image_only, processor_contract
from hellbender.models.fixes.image_only_processor import load_processor as load_image_only
from hellbender.models.fixes.processor_families import types_using

MODEL_TYPES = types_using("Qwen2VLProcessor")

ImageOnlyQwen2VLProcessor = image_only(
    Qwen2VLProcessor, "Qwen2-VL", video_processor_type="Qwen2VLVideoProcessor", saves_video_size=True
)
PROCESSOR_CONTRACT = processor_contract(Qwen2VLProcessor, "Qwen2-VL")


def load_processor(path: str | Path, **kwargs: Any):
    """`AutoProcessor.from_pretrained` where torchvision is installed; the image-only processor elsewhere."""
    return load_image_only(ImageOnlyQwen2VLProcessor, PROCESSOR_CONTRACT, path, **kwargs)
