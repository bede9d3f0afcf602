"""Processors of vision-language models: loading, the vision tokens never to train, and a cache fingerprint."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from hellbender.config import HellbenderConfig
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


def load_processor(cfg: HellbenderConfig, source: str) -> Any:
    import transformers

    from hellbender.models.fixes import processor_loader, unsupported_reason

    reason = unsupported_reason(source)
    if reason:
        raise ConfigError(f"`{source}` is not supported yet as a vision-language model: {reason}.")

    name = cfg.processor_type or "AutoProcessor"
    cls = getattr(transformers, name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ConfigError(f"`processor_type: {name}` is not a transformers processor class (e.g. `AutoProcessor`).")
    loader = processor_loader(source) or cls.from_pretrained
    try:
        processor = loader(source, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision_of_model)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"Could not load a processor from `{source}` with `processor_type: {name}`: {str(exc).rstrip('.')}. "
            "Check that the model is a vision-language model and that `processor_type` fits it."
        ) from None
    if not hasattr(processor, "tokenizer") or not hasattr(processor, "image_processor"):
        raise ConfigError(
            f"`{source}` gave a {type(processor).__name__}, which has no image processor; `processor_type` is for "
            "vision-language models. Remove it to train a text model."
        )
    # Labels are placed from the left, so padding must go on the right.
    processor.tokenizer.padding_side = "right"
    return processor


def vision_token_ids(processor: Any, extra_tokens: list[str]) -> set[int]:
    """Ids of every token that belongs to an image: never trained, whatever the conversation says."""
    tokenizer = processor.tokenizer
    names = [getattr(processor, attr, None) for attr in VISION_TOKEN_ATTRIBUTES]
    names += [getattr(tokenizer, attr, None) for attr in VISION_TOKEN_ATTRIBUTES]
    names += [tok for tok in tokenizer.get_vocab() if TILE_MARKER.match(tok)]
    names += list(extra_tokens)
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
    missing = [t for t in extra_tokens if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise ConfigError(f"`vision_tokens_to_mask`: {', '.join(missing)} not in the tokenizer's vocabulary.")
    return ids


def image_placeholder_id(processor: Any, override: str | None = None) -> int:
    """The token that marks one image in the text, which the processor expands: the processor's image token
    (every family hellbender knows), or a dataset's `image_token`, which must be a special token."""
    tokenizer = processor.tokenizer
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
    token = getattr(processor, "image_token", None)
    if not token:
        raise ConfigError(f"{type(processor).__name__} names no image token; hellbender cannot count its images.")
    return tokenizer.convert_tokens_to_ids(token)


def processor_fingerprint(processor: Any) -> str:
    """Everything about the processor that changes prepared rows: image processor settings, chat template,
    the image tokens (the tokenizer is fingerprinted separately)."""
    h = hashlib.sha256()
    h.update(type(processor).__name__.encode())
    h.update(json.dumps(processor.image_processor.to_dict(), sort_keys=True, default=str).encode())
    h.update(str(getattr(processor, "chat_template", None)).encode())
    for attr in VISION_TOKEN_ATTRIBUTES + ("num_image_tokens", "image_seq_length", "patch_size"):
        h.update(f"{attr}={getattr(processor, attr, None)}".encode())
    return h.hexdigest()
