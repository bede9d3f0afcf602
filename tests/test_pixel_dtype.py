"""Floating image inputs reach the model in its dtype (Llama 4's image processor returns bfloat16 pixels)."""

from __future__ import annotations

import torch

from hellbender.models.pixel_dtype import pixels_in_model_dtype


class _Tower(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 2, dtype=dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values)


def test_bfloat16_pixels_are_cast_for_a_float32_model_and_only_they() -> None:
    model = _Tower(torch.float32)
    batch = {
        "input_ids": torch.tensor([[1, 2]]),
        "pixel_values": torch.ones(1, 4, dtype=torch.bfloat16),
        "pixel_values_videos": torch.ones(1, 4, dtype=torch.float32),
        "image_grid_thw": torch.tensor([[1, 2, 2]]),
    }
    try:  # what the model would see without the cast
        model(batch["pixel_values"])
        refused = False
    except RuntimeError:
        refused = True
    assert refused
    cast = pixels_in_model_dtype(model, batch)
    assert set(cast) == {"pixel_values"}
    assert cast["pixel_values"].dtype == torch.float32
    assert model(cast["pixel_values"]).shape == (1, 2)


def test_pixels_already_in_the_models_dtype_or_wider_are_left_alone() -> None:
    batch = {"pixel_values": torch.ones(1, 4, dtype=torch.bfloat16)}
    assert pixels_in_model_dtype(_Tower(torch.bfloat16), batch) == {}
    assert pixels_in_model_dtype(object(), batch) == {}
    wide = {"pixel_values": torch.ones(1, 4, dtype=torch.float32)}  # a float32 tower in a bfloat16 model casts them
    assert pixels_in_model_dtype(_Tower(torch.bfloat16), wide) == {}
