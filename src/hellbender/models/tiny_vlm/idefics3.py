"""Tiny Idefics3 (SmolVLM-style) model: SigLIP-like vision encoder, pixel-shuffle connector, tiny Llama.

`build(target)` saves an `Idefics3ForConditionalGeneration` with random weights (seed 0), its tokenizer and an
`Idefics3Processor` (PIL image processor, so no torchvision is needed) into `target`; both
`AutoProcessor.from_pretrained(target)` and `AutoModelForImageTextToText.from_pretrained(target)` load them.

Sizes are chosen so that every code path of the real model runs on tiny inputs:

- vision tiles are 32x32 pixels with 8x8 patches -> 16 patches, pixel shuffle by 2 -> 4 `<image>` tokens per tile;
- the image processor resizes every image so that its longest edge is 64 (smaller images are upscaled, as in
  SmolVLM), rounds both sides up to multiples of 32 and cuts 32x32 tiles. A square image becomes 2x2 tiles
  (`<row_1_col_1>` ... `<row_2_col_2>`) plus a 32x32 global view (`<global-img>`): 5 tiles, 20 `<image>` tokens;
  a 64x32 (h x w) image gives 2x1 tiles + global. With `do_image_splitting=False` (a processor call kwarg) an
  image is the global view only: `<fake_token_around_image><global-img>` + 4 x `<image>` + `<fake_token_around_image>`.

Chat format (SmolVLM): `<|im_start|>User:<image>What is this?<end_of_utterance>\\nAssistant: answer<end_of_utterance>\\n`;
the generation prompt is `<|im_start|>Assistant:` (the answer then starts with a space). EOS is `<end_of_utterance>`.
"""

from __future__ import annotations

from pathlib import Path

IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
# Idefics3Processor looks up `<row_{i}_col_{j}>` for i, j in 1..6 (its hard-coded grid), whatever the image size.
ROW_COL_TOKENS = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))

VISION_IMAGE_SIZE = 32
PATCH_SIZE = 8
SCALE_FACTOR = 2
LONGEST_EDGE = 64  # images are first resized so that their longest edge is this
# Tokens per tile: (32 / 8)^2 patches, merged 2x2 by the connector's pixel shuffle.
IMAGE_SEQ_LEN = (VISION_IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2

# SmolVLM-style template, written for hellbender. Roles are capitalised (`User`, `Assistant`, `System`); content is a
# string or a list of {"type": "text", "text": ...} / {"type": "image"} parts, an image part rendering as `<image>`.
# After `Role:` comes a space unless the content starts with an image.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if content is string -%}"
    "{%- set starts_with_image = content.startswith('<image>') -%}"
    "{%- else -%}"
    "{%- set starts_with_image = content | length > 0 and content[0]['type'] == 'image' -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] | capitalize + (':' if starts_with_image else ': ') -}}"
    "{%- if content is string -%}"
    "{{- content -}}"
    "{%- else -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}"
    "{{- '<image>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<end_of_utterance>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>Assistant:' -}}"
    "{%- endif -%}"
)


def build_tokenizer():
    """Tiny BPE + `<image>`, `<fake_token_around_image>`, `<global-img>`, the 36 row/column markers and
    `<end_of_utterance>` (also the EOS token, as in SmolVLM)."""
    from hellbender.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(
        extra_special_tokens=(FAKE_IMAGE_TOKEN, IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, END_OF_UTTERANCE, *ROW_COL_TOKENS),
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )
    tokenizer.eos_token = END_OF_UTTERANCE
    return tokenizer


def build_processor(tokenizer):
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=True,
        size={"longest_edge": LONGEST_EDGE},
        max_image_size={"longest_edge": VISION_IMAGE_SIZE},
    )
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )


def build(target: Path) -> None:
    import torch
    from transformers import GenerationConfig, Idefics3Config, Idefics3ForConditionalGeneration

    from hellbender.models.tiny import tiny_decoder_config

    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)  # may add tokens to the tokenizer (all present already)
    eos_ids = [tokenizer.convert_tokens_to_ids(END_OF_UTTERANCE), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    config = Idefics3Config(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": VISION_IMAGE_SIZE,
            "patch_size": PATCH_SIZE,
        },
        text_config={"model_type": "llama", **tiny_decoder_config(tokenizer, eos_ids[0]), "rms_norm_eps": 1e-5},
        scale_factor=SCALE_FACTOR,
        image_token_id=processor.image_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(target)
    processor.save_pretrained(target)  # writes the tokenizer files too
