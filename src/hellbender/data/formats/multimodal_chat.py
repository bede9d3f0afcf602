"""`type: chat_template` rows for vision-language models: conversations with image parts.

The text is rendered and labelled exactly as for text models (see `chat_template`). The processor then
expands each image placeholder into the model's image tokens; labels follow the text tokens into the
expanded sequence by sequence alignment, and every image token stays unlabelled. Images are decoded once
here to catch bad files early; the cache keeps their paths, and pixels are processed again at batch time.
"""

from __future__ import annotations

import difflib
from typing import Any

from hellbender.data.formats.base import (
    IGNORE_INDEX,
    FormatContext,
    RowDropped,
    RowError,
    RowTooLong,
    special_ids_of,
)
from hellbender.data.formats.chat_template import (
    budgeted,
    conversation_labels,
    read_messages,
    refuse_weights_with_train_on_inputs,
    render_with_spans,
    template_failure,
)
from hellbender.data.formats.tool_calls import read_tools
from hellbender.data.images import (
    ImageProblem,
    image_header_size,
    image_reference,
    open_image,
    pack_pixels,
    resolve_image,
)
from hellbender.data.vision_tokens import image_token_floor


def attach_column_images(messages: list[dict[str, Any]], refs: list[Any]) -> list[dict[str, Any]]:
    """Rows with plain-text messages and an image column: all the images go, in order, before the text of
    the first user message."""
    if any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"]) for m in messages):
        raise RowError("the row has both image parts in its messages and an image column; use one of them")
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise RowError("the row has images but no user message to attach them to")
    out = []
    for i, message in enumerate(messages):
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        if i == first_user:
            parts = [{"type": "image", "path": ref} for ref in refs] + parts
        out.append({**message, "content": parts})
    return out


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the template sees them: image parts without their paths (nothing is loaded while rendering)."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{"type": "image"} if p["type"] == "image" else p for p in content]
        out.append({**m, "content": content})
    return out


def align_labels(source_ids: list[int], source_labels: list[int], target_ids: list[int]) -> list[int]:
    """Carry labels from the unexpanded token sequence to the processor's expanded one.

    Matching runs of equal tokens keep their labels; every token the expansion inserted is unlabelled. The
    trained tokens must all survive the alignment, or the row is refused rather than mislabelled.
    """
    matcher = difflib.SequenceMatcher(None, source_ids, target_ids, autojunk=False)
    labels = [IGNORE_INDEX] * len(target_ids)
    for a, b, size in matcher.get_matching_blocks():
        labels[b : b + size] = source_labels[a : a + size]
    trained_before = sum(1 for x in source_labels if x != IGNORE_INDEX)
    trained_after = sum(1 for x in labels if x != IGNORE_INDEX)
    if trained_before != trained_after:
        raise RowError(
            f"the processor's image expansion changed the trained text ({trained_before} trained tokens before, "
            f"{trained_after} after); the row cannot be labelled exactly"
        )
    return labels


def bad_image(exc: ImageProblem, vision: Any) -> Exception:
    """A bad image refuses its row, or drops it with `skip_bad_images`."""
    if vision.skip_bad_images:
        return RowDropped(exc.reason)
    return RowError(f"{exc}. Fix the file, or set `skip_bad_images: true` to drop such rows")


def located_images(row: dict[str, Any], ctx: FormatContext) -> tuple[list[dict[str, Any]], list, list]:
    """The row's messages (an image column's images placed in the first user message), the local paths of its
    images in order and their sizes as the model sees them, read from the file headers without decoding (bad or
    unreachable files refuse the row, or drop it with `skip_bad_images`)."""
    vision = ctx.vision
    messages = read_messages(row, ctx, allow_parts=True)
    column = row.get(vision.image_column)
    if column:
        messages = attach_column_images(messages, list(column))
    try:
        paths = [resolve_image(image_reference(p), vision.policy) for p in image_parts(messages)]
        sizes = [image_header_size(path, vision.policy) for path in paths]
    except ImageProblem as exc:
        raise bad_image(exc, vision) from None
    return messages, paths, sizes


def open_images(paths: list[Any], vision: Any) -> list[Any]:
    """The images decoded (bad ones refuse the row, or drop it with `skip_bad_images`)."""
    try:
        return [open_image(path, vision.policy) for path in paths]
    except ImageProblem as exc:
        raise bad_image(exc, vision) from None


def conversation_with_images(row: dict[str, Any], ctx: FormatContext) -> tuple[list[dict[str, Any]], list, list]:
    """`located_images`, with the images opened."""
    messages, paths, _ = located_images(row, ctx)
    return messages, paths, open_images(paths, ctx.vision)


def counted_placeholders(ids: list[int], images: int, vision: Any, rendered: str) -> int:
    """The image placeholders in the rendered `ids` (the rendered text, or prompt), which must be one per image."""
    placeholders = sum(1 for i in ids if i == vision.placeholder_id)
    if placeholders != images:
        raise RowError(
            f"the rendered {rendered} has {placeholders} image placeholder(s) but the row has {images} image(s); "
            "each image part must be rendered by the chat template exactly once"
        )
    return placeholders


def check_length_floor(text_tokens: int, placeholders: int, sizes: list[Any], vision: Any) -> None:
    """Stop a row that cannot fit `sequence_len` before its images are decoded and processed: its text tokens plus
    a lower bound on what its images expand into (from their sizes) already exceed it."""
    floor = text_tokens - placeholders + image_token_floor(vision.processor, sizes)
    if floor > vision.max_tokens:
        raise RowTooLong(floor)


def tokenize_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, Any]:
    vision = ctx.vision
    processor, tok = vision.processor, ctx.tokenizer
    messages, paths, sizes = located_images(row, ctx)
    tools = read_tools(row, ctx.tools_field)
    extra = {"tools": tools} if tools else {}

    def render(msgs: list[dict[str, Any]]) -> str:
        try:
            return budgeted(
                ctx.chat_template,
                lambda: processor.apply_chat_template(
                    messages_for_template(msgs), chat_template=ctx.chat_template, tokenize=False, **extra
                ),
            )
        except Exception as exc:  # jinja raises many kinds for bad conversations
            raise template_failure(exc, ctx.template_source) from None

    text, located = render_with_spans(render, messages, ctx.thinking_key)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    placeholders = counted_placeholders(ids, len(paths), vision, "text")
    check_length_floor(len(ids), placeholders, sizes, vision)
    if ctx.train_on_inputs:
        refuse_weights_with_train_on_inputs(messages)
        labels = list(ids)
    else:
        labels = conversation_labels(
            text, located, messages, ids, enc["offset_mapping"], special_ids_of(ctx), ctx, vision.image_ids
        )
    images = open_images(paths, vision)
    expanded = expand(processor, text, images)
    # Image tokens are unlabelled before the alignment (only text must survive it) and after it (whatever the
    # expansion added).
    labels = [IGNORE_INDEX if i in vision.vision_ids else label for i, label in zip(ids, labels, strict=True)]
    labels = align_labels(ids, labels, expanded)
    labels = [IGNORE_INDEX if i in vision.vision_ids else label for i, label in zip(expanded, labels, strict=True)]
    return vision_row(expanded, labels, paths, images, text, vision)


def vision_row(ids: list[int], labels: list[int], paths: list[Any], images: list[Any], text: str, vision: Any):
    """A prepared vision-language row: tokens, labels, the text and image paths the collator processes again (and
    the directory they must still lie inside when it opens them), and the decoded images themselves when the config
    caches them."""
    pixels = pack_pixels(images) if vision.cache_images else []
    return {
        "input_ids": ids,
        "labels": labels,
        "images": [str(p) for p in paths],
        "text": text,
        "pixels": pixels,
        "image_base_dir": str(vision.policy.base_dir.resolve()),
    }


def expand(processor: Any, text: str, images: list[Any]) -> list[int]:
    """The processor's token ids for one rendered conversation with its images."""
    # What a family's processor needs in this call, set where it was loaded (models/fixes/ovis2.py: arrays).
    extra = getattr(processor, "hellbender_row_call_kwargs", {})
    try:
        out = processor(text=[text], images=[images] if images else None, add_special_tokens=False, **extra)
    except (ValueError, TypeError) as exc:
        raise RowError(f"the processor refused the row: {exc}") from None
    ids = out["input_ids"][0]
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)
