"""The image side of a mistral-common tokenizer (`tokenizer_use_mistral_common` with `processor_type`): Mistral 3 /
Pixtral checkpoints were trained on images that mistral-common's own image encoder resized, normalised and turned
into `[IMG]` / `[IMG_BREAK]` / `[IMG_END]` tokens, so hellbender drives that encoder rather than a transformers
image processor (transformers' `PixtralProcessor` resizes on its own and tokenizes `[IMG]` as text, which a
mistral-common tokenizer reads as plain characters)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from hellbender.errors import ConfigError

# What a transformers model call takes from a batch of this processor (the Trainer reads the first).
MODEL_INPUT_NAMES = ["input_ids", "attention_mask", "pixel_values", "image_sizes"]


@dataclass(frozen=True)
class MistralCommonProcessor:
    """The mistral-common tokenizer with its image encoder: what rows and batches of a Mistral vision model need."""

    tokenizer: Any  # transformers' MistralCommonBackend
    image_encoder: Any  # mistral_common.tokens.tokenizers.image.ImageEncoder
    model_input_names = MODEL_INPUT_NAMES
    chat_template = None  # mistral-common encodes conversations itself

    @property
    def image_token_ids(self) -> frozenset[int]:
        """`[IMG]`, `[IMG_BREAK]` and `[IMG_END]`: every token an image becomes (never trained)."""
        ids = self.image_encoder.special_ids
        return frozenset((ids.img, ids.img_break, ids.img_end))

    @property
    def image_token_id(self) -> int:
        """`[IMG]`, the one token per image feature the model's vision tower fills in."""
        return self.image_encoder.special_ids.img

    def encode_image(self, image: Any) -> tuple[list[int], Any]:
        """An opened image as mistral-common encodes it: its tokens and its C x H x W float32 pixel array."""
        from mistral_common.protocol.instruct.chunk import ImageChunk

        encoding = self.image_encoder(ImageChunk(image=image))
        return list(encoding.tokens), encoding.image

    def fingerprint(self) -> str:
        """What changes prepared rows beside the tokenizer file (fingerprinted on its own): the image settings."""
        config = self.image_encoder.image_config
        settings = {
            "class": type(self).__name__,
            "patch": config.image_patch_size,
            "max": config.max_image_size,
            "merge": config.spatial_merge_size,
        }
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        """The tokenizer's rendering (text parts only), which `merge-lora` uses to find the end-of-turn token."""
        return self.tokenizer.apply_chat_template(conversation, **kwargs)

    def save_pretrained(self, directory: str, **kwargs: Any) -> Any:
        """The tokenizer file holds the image settings too, so saving the tokenizer saves everything."""
        return self.tokenizer.save_pretrained(directory, **kwargs)


def load_mistral_common_processor(tokenizer: Any, source: str) -> MistralCommonProcessor:
    """The processor over a loaded mistral-common tokenizer, whose file must describe images."""
    instruct = tokenizer.tokenizer.instruct_tokenizer
    encoder = getattr(instruct, "image_encoder", None)
    if getattr(instruct, "audio_encoder", None) is not None and encoder is None:
        raise ConfigError(
            f"The mistral-common tokenizer of `{source}` encodes audio (a Voxtral model), and audio is not supported "
            "yet: hellbender trains image+text models with `tokenizer_use_mistral_common` and `processor_type`. "
            "Remove `processor_type` to train on text only."
        )
    if encoder is None:
        raise ConfigError(
            f"The mistral-common tokenizer of `{source}` has no image settings (no `image` section in its "
            "`tekken.json`), so it cannot encode images: this is a text model's tokenizer. Remove `processor_type` "
            "to train it on text, or point `base_model` / `tokenizer_config` at a Mistral vision model."
        )
    try:
        import cv2  # noqa: F401  (mistral-common resizes images with OpenCV)
    except ImportError:
        raise ConfigError(
            "`tokenizer_use_mistral_common` with `processor_type` needs OpenCV, with which mistral-common resizes "
            "images: `pip install 'hellbender[mistral]'` (or `pip install 'mistral-common[image]'`)."
        ) from None
    return MistralCommonProcessor(tokenizer=tokenizer, image_encoder=encoder)
