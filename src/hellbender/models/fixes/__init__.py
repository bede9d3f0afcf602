"""Model-family quirks, one module per family. Each module names the `model_type`s it covers and holds every
special case of that family; the rest of hellbender stays generic and asks here. A fix that overrides or calls
transformers internals declares them in a `contract.Contract` and checks it when it is applied."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def model_type_of(source: str) -> str | None:
    """`model_type` from a model directory's config.json (hub ids: through transformers' config loader)."""
    config = Path(source) / "config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("model_type")
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(source).model_type
    except (OSError, ValueError):
        return None


# Vision-language families whose images do not enter as tokens in the text, which everything hellbender does
# for images (counting placeholders, expanding them, masking them) relies on, whose processor does not keep the
# row's text, or whose image-text forward fails in the installed transformers.
UNSUPPORTED_VISION_FAMILIES = {
    "mllama": "Mllama (Llama 3.2 Vision) feeds images through cross-attention layers, not image tokens in the text",
    "shieldgemma2": "ShieldGemma 2 is an image-safety classifier whose processor replaces each row's text with its own "
    "policy prompts, so chat rows cannot be trained through it",
    "blip": "BLIP's text decoder reads the image through cross-attention, not image tokens in the text",
    "idefics": "IDEFICS (version 1) reads images through gated cross-attention layers, not image tokens in the text "
    "(Idefics2 and Idefics3 are supported)",
    "git": "GIT puts the image features in front of the text instead of image tokens in it, so its outputs do not "
    "line up with the row's tokens",
    "evolla": "Evolla reads protein sequences, not images",
    "fuyu": "Fuyu's processor puts the image in front of each text and appends its own answer marker instead of "
    "expanding an image placeholder the chat template writes, so a chat row's image cannot stay where the row has it",
    **{
        family: f"{name}'s processor puts the Q-Former's query tokens in front of each text instead of expanding an "
        "image placeholder the chat template writes, so a chat row's images cannot be placed"
        for family, name in (
            ("blip-2", "BLIP-2"),
            ("instructblip", "InstructBLIP"),
            ("instructblipvideo", "InstructBLIP Video"),
        )
    },
    # their processors put `<image>`, the image tokens and `</image>` at the start of each text (Kosmos-2.5's after BOS)
    # and mark only that place in the `image_embeds_position_mask` they build
    **{
        family: f"{name}'s processor writes its own image prompt in front of each text instead of expanding an image "
        "placeholder the chat template writes, so a chat row's image cannot stay where the row has it"
        for family, name in (("kosmos-2", "Kosmos-2"), ("kosmos-2.5", "Kosmos-2.5"))
    },
    "got_ocr2": "GOT-OCR2's processor refuses images grouped per text, the form hellbender passes them in (it reads "
    "such a group as the pages of one document, only with `multi_page`), so a chat row's image cannot reach it",
    "pp_chart2table": "PP-Chart2Table's processor expands no image placeholder and names no image token (the prompt "
    "must carry every image token itself), so hellbender cannot count or place a chat row's images",
    "pi0": "PI0 is a robot policy that predicts actions by flow matching, not text",
    "diffusion_gemma": "DiffusionGemma is a block-diffusion model (it denoises a canvas of tokens given an encoded "
    "prompt) whose forward takes no labels: there is no next-token loss to train",
    # a transformers bug, not a layout hellbender cannot serve: lift it when the forward works
    "llama4": "transformers 5.24's Llama 4 image-text forward reads `image_outputs` from its language model's output, "
    "which has none, so every training step fails; its text model trains without `processor_type`",
}


# Image-text encoder-decoders (T5Gemma 2): the decoder generates from what the encoder read, so the prompt and the
# answer are two sequences; hellbender trains decoder-only models on whole chat rows, labels inside the prompt's row.
ENCODER_DECODER_REASON = (
    "it is an encoder-decoder model, and hellbender trains decoder-only models on whole chat rows (its decoder would "
    "get no inputs)"
)


def is_encoder_decoder(source: str) -> bool:
    """The config's own `is_encoder_decoder` (a directory's config.json; hub ids through transformers)."""
    config = Path(source) / "config.json"
    if config.is_file():
        return bool(json.loads(config.read_text()).get("is_encoder_decoder"))
    try:
        from transformers import AutoConfig

        return bool(AutoConfig.from_pretrained(source).is_encoder_decoder)
    except (OSError, ValueError):
        return False


def unsupported_reason(source: str) -> str | None:
    model_type = model_type_of(source) or ""
    if model_type in UNSUPPORTED_VISION_FAMILIES:
        return UNSUPPORTED_VISION_FAMILIES[model_type]
    return f"{model_type or 'this model'}: {ENCODER_DECODER_REASON}" if is_encoder_decoder(source) else None


def processor_loader(source: str) -> Callable[..., Any] | None:
    """A family-specific way to load the processor, or None for `from_pretrained` of the configured class."""
    from hellbender.models.fixes import gemma4, qwen2_5_vl, qwen2_vl, qwen3_vl

    model_type = model_type_of(source)
    for family in (gemma4, qwen2_5_vl, qwen2_vl, qwen3_vl):
        if model_type in family.MODEL_TYPES:
            return family.load_processor
    return None


def adjust_processor(source: str, processor: Any) -> Any:
    """The loaded processor with its family's settings fixed (unchanged for most families)."""
    from hellbender.models.fixes import cosmos3_edge, ovis2

    model_type = model_type_of(source)
    if model_type in cosmos3_edge.MODEL_TYPES:
        return cosmos3_edge.adjust_processor(processor)
    if model_type in ovis2.MODEL_TYPES:
        return ovis2.adjust_processor(processor)
    return processor


def prepare_for_training(model: Any, attn_implementation: str) -> Any:
    """What the model's family must change or check before training (nothing for most families)."""
    from hellbender.models.fixes import gemma4, reformer

    reformer.let_reversible_layers_train(model)
    if getattr(model.config, "model_type", None) in gemma4.TEXT_MODEL_TYPES:
        return gemma4.prepare_for_training(model, attn_implementation)
    return model
