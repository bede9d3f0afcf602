"""`type: multimodal_pretrain`: raw image+text documents for continued pretraining of a vision-language model.

A row holds text with one image token per image (`text_column`) and the image paths (`image_column`). The
text is tokenized once, without truncation, by the processor's own tokenizer; images are counted by token
id (so `<image>` inside `<image_soft_token>` never counts) and must match the row's images; EOS is appended
once. The processor then expands the images. Every text token is trained, no image token is, and a row
longer than `sequence_len` is dropped and counted, or refused with its index under `excess_length_strategy: raise`
(dropped whatever the strategy with `skip_bad_images`), never truncated through an image.
"""

from __future__ import annotations

from typing import Any

from hellbender.data.formats.base import (
    DROP_TOO_LONG,
    IGNORE_INDEX,
    FormatContext,
    RowDropped,
    RowError,
    RowTooLong,
    text_value,
)
from hellbender.data.formats.multimodal_chat import align_labels, bad_image, expand, vision_row
from hellbender.data.images import ImageProblem, image_header_size, image_reference, open_image, resolve_image
from hellbender.data.vision_tokens import image_token_floor


def document_text(text: str, tokenizer: Any) -> str:
    """The text as the model sees it: BOS first when the tokenizer adds one, EOS last exactly once."""
    bos = tokenizer.bos_token
    if bos and tokenizer("x", add_special_tokens=True)["input_ids"][:1] == [tokenizer.bos_token_id]:
        text = text if text.startswith(bos) else bos + text
    eos = tokenizer.eos_token
    if not eos:
        raise RowError("the tokenizer has no EOS token; set one with `special_tokens: {eos_token: ...}`")
    return text if text.endswith(eos) else text + eos


def tokenize_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, Any]:
    vision = ctx.vision
    processor, tok = vision.processor, ctx.tokenizer
    text = text_value(row, ctx.text_field)
    refs = row.get(vision.image_column) or []
    if not isinstance(refs, list):
        raise RowError(f"column `{vision.image_column}` must be a list of image paths")
    text = document_text(text, tok)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    placeholders = sum(1 for i in ids if i == vision.placeholder_id)
    if placeholders != len(refs):
        token = tok.convert_ids_to_tokens(vision.placeholder_id)
        raise RowError(
            f"the text has {placeholders} image token(s) `{token}` but the row has {len(refs)} image(s); write "
            "one image token in the text for each image"
        )
    try:
        paths = [resolve_image(image_reference(ref), vision.policy) for ref in refs]
        sizes = [image_header_size(path, vision.policy) for path in paths]
    except ImageProblem as exc:
        raise bad_image(exc, vision) from None
    # Checked before any image is decoded or processed, from the text and the image sizes alone, then exactly.
    floor = len(ids) - placeholders + image_token_floor(processor, sizes)
    if floor > vision.max_tokens:
        raise RowDropped(DROP_TOO_LONG) if vision.skip_bad_images else RowTooLong(floor)
    try:
        images = [open_image(path, vision.policy) for path in paths]
    except ImageProblem as exc:
        raise bad_image(exc, vision) from None
    model_text = processor_text(text, vision.placeholder_id, processor, tok)
    expanded = expand(processor, model_text, images)
    if len(expanded) > vision.max_tokens and vision.skip_bad_images:
        raise RowDropped(DROP_TOO_LONG)
    # Otherwise a row still too long is kept whole here: `excess_length_strategy` drops or refuses it
    # (`tokenize.encode_row`), and truncation, which could cut an image, is refused with a processor.
    # Every text token is trained; labels follow the text into the expansion, so whatever the processor inserts
    # for an image (soft tokens, markers, even the newlines between tiles) stays unlabelled.
    text_labels = [IGNORE_INDEX if i in vision.vision_ids else i for i in ids]
    labels = align_labels(tok(model_text, add_special_tokens=False)["input_ids"], text_labels, expanded)
    labels = [IGNORE_INDEX if i in vision.vision_ids else label for i, label in zip(expanded, labels, strict=True)]
    return vision_row(expanded, labels, paths, images, model_text, vision)


def processor_text(text: str, placeholder_id: int, processor: Any, tokenizer: Any) -> str:
    """The text with the dataset's image token replaced by the processor's own, which it expands."""
    own = getattr(processor, "image_token", None)
    token = tokenizer.convert_ids_to_tokens(placeholder_id)
    return text if token == own or own is None else text.replace(token, own)
