"""Ovis2 (`ovis2`): its processor expands an image placeholder only when asked for arrays.

`Ovis2Processor.replace_image_token` (transformers 5.24) calls `.tolist()` on the image processor's `grids`, which
are arrays only when the call asks for tensors: without `return_tensors` they stay Python lists and every row fails
(`AttributeError: 'list' object has no attribute 'tolist'`). hellbender's row preparation calls the processor once per
row for its token ids only, without tensors; for this processor it asks for NumPy arrays (the collator already asks for
PyTorch tensors), which gives the same token ids.
"""

from __future__ import annotations

from typing import Any

from hellbender.models.fixes.processor_families import types_using

MODEL_TYPES = types_using("Ovis2Processor")
PROCESSOR_CLASS = "Ovis2Processor"


def expansion_kwargs(processor: Any) -> dict[str, Any]:
    """Extra keyword arguments for a per-row processor call that only reads token ids: arrays for Ovis2's processor,
    nothing for every other processor."""
    names = {cls.__name__ for cls in type(processor).__mro__}
    return {"return_tensors": "np"} if PROCESSOR_CLASS in names else {}
