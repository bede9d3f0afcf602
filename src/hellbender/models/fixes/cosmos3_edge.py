"""Cosmos3 Edge (`cosmos3_edge`): its processor must return the multimodal token types that its model requires.

The model builds its 3-D (M-RoPE) positions from `mm_token_type_ids` and `image_grid_thw`, and raises
`ValueError: Multimodal data was passed ... but mm_token_type_ids is missing` when a batch with images lacks them.
Its processor can write them (`ProcessorMixin.create_mm_token_type_ids`: 1 on image tokens, 2 on video tokens), but
`Cosmos3EdgeProcessor` keeps `ProcessorMixin`'s default `return_mm_token_type_ids = False` in transformers 5.24,
where the Qwen-VL, GLM and HY processors it resembles default to True. hellbender turns the setting on for the
loaded processor, as those classes have it, so the collator's batches carry them (the model-survey's Cosmos3 Edge
row trains with it and failed every step without it).
"""

from __future__ import annotations

from typing import Any

from hellbender.models.fixes.processor_families import types_using

MODEL_TYPES = types_using("Cosmos3EdgeProcessor")


def adjust_processor(processor: Any) -> Any:
    """The loaded processor, returning `mm_token_type_ids` with every batch."""
    processor.return_mm_token_type_ids = True
    return processor
