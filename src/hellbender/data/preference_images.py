"""Preference pairs whose prompt holds images, for vision-language models (`processor_type` with
`type: chat_template.default` or `chat_template.argilla_chat`).

The prompt messages (image parts, or an image column placed before the first user message's text, exactly as for
multimodal SFT chat rows) are rendered with the processor's chat template; the text is tokenized as for text pairs
(each answer must continue the prompt's tokens), and the processor then expands each image placeholder of the
prompt into the model's image tokens, as multimodal SFT expands them. So `prompt_ids` hold the image tokens, and
`chosen_ids` / `rejected_ids` continue them exactly; answers are text only, and nothing of the prompt is trained.

A prepared row also keeps what the collator (`data/preference_collator.py`) needs to give the model the pixels again:
the rendered prompt text, its image paths and the directory they must stay inside (never in columns named `image` or
`images`, which would switch TRL to its own vision path that tokenizes raw text at batch time).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hellbender.config import DatasetEntry, HellbenderConfig
from hellbender.data.contexts import vision_context
from hellbender.data.formats.base import RowDropped, RowError, RowTooLong, VisionContext
from hellbender.data.formats.chat_template import budgeted, template_failure
from hellbender.data.formats.multimodal_chat import (
    attach_column_images,
    bad_image,
    check_length_floor,
    counted_placeholders,
    expand,
    image_parts,
    messages_for_template,
    open_images,
)
from hellbender.data.formats.preference_rows import PreferenceContext, PreferenceText, template_messages
from hellbender.data.images import ImageProblem, image_header_size, image_reference, pack_pixels, resolve_image
from hellbender.data.preference import Limits, fit_preference_row, tokenize_texts
from hellbender.errors import DataError

# The columns a prepared vision pair adds to `prompt_ids` / `chosen_ids` / `rejected_ids`.
PROMPT_TEXT = "prompt_text"  # the rendered prompt, image placeholders unexpanded: the processor's input again
PROMPT_IMAGES = "prompt_images"  # the prompt's image paths, in order
BASE_DIR = "image_base_dir"  # the directory those paths must still lie inside when the collator opens them
PIXELS = "pixels"  # the decoded images themselves, with `cache_images`
VISION_PAIR_COLUMNS = (PROMPT_TEXT, PROMPT_IMAGES, BASE_DIR, PIXELS)


def vision_preference_context(
    entry: DatasetEntry, cfg: HellbenderConfig, ctx: PreferenceContext, processor: Any, where: str
) -> tuple[PreferenceContext, VisionContext]:
    """The entry's preference context for image rows (message contents may be parts; the processor's own template
    unless the config names another), and its vision context (processor, image tokens, image sandbox)."""
    template = ctx.template
    name = entry.chat_template or cfg.chat_template
    jinja = entry.chat_template_jinja if entry.chat_template_jinja is not None else cfg.chat_template_jinja
    if name in (None, "tokenizer_default") and not jinja and getattr(processor, "chat_template", None):
        template = processor.chat_template  # a VLM's own template lives with its processor
    return replace(ctx, template=template, allow_parts=True), vision_context(entry, cfg, processor, where)


def _prompt_with_images(row: dict[str, Any], ctx: PreferenceContext, vision: VisionContext):
    """(prompt, chosen, rejected) messages, the image column's images placed in the prompt's first user message."""
    prompt, chosen, rejected = template_messages(row, ctx)
    column = row.get(vision.image_column)
    if column:
        prompt = attach_column_images(list(prompt), list(column))
    return prompt, chosen, rejected


def _render(ctx: PreferenceContext, processor: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    try:
        return budgeted(
            ctx.template,
            lambda: processor.apply_chat_template(
                messages_for_template(messages),
                chat_template=ctx.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            ),
        )
    except Exception as exc:  # jinja raises many kinds for bad conversations
        raise template_failure(exc, ctx.template_source) from None


def tokenize_vision_pair(row: dict[str, Any], ctx: PreferenceContext, vision: VisionContext) -> dict[str, Any]:
    """A row's prompt ids with its images expanded, the answers' ids after them, and the image columns."""
    processor = vision.processor
    prompt, chosen, rejected = _prompt_with_images(row, ctx, vision)
    try:
        paths = [resolve_image(image_reference(p), vision.policy) for p in image_parts(prompt)]
        sizes = [image_header_size(path, vision.policy) for path in paths]
    except ImageProblem as exc:
        raise bad_image(exc, vision) from None
    text = _render(ctx, processor, prompt, generation_prompt=True)
    # The template's text after the answer's end-of-turn (a newline before the next turn) is not part of the answer.
    full = {
        name: _render(ctx, processor, [*prompt, answer], False).rstrip()
        for name, answer in (("chosen", chosen), ("rejected", rejected))
    }
    out = tokenize_texts(PreferenceText(prompt=text, full=full, label=None, special_tokens=False), ctx.tokenizer)
    ids = out["prompt_ids"]
    placeholders = counted_placeholders(ids, len(paths), vision, "prompt")
    for name in ("chosen", "rejected"):
        if any(i in vision.vision_ids for i in out[f"{name}_ids"]):
            raise RowError(
                f"the {name} answer holds image tokens ({processor.tokenizer.decode(out[f'{name}_ids'])!r}); "
                "images belong in the prompt, and an answer is the model's text"
            )
    longest = max(len(out["chosen_ids"]), len(out["rejected_ids"]))
    check_length_floor(len(ids) + longest, placeholders, sizes, vision)
    images = open_images(paths, vision)
    expanded = expand(processor, text, images)
    # The expansion replaces placeholders only: the text after the last image must end the expanded prompt unchanged,
    # or the answers would not continue it.
    tail = _after_last_image(ids, vision)
    if expanded[len(expanded) - len(tail) :] != tail:
        raise RowError(
            "the processor's image expansion changed the prompt's text after its last image, so the answers would not "
            "continue the prompt's tokens exactly"
        )
    out["prompt_ids"] = expanded
    return {
        **out,
        PROMPT_TEXT: text,
        PROMPT_IMAGES: [str(p) for p in paths],
        BASE_DIR: str(vision.policy.base_dir.resolve()),
        PIXELS: pack_pixels(images) if vision.cache_images else [],
    }


def _after_last_image(ids: list[int], vision: VisionContext) -> list[int]:
    last = max((i for i, token in enumerate(ids) if token in vision.vision_ids), default=-1)
    return ids[last + 1 :]


def encode_vision_pair(
    row: dict[str, Any], index: int, ctx: PreferenceContext, limits: Limits, where: str, vision: VisionContext
) -> dict[str, Any]:
    """One image row as the preference trainer takes it, plus `drop_reason` ('' for a kept row). A row too long for
    `sequence_len` (or a prompt over `max_prompt_len`) is dropped or refused, never cut: cutting could split an image's
    tokens, and validation allows only `excess_length_strategy: drop` or `raise` with a processor."""
    try:
        out = tokenize_vision_pair(row, ctx, vision)
    except RowError as exc:
        raise DataError(f"{where}, row {index}: {exc}.") from None
    except RowTooLong as exc:
        if limits.strategy == "raise":
            raise DataError(
                f"{where}, row {index}: at least {exc.tokens} tokens with its images expanded, more than "
                f"`sequence_len: {limits.sequence_len}`. Raise `sequence_len`, shorten the row, or set "
                "`excess_length_strategy: drop`."
            ) from None
        return {**empty_vision_pair(), "drop_reason": str(exc)}
    except RowDropped as exc:  # a bad image with `skip_bad_images`
        return {**empty_vision_pair(), "drop_reason": str(exc)}
    reason = fit_preference_row(out, ("chosen", "rejected"), limits, where, index)
    return {**out, "drop_reason": reason}


def empty_vision_pair() -> dict[str, Any]:
    return {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], PROMPT_TEXT: "", PROMPT_IMAGES: [],
            BASE_DIR: "", PIXELS: []}  # fmt: skip


def vision_pair_features():
    import datasets

    from hellbender.data.preference import preference_features

    columns = dict(preference_features(kto=False))
    columns |= {
        PROMPT_TEXT: datasets.Value("string"),
        PROMPT_IMAGES: datasets.List(datasets.Value("string")),
        BASE_DIR: datasets.Value("string"),
        PIXELS: datasets.List(
            {"width": datasets.Value("int32"), "height": datasets.Value("int32"), "rgb": datasets.Value("binary")}
        ),
    }
    return datasets.Features(columns)
