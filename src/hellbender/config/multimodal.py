"""Config keys for vision-language models: the processor, image handling and what to train of the vision side."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from hellbender.config.values import Int, Name

ImageSide = Annotated[Int, Field(gt=0)]

DEFAULT_MAX_IMAGE_PIXELS = 50_000_000


class MultimodalSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    processor_type: Name | None = Field(
        None,
        description="Load a processor (`AutoProcessor` or a class name) and train a vision-language model: the "
        "model loads through `AutoModelForImageTextToText` and chat datasets may hold image parts.",
    )
    freeze_mm_modules: bool = Field(
        False, description="Freeze the vision tower and projector (full fine-tuning trains them otherwise)."
    )
    image_size: ImageSide | tuple[ImageSide, ImageSide] | None = Field(
        None,
        description="Resize every image to this size (pixels, width and height; one number for a square) before "
        "processing; at most `max_image_pixels` pixels.",
    )
    image_resize_algorithm: Literal["bilinear", "bicubic", "lanczos", "nearest"] = Field(
        "bilinear", description="Resampling filter for `image_size`."
    )
    max_image_pixels: Int = Field(
        DEFAULT_MAX_IMAGE_PIXELS,
        gt=0,
        description="Images with more pixels (width x height) are refused (or skipped with `skip_bad_images`).",
    )
    cache_images: bool = Field(
        False,
        description="Store the decoded (and resized) images in the prepared data, so training opens no image file "
        "(useful when images sit on slow or remote storage; the prepared data grows by width x height x 3 bytes "
        "per image). The processor still runs at batch time.",
    )
    vision_tokens_to_mask: list[Name] = Field(
        default_factory=list,
        description="Extra tokens never to train, beside the image / video placeholders, soft tokens and vision "
        "markers found from the processor (a per-model override).",
    )
