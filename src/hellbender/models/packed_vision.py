"""Sample packing for vision-language models: which families it is exact for, and what their packed batches need.

A packed vision-language batch has 1-D position ids that restart at every document and no attention mask
(`data/multimodal_packed_collator.py`); its images are processed per document and keep document order. What each
family's forward does with it (transformers 5.24):

- Gemma 4 hands the position ids to its mask builders, which keep each document apart, its sliding-window masks
  included. For Gemma 4 models whose image tokens attend both ways (`use_bidirectional_attention: vision`)
  transformers 5.24 would read the image blocks from the start of the packed row instead of each document's, so
  hellbender builds their masks itself (`fixes/gemma4.packed_image_block_masks`, SDPA and eager; other attention
  implementations are refused).
- LLaVA and Idefics3 encode every image (Idefics3: every tile; the blank tiles that pad a document's images to the
  batch's most are dropped by the model) on its own, scatter the features into the image tokens in order, and hand
  the position ids to their language model's mask builder: the collator's batch is all they need.
- Qwen2.5-VL and Qwen3-VL rotate by 3-D positions that they build themselves only for a whole unpacked row (1-D
  position ids reach their mask builder but rotate the image tokens wrongly), so their batches get each document's
  own from `fixes/qwen2_5_vl.packed_rope_positions`, ahead of the 1-D ones that keep the documents apart. Qwen3-VL's
  DeepStack features are added at the image tokens in order, like its image features.

Other families are refused by name: each needs its own check that packed documents neither see each other nor shift
their images' positions (tests/test_multimodal_packing.py and tests/test_multimodal_cpt_packing.py are that check
for these).
"""

from __future__ import annotations

import importlib
from typing import Any

from hellbender.errors import ConfigError
from hellbender.models.fixes import gemma4
from hellbender.models.packed_attention import unwrapped

# model_type -> how packed batches are kept exact (see the module docstring).
PACKABLE_VISION_FAMILIES = {
    "qwen2_5_vl": "each document's 3-D rotary positions built by the model's own `get_rope_index`",
    "qwen3_vl": "each document's 3-D rotary positions built by the model's own `get_rope_index`",
    "gemma4": "restarting 1-D positions, from which its mask builders keep the documents apart",
    "llava": "restarting 1-D positions, which its language model's mask builder reads; images fill their own tokens",
    "idefics3": "restarting 1-D positions, which its text model's mask builder reads; image tiles fill their own tokens",
}


# Families whose packed batches get each document's own 3-D positions (`fixes/qwen2_5_vl.packed_rope_positions`):
# model_type -> the module of `models/fixes` whose `PACKED_POSITIONS_CONTRACT` covers the model's position builder.
ROPE_3D_FAMILIES = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl"}


def _rope_3d_fix(model_type: str) -> Any:
    return importlib.import_module(f"hellbender.models.fixes.{ROPE_3D_FAMILIES[model_type]}")


def check_packable_vision_model(model: Any) -> None:
    """At loading, with a processor and packing on: refuse a family whose packed documents are not known to stay
    apart."""
    model_type = unwrapped(model).config.model_type
    if model_type not in PACKABLE_VISION_FAMILIES:
        families = ", ".join(sorted(PACKABLE_VISION_FAMILIES))
        raise ConfigError(
            f"`sample_packing` (or `eval_sample_packing`) with this `{model_type}` vision-language model is not "
            f"supported yet: packing image+text rows is only checked to keep every document's attention and image "
            f"positions its own for {families}, and this family may build positions or masks from the whole packed "
            "row. Set `sample_packing: false` and `eval_sample_packing: false`."
        )
    text_config = unwrapped(model).config.get_text_config()
    attention = text_config._attn_implementation
    if _image_blocks_attend_both_ways(text_config) and attention not in gemma4.PACKED_IMAGE_BLOCK_ATTENTION:
        raise ConfigError(
            f"`sample_packing` (or `eval_sample_packing`) with this `{model_type}` model and `attn_implementation: "
            f"{attention}` is not supported: its image tokens attend to each other both ways "
            "(`use_bidirectional_attention: vision`), and hellbender keeps those image blocks inside each packed "
            "document with masks it builds for SDPA and eager attention only. Use `attn_implementation: sdpa`, or "
            "set `sample_packing: false` and `eval_sample_packing: false`."
        )
    if model_type in ROPE_3D_FAMILIES:
        _rope_3d_fix(model_type).PACKED_POSITIONS_CONTRACT.check()


def _image_blocks_attend_both_ways(text_config: Any) -> bool:
    return getattr(text_config, "use_bidirectional_attention", None) == "vision"


def packed_vision_inputs(model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """What a packed batch of a vision-language family needs besides the collator's: `position_ids` for a family
    whose positions are not 1-D, per-layer `attention_mask`s for Gemma 4 with image tokens attending both ways;
    else `{}`."""
    if "position_ids" not in batch or "attention_mask" in batch or batch["position_ids"].ndim != 2:
        return {}
    if "mm_token_type_ids" not in batch:  # not a vision-language batch
        return {}
    base = unwrapped(model)
    text_config = base.config.get_text_config()
    if base.config.model_type in gemma4.MODEL_TYPES and _image_blocks_attend_both_ways(text_config):
        dtype = base.get_input_embeddings().weight.dtype
        return {"attention_mask": gemma4.packed_image_block_masks(text_config, batch, dtype)}
    if base.config.model_type not in ROPE_3D_FAMILIES:
        return {}
    from hellbender.models.fixes.qwen2_5_vl import packed_rope_positions

    inner = base.get_base_model() if hasattr(base, "get_base_model") else base
    return {"position_ids": packed_rope_positions(inner.model, batch)}
