"""Image inputs in the model's floating dtype.

Most image processors return float32 pixels and most vision towers cast them to their own dtype. Llama 4's image
processor (a torchvision class) normalises in bfloat16, as the original code did, and its vision tower does not
cast: a model loaded in float32 (on a CPU, or for full precision) then meets bfloat16 pixels in its first linear
layer, which torch refuses. Floating image inputs of a narrower dtype than the model's are therefore widened to it.
Wider inputs are left as they are: a tower kept in float32 inside a bfloat16 model casts them itself, and narrowing
them here would lose precision it keeps.
"""

from __future__ import annotations

from typing import Any

import torch

IMAGE_INPUTS = ("pixel_values", "pixel_values_videos")


def pixels_in_model_dtype(model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's floating image inputs narrower than the model's dtype, widened to it (nothing else)."""
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return {}
    return {
        name: batch[name].to(dtype)
        for name in IMAGE_INPUTS
        if isinstance(batch.get(name), torch.Tensor)
        and batch[name].is_floating_point()
        and torch.finfo(batch[name].dtype).bits < torch.finfo(dtype).bits
    }
