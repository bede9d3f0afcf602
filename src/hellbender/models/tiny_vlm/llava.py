"""Tiny LLaVA-1.5 (`hellbender/tiny-llava`): a CLIP vision tower, a two-layer MLP projector and a Llama.

Random weights from a fixed seed, saved like a hub checkpoint, so that
`AutoProcessor.from_pretrained(path)` and `AutoModelForImageTextToText.from_pretrained(path)` load it
through the same code path as `llava-hf/llava-1.5-7b-hf` (no torchvision needed: the processor uses
`CLIPImageProcessorPil`, which `AutoProcessor` also picks when torchvision is missing).

Shapes: images are resized and cropped to 32 x 32 and cut into 8 x 8 patches, so the vision tower sees
16 patches + CLS; with `vision_feature_select_strategy="default"` the CLS position is dropped and each
image becomes exactly `IMAGE_SEQ_LENGTH` = 16 `<image>` tokens. The processor expands each `<image>` in
the text into those 16 tokens ((32 // 8) ** 2 + `num_additional_image_tokens` 1 - 1 for "default").
As in LLaVA-1.5, features come from the vision tower's second-to-last layer (`vision_feature_layer=-2`), so
its last encoder layer and `post_layernorm` never receive a gradient.

Chat format (LLaVA-1.5 / Vicuna v1 style, the tokenizer's EOS `<|endoftext|>` ends each assistant turn):

    [system text + " "]USER: <image>\\nWhat is this? ASSISTANT: A cat.<|endoftext|>USER: ... ASSISTANT:

String contents are inserted verbatim (so hellbender's placeholder-based turn locator works). A content
given as a list of parts renders `{"type": "text"}` parts as their text and `{"type": "image"}` parts as
`<image>`, with a newline between an image and whatever part follows it.
"""

from __future__ import annotations

from pathlib import Path

from hellbender.models.tiny import build_tiny_tokenizer, tiny_decoder_config

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH_SIZE = 8
# CLIP prepends a CLS embedding; the "default" strategy drops it again before the projector.
NUM_ADDITIONAL_IMAGE_TOKENS = 1
VISION_FEATURE_SELECT_STRATEGY = "default"
IMAGE_SEQ_LENGTH = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16 image tokens per image

# Written for this model (LLaVA-1.5 / Vicuna v1 layout). Every tag trims the template's own whitespace, so only
# the quoted strings and the message contents reach the output; contents are inserted verbatim (not stripped).
LLAVA_CHAT_TEMPLATE = """\
{%- set eot = eos_token if eos_token is defined else '<|endoftext|>' -%}
{%- macro render(content) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- else -%}
    {%- for part in content -%}
      {%- if part['type'] == 'image' -%}
        {{- '<image>' -}}
        {%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}
      {%- elif part['type'] == 'text' -%}
        {{- part['text'] -}}
      {%- else -%}
        {{- raise_exception('LLaVA chat template: unsupported content part type ' ~ part['type']) -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {{- render(message['content']) ~ ' ' -}}
  {%- elif message['role'] == 'user' -%}
    {{- 'USER: ' ~ render(message['content']) ~ ' ' -}}
  {%- elif message['role'] == 'assistant' -%}
    {{- 'ASSISTANT: ' ~ render(message['content']) ~ eot -}}
  {%- else -%}
    {{- raise_exception('LLaVA chat template: unknown role ' ~ message['role']) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- 'ASSISTANT:' -}}
{%- endif -%}
"""


def build_tokenizer():
    """The tiny BPE tokenizer with `<image>` registered as the special `image_token` and the LLaVA template."""
    return build_tiny_tokenizer(chat_template=LLAVA_CHAT_TEMPLATE, image_token=IMAGE_TOKEN)


def build_processor(tokenizer=None):
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy=VISION_FEATURE_SELECT_STRATEGY,
        num_additional_image_tokens=NUM_ADDITIONAL_IMAGE_TOKENS,
        image_token=IMAGE_TOKEN,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )


def build_config(tokenizer):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision_config = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=32,
    )
    text_config = LlamaConfig(**tiny_decoder_config(tokenizer))
    return LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=IMAGE_SEQ_LENGTH,
        vision_feature_select_strategy=VISION_FEATURE_SELECT_STRATEGY,
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build(target: Path) -> None:
    """Save the tiny LLaVA model, its tokenizer and its `LlavaProcessor` into `target`."""
    import torch
    from transformers import LlavaForConditionalGeneration

    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)
    config = build_config(tokenizer)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(target)
    processor.save_pretrained(target)  # also writes the tokenizer files and the chat template
