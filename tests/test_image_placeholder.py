"""Which token hellbender counts as one image in the rendered text: the one the chat template writes and the
processor expands."""

from __future__ import annotations

from types import SimpleNamespace

import hellbender.data.formats.multimodal_chat  # noqa: F401  (the data layer in its usual import order)
from hellbender.data.vision_tokens import image_placeholder_id
from hellbender.models.tiny import build_tiny_tokenizer


def test_a_processor_with_its_own_placeholder_token_is_counted_by_it() -> None:
    # Qianfan-OCR's layout: the template writes `<image>`, the processor repeats `<IMG_CONTEXT>` in its place
    tokenizer = build_tiny_tokenizer(["<image>", "<IMG_CONTEXT>"])
    processor = SimpleNamespace(tokenizer=tokenizer, image_token="<IMG_CONTEXT>", image_placeholder_token="<image>")
    assert image_placeholder_id(processor) == tokenizer.convert_tokens_to_ids("<image>")


def test_otherwise_the_processors_image_token_is_counted() -> None:
    tokenizer = build_tiny_tokenizer(["<image>", "<IMG_CONTEXT>"])
    processor = SimpleNamespace(tokenizer=tokenizer, image_token="<IMG_CONTEXT>")
    assert image_placeholder_id(processor) == tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
