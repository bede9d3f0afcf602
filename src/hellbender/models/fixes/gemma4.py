"""Gemma 4: what hellbender needs to know and do for this family, checked against the installed transformers.

Processor: `Gemma4Processor` requires a `Gemma4VideoProcessor`, which cannot be imported without torchvision,
so `AutoProcessor.from_pretrained` fails on machines without it (ImportError). `load_processor` then builds
`Gemma4ProcessorWithoutVideo`: the same processor for text and images, refusing videos, saving the same files
a `Gemma4Processor` saves. With torchvision installed, it is plain `AutoProcessor.from_pretrained`. What the
processor overrides and calls in transformers is `PROCESSOR_CONTRACT`, checked when it is built.

Images: the chat template writes the image token (`<image_soft_token>`) once per image, and the processor
expands it to `<start_of_image>` + n soft tokens + `<end_of_image>`.

Shared K/V (`num_kv_shared_layers > 0`): the last layers reuse the keys and values of the last earlier layer of
the same type. The text model passes them from layer to layer in a mutable dict, a keyword argument of every
decoder layer; under activation checkpointing hellbender routes it around the checkpoint
(`models/activation_checkpointing.py`). transformers changed the dict's key: up to 5.5 the index of the storing
layer (`attention.kv_shared_layer_index`), from 5.8 the layer type (`attention.layer_type`);
`shared_kv_key` reads the convention off the attention modules and refuses a model that has neither.

Attention: the full-attention layers have head_dim 512, wider than flash attention takes; training uses
`models/attention.py`'s SDPA so they never fall back to the math kernel.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import Gemma4Processor, PreTrainedTokenizerBase
from transformers.utils import CHAT_TEMPLATE_FILE, PROCESSOR_NAME

from hellbender.errors import EnvironmentProblem
from hellbender.models.attention import FLASH_MAX_HEAD_DIM, register_large_head_sdpa, widest_head_dim
from hellbender.models.fixes.contract import Contract, Requirement

MODEL_TYPES = ("gemma4",)
TEXT_MODEL_TYPES = ("gemma4", "gemma4_text")  # the image-text model, and the text-only one


# What a `Gemma4VideoProcessor` saved with this model's image settings looks like (other keys: class defaults).
class Gemma4ProcessorWithoutVideo(Gemma4Processor):
    """`Gemma4Processor` with `video_processor=None`, for machines without torchvision (where
    `Gemma4VideoProcessor` cannot be imported). Text and images behave exactly as in `Gemma4Processor`; videos
    are refused. It saves a plain `Gemma4Processor` directory (see the module docstring)."""

    # Written back as the `video_processor` entry of processor_config.json; `load_processor` keeps the saved one,
    # otherwise it follows the image processor's settings.
    video_processor_config: dict[str, Any] | None = None

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)

    def _process_videos(self, videos, **kwargs):
        raise ValueError(
            "This Gemma 4 processor has no video processor (Gemma4VideoProcessor needs torchvision), so it "
            "cannot process videos."
        )

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output["processor_class"] = "Gemma4Processor"
        output["video_processor"] = dict(self.video_processor_config or self._video_config_from_images())
        return output

    def _video_config_from_images(self) -> dict[str, Any]:
        images = self.image_processor
        return {
            "video_processor_type": "Gemma4VideoProcessor",
            "patch_size": images.patch_size,
            "max_soft_tokens": images.max_soft_tokens,
            "pooling_kernel_size": images.pooling_kernel_size,
        }

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """What `ProcessorMixin.save_pretrained` writes for a `Gemma4Processor` (the tokenizer files,
        `chat_template.jinja`, `processor_config.json`), without touching the missing video processor."""
        if push_to_hub:
            raise ValueError("This processor saves locally only; save it, then upload the directory.")
        os.makedirs(save_directory, exist_ok=True)
        self.tokenizer._set_processor_class("Gemma4Processor")
        self.tokenizer.save_pretrained(save_directory)
        if isinstance(self.chat_template, str):
            Path(save_directory, CHAT_TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")
        elif self.chat_template is not None:
            raise ValueError("This processor saves a single chat template; it has several.")
        output_file = os.path.join(save_directory, PROCESSOR_NAME)
        self.to_json_file(output_file)
        return [output_file]


# What `Gemma4ProcessorWithoutVideo` and `load_processor` rely on in transformers, checked when the processor is built.
PROCESSOR_CONTRACT = Contract(
    "hellbender's Gemma 4 processor without torchvision",
    (
        Requirement(
            Gemma4Processor,
            "check_argument_for_proper_class",
            "overridden so that the missing video processor (None) is accepted",
        ),
        Requirement(Gemma4Processor, "_process_videos", "overridden so that videos are refused clearly"),
        Requirement(Gemma4Processor, "to_dict", "overridden so that the saved config names `Gemma4Processor`"),
        Requirement(Gemma4Processor, "save_pretrained", "overridden so that saving skips the missing video processor"),
        Requirement(Gemma4Processor, "get_processor_dict", "reads the saved processor settings"),
        Requirement(
            Gemma4Processor,
            "from_args_and_dict",
            "builds the processor from its loaded parts",
            parameters=("args", "processor_dict"),
        ),
        Requirement(
            PreTrainedTokenizerBase,
            "_set_processor_class",
            "makes the saved tokenizer config name `Gemma4Processor`",
        ),
    ),
)


def load_processor(path: str | os.PathLike, **kwargs: Any):
    """The processor saved by `build` (or any Gemma 4 processor directory).

    With torchvision this is `AutoProcessor.from_pretrained(path, **kwargs)`. Without it, `AutoProcessor` cannot
    build `Gemma4Processor` (its required `Gemma4VideoProcessor` needs torchvision), so this loads exactly what
    `Gemma4Processor.from_pretrained` would, minus the video processor: the tokenizer (`AutoTokenizer`), the image
    processor (`AutoImageProcessor`, PIL backend), the audio feature extractor (`AutoFeatureExtractor`) and the
    processor's own settings and chat template from `processor_config.json` / `chat_template.jinja`, joined in
    `Gemma4ProcessorWithoutVideo`. `kwargs` (`revision`, `trust_remote_code`, ...) go to every loader.
    """
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return AutoProcessor.from_pretrained(path, **kwargs)
    PROCESSOR_CONTRACT.check()
    processor_dict, _ = Gemma4ProcessorWithoutVideo.get_processor_dict(path, **kwargs)
    args = [
        AutoFeatureExtractor.from_pretrained(path, **kwargs),
        AutoImageProcessor.from_pretrained(path, backend="pil", **kwargs),
        AutoTokenizer.from_pretrained(path, **kwargs),
        None,  # video_processor
    ]
    processor = Gemma4ProcessorWithoutVideo.from_args_and_dict(args, processor_dict)
    if isinstance(processor_dict.get("video_processor"), dict):
        processor.video_processor_config = processor_dict["video_processor"]
    return processor


def shared_kv_key(attention: Any) -> str | int | None:
    """The key under which this attention layer stores or reads shared K/V in the installed transformers, or None
    for a layer that does neither."""
    if hasattr(attention, "kv_shared_layer_index"):  # transformers <= 5.5: keyed by the storing layer's index
        if attention.kv_shared_layer_index is not None:
            return attention.kv_shared_layer_index
        return attention.layer_idx if getattr(attention, "store_full_length_kv", False) else None
    if hasattr(attention, "is_kv_shared_layer") and hasattr(attention, "layer_type"):  # >= 5.8: by layer type
        sharing = attention.is_kv_shared_layer or getattr(attention, "store_full_length_kv", False)
        return attention.layer_type if sharing else None
    import transformers

    raise EnvironmentProblem(
        f"This Gemma 4 attention module ({type(attention).__name__}, transformers {transformers.__version__}) has "
        "neither `kv_shared_layer_index` nor `is_kv_shared_layer` + `layer_type`, so hellbender cannot tell how it "
        "shares K/V between layers and will not train it. Install a transformers release hellbender supports "
        "(`pip install -U 'transformers>=5.8'`)."
    )


def text_attention_modules(model: Any) -> list[Any]:
    return [m for m in model.modules() if type(m).__name__ == "Gemma4TextAttention"]


def prepare_for_training(model: Any, attn_implementation: str) -> Any:
    """Check the shared-K/V convention, and give full-attention layers wider than 256 the math-free SDPA."""
    for attention in text_attention_modules(model):
        shared_kv_key(attention)
    if attn_implementation == "sdpa" and widest_head_dim(model) > FLASH_MAX_HEAD_DIM:
        model.set_attn_implementation(register_large_head_sdpa())
    return model


# With packing, the attention implementations whose masks hellbender can build with image blocks kept per document.
PACKED_IMAGE_BLOCK_ATTENTION = ("sdpa", "eager")


def packed_image_block_masks(text_config: Any, batch: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Each layer pattern's mask for a packed batch of a Gemma 4 model whose image tokens attend both ways
    (`use_bidirectional_attention: vision`), as transformers builds them for one document alone: full-attention
    layers causal, sliding layers `(causal or same image) and within the window`, and no token ever sees another
    document. transformers' own builder would read a packed row's image blocks from the row's start (its mask
    functions are remapped to each document's positions while the block ids stay the row's), so hellbender builds
    them here from the row's documents (where the 1-D position ids restart) and image blocks (runs of image or
    video tokens in `mm_token_type_ids`). Boolean for SDPA (true: attend), additive in `dtype` for eager."""
    positions = batch["position_ids"]
    document = (torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1) != 1).cumsum(-1)
    vision = (batch["mm_token_type_ids"] == 1) | (batch["mm_token_type_ids"] == 2)  # image, video (not audio)
    starts = vision & ~torch.nn.functional.pad(vision, (1, 0))[:, :-1]
    block = torch.where(vision, starts.cumsum(-1), -1)
    index = torch.arange(positions.shape[-1], device=positions.device)
    causal = index[None, :, None] >= index[None, None, :]
    same_document = document[:, :, None] == document[:, None, :]
    same_block = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0)
    window = index[None, None, :] > index[None, :, None] - text_config.sliding_window
    masks = {
        "full_attention": causal & same_document,
        "sliding_attention": (causal | same_block) & same_document & window,
    }
    if text_config._attn_implementation == "eager":
        low = torch.finfo(dtype).min
        masks = {k: torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, low) for k, m in masks.items()}
    return {k: m[:, None] for k, m in masks.items()}
