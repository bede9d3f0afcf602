"""The Qwen vision-language processors without their video processor, for machines without torchvision.

`Qwen2_5_VLProcessor` and `Qwen3VLProcessor` always load a video processor, which needs torchvision, so
`AutoProcessor.from_pretrained` fails on machines without it (ImportError). The class `image_only` builds loads the
same directory with the image processor and tokenizer only (videos are refused) and saves the files the stock class
writes, so the saved directory loads anywhere. What it overrides and calls in transformers is `processor_contract`,
checked when it is loaded. Used by `fixes/qwen2_5_vl.py` and `fixes/qwen3_vl.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hellbender.models.fixes.contract import Contract, Requirement


def image_only(stock: type, family: str, video_processor_type: str, saves_video_size: bool) -> type:
    """A subclass of the stock processor class `stock` without its video processor. `video_processor_type`: the
    stock video processor's class name, written where a stock directory has it; `saves_video_size`: whether that
    entry carries the image processor's `size` too (Qwen2.5-VL's does)."""

    class ImageOnlyProcessor(stock):
        def __init__(self, image_processor=None, tokenizer=None, video_processor=None, chat_template=None, **kwargs):
            # `from_pretrained` passes the saved video processor settings (a dict) here; they are kept for saving.
            self.video_processor_config = video_processor if isinstance(video_processor, dict) else None
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

        def __call__(self, images=None, text=None, videos=None, **kwargs):
            if videos is not None:
                raise ValueError(
                    f"This {family} processor was loaded without torchvision, so it has no video processor "
                    f"({video_processor_type} needs torchvision). Install torchvision to process videos."
                )
            return super().__call__(images=images, text=text, **kwargs)

        def to_dict(self) -> dict[str, Any]:
            """What the stock class saves: its own class name and a video processor entry (the stock class cannot
            load a directory without one)."""
            output = super().to_dict()
            output["processor_class"] = stock.__name__
            output["video_processor"] = dict(self.video_processor_config or self._video_config_from_images())
            return output

        def _video_config_from_images(self) -> dict[str, Any]:
            images = self.image_processor
            config = {
                "video_processor_type": video_processor_type,
                "patch_size": images.patch_size,
                "merge_size": images.merge_size,
                "temporal_patch_size": images.temporal_patch_size,
            }
            return {**config, "size": dict(images.size)} if saves_video_size else config

        def save_pretrained(self, save_directory, *args, **kwargs):
            files = super().save_pretrained(save_directory, *args, **kwargs)
            self.tokenizer._set_processor_class(stock.__name__)
            self.tokenizer.save_pretrained(save_directory)
            return files

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"ImageOnly{stock.__name__}"
    ImageOnlyProcessor.__doc__ = f"`{stock.__name__}` without a video processor, for machines without torchvision."
    return ImageOnlyProcessor


def processor_contract(stock: type, family: str) -> Contract:
    """What an `image_only` subclass of `stock` relies on in transformers, checked when the processor is built."""
    from transformers import PreTrainedTokenizerBase

    name = stock.__name__
    return Contract(
        f"hellbender's {family} processor without torchvision",
        (
            Requirement(
                stock,
                "__init__",
                "called with the image processor and tokenizer, and no video processor",
                parameters=("image_processor", "tokenizer", "video_processor", "chat_template"),
            ),
            Requirement(
                stock, "__call__", "overridden so that videos are refused clearly", parameters=("images", "text")
            ),
            Requirement(
                stock, "get_attributes", "overridden so that loading and saving skip the missing video processor"
            ),
            Requirement(stock, "to_dict", f"overridden so that the saved config names `{name}`"),
            Requirement(stock, "save_pretrained", f"overridden so that the saved tokenizer config names `{name}`"),
            Requirement(
                PreTrainedTokenizerBase, "_set_processor_class", f"makes the saved tokenizer config name `{name}`"
            ),
        ),
    )


def load_processor(image_only_class: type, contract: Contract, path: str | Path, **kwargs: Any) -> Any:
    """`AutoProcessor.from_pretrained` where torchvision is installed; the image-only processor elsewhere."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(path), **kwargs)
    contract.check()
    return image_only_class.from_pretrained(str(path), **kwargs)
