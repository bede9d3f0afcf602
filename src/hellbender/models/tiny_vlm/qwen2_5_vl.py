"""A tiny Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`, random weights) with its tokenizer and processor.

Sizes (transformers 5.24): text hidden 64, 2 layers, 4 heads / 2 KV heads (head_dim 16, so the M-RoPE sections
[2, 3, 3] sum to head_dim / 2 = 8); vision hidden 32, 2 blocks (block 0 windowed, block 1 full attention),
patch 4, spatial merge 2, temporal patch 2. The image processor keeps images between 8x8 and 16x16 pixels
(`min_pixels=64`, `max_pixels=256`), so a 32x32 image becomes a 4x4 patch grid, i.e. 4 `<|image_pad|>` soft tokens.

Loading the processor: `AutoProcessor.from_pretrained(target)` needs torchvision, because `Qwen2_5_VLProcessor`
always loads a `Qwen2VLVideoProcessor` (a torchvision-only class; `ProcessorMixin.__init__` also refuses
`video_processor=None`). Without torchvision it raises `ImportError: Qwen2VLVideoProcessor requires the
Torchvision library`. `load_processor(target)` is the documented way: with torchvision it is plain
`AutoProcessor.from_pretrained`; without, it loads the same directory through `ImageOnlyQwen2_5_VLProcessor`, a
`Qwen2_5_VLProcessor` whose sub-processors are only the image processor and the tokenizer (images and text work;
videos are refused with a clear message). `build` writes `processor_class: Qwen2_5_VLProcessor` and a
`Qwen2VLVideoProcessor` entry (patch 4, merge 2, same pixel limits) into `processor_config.json`, so a machine
with torchvision loads the directory with `AutoProcessor` (checked with transformers 5.17 + torchvision 0.26).
The model loads with `AutoModelForImageTextToText.from_pretrained(target)`.

In the text, the chat template writes `<|vision_start|><|image_pad|><|vision_end|>` per image part; the processor
repeats `<|image_pad|>` once per soft token (grid_t * grid_h * grid_w / merge_size**2) and returns `pixel_values`
(all images' patches concatenated, one row per patch), `image_grid_thw` (one row per image) and
`mm_token_type_ids` (1 on image soft tokens). The model needs `mm_token_type_ids` together with `image_grid_thw`
to build the 3-D M-RoPE positions; without it the forward silently falls back to 1-D positions.
"""

from __future__ import annotations

from pathlib import Path

from hellbender.models.fixes.qwen2_5_vl import ImageOnlyQwen2_5_VLProcessor
from hellbender.models.tiny import build_tiny_tokenizer, tiny_decoder_config

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# The processor reads `image_token` / `video_token` from the tokenizer when it has them and otherwise falls back to
# these same strings; the model config needs the ids of all four.
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# ChatML; `content` is a string or a list of parts. An image part renders as the placeholder the processor expands
# into one `<|image_pad|>` per soft token; a video part likewise with `<|video_pad|>`.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- else -%}"
    "{{- raise_exception('Unsupported content part type: ' + part['type']|string) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- endif -%}"
)

PATCH_SIZE = 4
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2  # 8x8: one soft token
MAX_PIXELS = 16 * 16  # 16x16: 4x4 patches, 4 soft tokens


def build_tokenizer():
    return build_tiny_tokenizer(
        extra_special_tokens=VISION_TOKENS,
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_PAD,
        video_token=VIDEO_PAD,
        vision_start_token=VISION_START,
        vision_end_token=VISION_END,
    )


def build(target: Path) -> None:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    target = Path(target)
    tokenizer = build_tokenizer()
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True))
    text_config = {
        **tiny_decoder_config(tokenizer),
        # head_dim 16: the three M-RoPE sections (temporal, height, width) must sum to head_dim / 2.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        # window_size is in pixels: 8 // merge 2 // patch 4 = one merged token per window in block 0.
        "window_size": PATCH_SIZE * MERGE_SIZE,
        "fullatt_block_indexes": [1],
        "out_hidden_size": text_config["hidden_size"],
    }
    config = Qwen2_5_VLConfig(**token_ids(ids), text_config=text_config, vision_config=vision_config)
    torch.manual_seed(0)
    save_model_and_processor(
        Qwen2_5_VLForConditionalGeneration(config), ImageOnlyQwen2_5_VLProcessor, tokenizer, target
    )


def token_ids(ids: dict[str, int]) -> dict[str, object]:
    """The config fields of the vision tokens (Qwen2.5-VL's and Qwen3-VL's configs have the same)."""
    return {
        "image_token_id": ids[IMAGE_PAD],
        "video_token_id": ids[VIDEO_PAD],
        "vision_start_token_id": ids[VISION_START],
        "vision_end_token_id": ids[VISION_END],
        "tie_word_embeddings": False,
    }


def save_model_and_processor(model, processor_class: type, tokenizer, target: Path) -> None:
    """Save a tiny Qwen VL model that stops at the end of a ChatML turn, with its processor (`processor_class`: the
    family's image-only processor, which saves the stock processor's files)."""
    from transformers import GenerationConfig, Qwen2VLImageProcessorPil

    # ChatML turns end with <|im_end|>, so generation stops there as well as at <|endoftext|>.
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(target)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )
    processor = processor_class(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(target)
