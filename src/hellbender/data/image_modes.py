"""Every decoded image as 8-bit RGB, with its values scaled from the mode it was stored in.

PIL's own `convert("RGB")` clips 16-bit and 32-bit grey (`I;16`, `I`) at 255, so a 16-bit PNG turns white, and
it clips float images (`F`), so one stored in [0, 1] turns black. Those modes are scaled here instead. Images
with transparency (`RGBA`, `LA`, `PA`, a palette or grey with a transparent colour) are laid over white: the
colour under a transparent pixel is arbitrary (often black), and a model should see what a viewer shows. A mode
that cannot be converted is refused, naming the file.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
WHITE = (255, 255, 255, 255)


class UnsupportedImage(ValueError):
    """An image whose pixels cannot be turned into RGB; the message names the file and the mode."""


def to_rgb(img: Any, name: str) -> Any:
    """`img` (a loaded PIL image) as 8-bit RGB."""
    from PIL import Image

    mode = img.mode
    if mode == "RGB":
        return img
    if mode in SIXTEEN_BIT_MODES:
        return Image.fromarray(_sixteen_bit_grey(np.asarray(img), mode, name), "L").convert("RGB")
    if mode == "F":
        return Image.fromarray(_float_grey(np.asarray(img, dtype=np.float64), name), "L").convert("RGB")
    if mode in ALPHA_MODES or "transparency" in img.info:
        try:
            rgba = img.convert("RGBA")
        except ValueError:
            raise _unsupported(mode, name) from None
        return Image.alpha_composite(Image.new("RGBA", img.size, WHITE), rgba).convert("RGB")
    try:
        return img.convert("RGB")
    except ValueError:
        raise _unsupported(mode, name) from None


def _sixteen_bit_grey(values: np.ndarray, mode: str, name: str) -> np.ndarray:
    """16-bit grey scaled to 8 bits (0 -> 0, 65535 -> 255). Mode `I` (32-bit integers) is what 16-bit PNG and PGM
    files open as in some Pillow versions; values outside 0..65535 have no known scale and are refused."""
    values = values.astype(np.int64)
    if values.size and (values.min() < 0 or values.max() > 65535):
        raise UnsupportedImage(
            f"image `{name}` has 32-bit integer pixels from {values.min()} to {values.max()}, outside the 16-bit range "
            "0..65535, so there is no known scale to 8-bit RGB; convert it to an 8-bit or 16-bit PNG"
        )
    return np.rint(values / 257.0).astype(np.uint8)


def _float_grey(values: np.ndarray, name: str) -> np.ndarray:
    """Float grey: values in [0, 1] are scaled by 255, values in [0, 255] kept; anything else is refused."""
    if values.size == 0:
        return values.astype(np.uint8)
    if not np.isfinite(values).all():
        raise UnsupportedImage(f"image `{name}` has float pixels that are NaN or infinite; convert it to 8-bit RGB")
    low, high = float(values.min()), float(values.max())
    if low >= 0 and high <= 1:
        values = values * 255
    elif not (low >= 0 and high <= 255):
        raise UnsupportedImage(
            f"image `{name}` has float pixels from {low:g} to {high:g}, neither in [0, 1] nor in [0, 255], so there is "
            "no known scale to 8-bit RGB; convert it to 8-bit RGB"
        )
    return np.rint(values).astype(np.uint8)


def _unsupported(mode: str, name: str) -> UnsupportedImage:
    return UnsupportedImage(
        f"image `{name}` has pixel mode `{mode}`, which cannot be converted to RGB; convert it to an 8-bit RGB PNG or "
        "JPEG"
    )
