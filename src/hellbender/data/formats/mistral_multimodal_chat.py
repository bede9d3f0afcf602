"""`type: chat_template` rows of a Mistral vision model with `tokenizer_use_mistral_common`: mistral-common encodes
the conversation with its images, as the checkpoint was trained. Each image becomes its own `[IMG]` rows, each
ended by `[IMG_BREAK]` and the last by `[IMG_END]`, sized by mistral-common's image encoder; turns are labelled as
text rows with mistral-common are (`mistral_chat`), and image tokens are never trained. The prepared row keeps
the image paths (or the decoded images, `cache_images`); pixels are made again at batch time
(`data.mistral_image_collator`), which checks that the images still give the same tokens.
"""

from __future__ import annotations

from typing import Any

from hellbender.data.formats.base import IGNORE_INDEX, FormatContext
from hellbender.data.formats.mistral_chat import encode_conversation
from hellbender.data.formats.multimodal_chat import conversation_with_images, vision_row


def _with_opened_images(messages: list[dict[str, Any]], images: list[Any]) -> list[dict[str, Any]]:
    """Each image part carrying its opened image, in order (mistral-common reads no path itself, so the sandboxing,
    size limit and `image_size` resizing of `data.images` hold)."""
    remaining = iter(images)
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image", "image": next(remaining)} if p["type"] == "image" else p for p in content]
        out.append({**message, "content": content})
    return out


def tokenize_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, Any]:
    vision = ctx.vision
    messages, paths, images = conversation_with_images(row, ctx)
    ids, labels, _ = encode_conversation(_with_opened_images(messages, images), ctx)
    labels = [IGNORE_INDEX if i in vision.vision_ids else label for i, label in zip(ids, labels, strict=True)]
    return vision_row(ids, labels, paths, images, "", vision)
