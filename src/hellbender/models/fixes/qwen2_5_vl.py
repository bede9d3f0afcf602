"""Qwen2.5-VL: what hellbender needs for this family, checked against the installed transformers.

Processor: `Qwen2_5_VLProcessor` always loads a `Qwen2VLVideoProcessor`, which needs torchvision, so
`AutoProcessor.from_pretrained` fails on machines without it (ImportError). `load_processor` then loads the
same directory through `ImageOnlyQwen2_5_VLProcessor` (`fixes/image_only_processor.py`: image processor and tokenizer
only; videos are refused), which saves the files a stock `Qwen2_5_VLProcessor` writes, so the saved directory loads
anywhere. What it overrides and calls in transformers is `PROCESSOR_CONTRACT`, checked when it is loaded.

Batches: the model builds its 3-D (M-RoPE) image positions from `mm_token_type_ids` together with
`image_grid_thw`; without `mm_token_type_ids` it silently falls back to 1-D positions. The processor returns
both, and the collator passes every processor output on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import Qwen2_5_VLModel, Qwen2_5_VLProcessor

from hellbender.models.fixes.contract import Contract, Requirement
from hellbender.models.fixes.image_only_processor import image_only, processor_contract
from hellbender.models.fixes.image_only_processor import load_processor as load_image_only

MODEL_TYPES = ("qwen2_5_vl",)


ImageOnlyQwen2_5_VLProcessor = image_only(
    Qwen2_5_VLProcessor, "Qwen2.5-VL", video_processor_type="Qwen2VLVideoProcessor", saves_video_size=True
)
PROCESSOR_CONTRACT = processor_contract(Qwen2_5_VLProcessor, "Qwen2.5-VL")


def load_processor(path: str | Path, **kwargs: Any):
    """`AutoProcessor.from_pretrained` where torchvision is installed; the image-only processor elsewhere."""
    return load_image_only(ImageOnlyQwen2_5_VLProcessor, PROCESSOR_CONTRACT, path, **kwargs)


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
