"""A tiny Qwen3-VL (`Qwen3VLForConditionalGeneration`, random weights) with its tokenizer and processor.

The tokenizer, chat template and image processor settings are the tiny Qwen2.5-VL's (`tiny_vlm/qwen2_5_vl.py`): a
32x32 image becomes a 4x4 grid of 4-pixel patches, merged 2x2 into 4 `<|image_pad|>` soft tokens. Sizes
(transformers 5.24): text hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 16, so the interleaved M-RoPE sections
[2, 3, 3] sum to head_dim / 2; vision hidden 32, 2 blocks, a 4x4 learned position grid (resampled to each image's
grid), and the first block's features added to the first language layer's image tokens (DeepStack).

Without torchvision the processor loads as `fixes/qwen3_vl.ImageOnlyQwen3VLProcessor` (`load_processor`), which
saves a stock `Qwen3VLProcessor` directory with a `Qwen3VLVideoProcessor` entry.
"""

from __future__ import annotations

from pathlib import Path

from hellbender.models.tiny import tiny_decoder_config
from hellbender.models.tiny_vlm.qwen2_5_vl import (
    MERGE_SIZE,
    PATCH_SIZE,
    TEMPORAL_PATCH_SIZE,
    VISION_TOKENS,
    build_tokenizer,
    save_model_and_processor,
    token_ids,
)


def build(target: Path) -> None:
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from hellbender.models.fixes.qwen3_vl import ImageOnlyQwen3VLProcessor

    target = Path(target)
    tokenizer = build_tokenizer()
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True))
    text_config = {
        **tiny_decoder_config(tokenizer),
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "num_position_embeddings": 16,  # a 4x4 grid, as the largest image's patches
        "deepstack_visual_indexes": [0],
        "out_hidden_size": text_config["hidden_size"],
    }
    config = Qwen3VLConfig(**token_ids(ids), text_config=text_config, vision_config=vision_config)
    torch.manual_seed(0)
    save_model_and_processor(Qwen3VLForConditionalGeneration(config), ImageOnlyQwen3VLProcessor, tokenizer, target)
