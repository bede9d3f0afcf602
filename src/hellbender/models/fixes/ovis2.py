"""Ovis2 (`ovis2`): its processor expands an image placeholder only when asked for arrays.

`Ovis2Processor.replace_image_token` (transformers 5.24) calls `.tolist()` on the image processor's `grids`, which
are arrays only when the call asks for tensors: without `return_tensors` they stay Python lists and every row fails
(`AttributeError: 'list' object has no attribute 'tolist'`). hellbender's row preparation calls the processor once per
row for its token ids only, without tensors; the loaded Ovis2 processor carries a note asking that call for NumPy
arrays (the collator already asks for PyTorch tensors), which gives the same token ids.
"""

from __future__ import annotations

from typing import Any

from hellbender.models.fixes.processor_families import types_using

MODEL_TYPES = types_using("Ovis2Processor")
# Keyword arguments of hellbender's per-row processor call, read from the processor by the data layer
# (`data/formats/multimodal_chat.py`, which may not import this package); not saved with the processor.
ROW_CALL_KWARGS = "hellbender_row_call_kwargs"


def adjust_processor(processor: Any) -> Any:
    """The loaded processor, asking for NumPy arrays in hellbender's per-row call (the collator asks for tensors)."""
    setattr(processor, ROW_CALL_KWARGS, {"return_tensors": "np"})
    return processor
