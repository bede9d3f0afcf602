"""The tokens of a vision-language processor that belong to images (never trained; the placeholder the text
carries once per image) and the processor's fingerprint for the prepared-data cache."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from hellbender.data.formats.mistral_chat import is_mistral_common
from hellbender.errors import ConfigError

# Processor attributes that name tokens belonging to images or videos (placeholders, soft tokens, markers).
VISION_TOKEN_ATTRIBUTES = (
    "image_token",
    "boi_token",
    "eoi_token",
    "video_token",
    "boa_token",
    "eoa_token",
    "audio_token",
    "fake_image_token",
    "global_image_tag",
    "global_image_token",
    "image_start_token",
    "image_end_token",
    "vision_start_token",
    "vision_end_token",
    "image_pad_token",
    "video_pad_token",
)
# Tile / row / column markers of processors that split images into tiles.
TILE_MARKER = re.compile(r"^<(row_\d+_col_\d+|tile_\d+|global-img|image_\d+)>$")


def vision_token_ids(processor: Any, extra_tokens: list[str]) -> set[int]:
    """Ids of every token that belongs to an image: never trained, whatever the conversation says."""
    tokenizer = processor.tokenizer
    if is_mistral_common(tokenizer):  # its image encoder names them; the vocabulary has no image attributes
        return set(processor.image_token_ids) | _named_ids(tokenizer, extra_tokens)
    names = [getattr(processor, attr, None) for attr in VISION_TOKEN_ATTRIBUTES]
    names += [getattr(tokenizer, attr, None) for attr in VISION_TOKEN_ATTRIBUTES]
    names += [tok for tok in tokenizer.get_vocab() if TILE_MARKER.match(tok)]
    ids = set()
    for name in names:
        if isinstance(name, str) and name:
            token_id = tokenizer.convert_tokens_to_ids(name)
            if token_id is not None and token_id != tokenizer.unk_token_id:
                ids.add(token_id)
    for attr in ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id"):
        value = getattr(processor, attr, None)
        if isinstance(value, int):
            ids.add(value)
    return ids | _named_ids(tokenizer, extra_tokens)


def _named_ids(tokenizer: Any, extra_tokens: list[str]) -> set[int]:
    """The ids of `vision_tokens_to_mask`, each of which must be a token of the tokenizer."""
    ids = {tokenizer.convert_tokens_to_ids(t) for t in extra_tokens}
    missing = [t for t in extra_tokens if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise ConfigError(f"`vision_tokens_to_mask`: {', '.join(missing)} not in the tokenizer's vocabulary.")
    return ids


def image_placeholder_id(processor: Any, override: str | None = None) -> int:
    """The token that marks one image in the text, which the processor expands: the processor's image token
    (every family hellbender knows), or a dataset's `image_token`, which must be a special token."""
    tokenizer = processor.tokenizer
    if is_mistral_common(tokenizer):  # validation refuses a dataset's `image_token` with mistral-common
        return processor.image_token_id
    if override is not None:
        token_id = tokenizer.convert_tokens_to_ids(override)
        special = {tok.content for tok in tokenizer.added_tokens_decoder.values() if tok.special}
        if override not in special or token_id in (None, tokenizer.unk_token_id):
            raise ConfigError(
                f"`image_token: {override}` is not a special token of the tokenizer, so it could not be counted "
                f"exactly; use one of the processor's image tokens (e.g. `{getattr(processor, 'image_token', '?')}`) "
                "or add it with `special_tokens`."
            )
        return token_id
    # Qianfan-OCR's template writes a placeholder (`<image>`) that its processor expands into other tokens, the
    # repeated one of which is its `image_token`
    token = getattr(processor, "image_placeholder_token", None) or getattr(processor, "image_token", None)
    if not token:
        raise ConfigError(f"{type(processor).__name__} names no image token; hellbender cannot count its images.")
    return tokenizer.convert_tokens_to_ids(token)


def processor_fingerprint(processor: Any) -> str:
    """Everything about the processor that changes prepared rows: image processor settings, chat template,
    the image tokens (the tokenizer is fingerprinted separately)."""
    if is_mistral_common(processor.tokenizer):  # no transformers image processor: its image encoder's settings
        return processor.fingerprint()
    h = hashlib.sha256()
    h.update(type(processor).__name__.encode())
    h.update(json.dumps(processor.image_processor.to_dict(), sort_keys=True, default=str).encode())
    h.update(str(getattr(processor, "chat_template", None)).encode())
    for attr in VISION_TOKEN_ATTRIBUTES + ("num_image_tokens", "image_seq_length", "patch_size"):
        h.update(f"{attr}={getattr(processor, attr, None)}".encode())
    return h.hexdigest()


def image_token_floor(processor: Any, sizes: list[tuple[int, int]]) -> int:
    """A lower bound on the tokens the processor expands images of these (width, height) sizes into, known from the
    sizes alone (no pixels are processed): the processor's own per-size count where it offers one (the count that
    serving engines plan with), else one token per image. Used to drop a row that cannot fit before its images are
    decoded; the exact length is still checked after the expansion."""
    if not sizes:
        return 0
    counter = getattr(processor, "_get_num_multimodal_tokens", None)
    if counter is None:
        return len(sizes)
    try:
        # Either argument order gives a lower bound: the smaller of the two counts.
        counts = [min(_count(counter, (height, width)), _count(counter, (width, height))) for width, height in sizes]
    except Exception:  # a processor whose count needs more than a size: fall back to the trivial bound
        return len(sizes)
    return sum(max(1, c) for c in counts)


def _count(counter: Any, size: tuple[int, int]) -> int:
    data = counter(image_sizes=[size])
    counts = data["num_image_tokens"] if isinstance(data, dict) else data.num_image_tokens
    return int(counts[0])
