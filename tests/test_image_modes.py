"""Every pixel mode decodes to 8-bit RGB with its values scaled, or is refused naming the file.

Images are made here with PIL and numpy (16-bit colour PNGs, which PIL cannot write, with a few lines of PNG
encoding) and decoded through the same function preparation and batching use."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hellbender.data.image_modes import to_rgb
from hellbender.data.images import ImagePolicy, ImageProblem, decode_image, open_image

POLICY = ImagePolicy(base_dir=None, allow_remote=False, max_pixels=1_000_000)


def encoded(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def png16(values: np.ndarray, color_type: int) -> bytes:
    """A 16-bit PNG of `values` (height x width [x channels], uint16): color type 0 grey, 2 RGB, 4 grey+alpha,
    6 RGBA."""
    height, width = values.shape[:2]
    raw = b"".join(b"\x00" + values[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def rgb(data: bytes) -> np.ndarray:
    img = decode_image(data, "test-image", POLICY)
    assert img.mode == "RGB"
    return np.asarray(img)


SIXTEEN_BIT = np.array([[0, 257 * 10], [32768, 65535]], dtype=np.uint16)
EIGHT_BIT = np.array([[0, 10], [128, 255]], dtype=np.uint8)  # SIXTEEN_BIT / 257, rounded


def test_sixteen_bit_grey_png_scales_instead_of_turning_white():
    data = encoded(Image.frombytes("I;16", (2, 2), SIXTEEN_BIT.astype("<u2").tobytes()))
    assert Image.open(io.BytesIO(data)).mode == "I;16"  # the mode PIL's own convert("RGB") saturates
    out = rgb(data)
    assert out[..., 0].tolist() == EIGHT_BIT.tolist()
    assert (out[..., 0] == out[..., 1]).all() and (out[..., 1] == out[..., 2]).all()


@pytest.mark.parametrize("mode", ["I;16B", "I;16L", "I"])
def test_other_sixteen_bit_grey_layouts_scale_alike(mode):
    if mode == "I":  # what some Pillow versions open 16-bit PNG and PGM files as
        img = Image.fromarray(SIXTEEN_BIT.astype(np.int32))
    else:
        img = Image.frombytes(mode, (2, 2), SIXTEEN_BIT.astype(">u2" if mode == "I;16B" else "<u2").tobytes())
    assert img.mode == mode
    out = np.asarray(to_rgb(img, "grey"))
    assert out[..., 0].tolist() == EIGHT_BIT.tolist()


def test_thirty_two_bit_integers_outside_sixteen_bits_are_refused_naming_the_file():
    img = Image.fromarray(np.array([[0, 70000]], dtype=np.int32))
    with pytest.raises(ImageProblem, match=r"image `wide.tif` has 32-bit integer pixels from 0 to 70000") as err:
        decode_image(encoded(img, "TIFF"), "wide.tif", POLICY)
    assert err.value.reason == "image mode unsupported"


def test_sixteen_bit_rgb_and_rgba_pngs_scale_each_channel():
    values = np.zeros((1, 2, 3), dtype=np.uint16)
    values[0, 0] = (65535, 32768, 0)
    values[0, 1] = (257 * 10, 257 * 200, 65535)
    assert rgb(png16(values, 2)).tolist() == [[[255, 128, 0], [10, 200, 255]]]
    opaque = np.concatenate([values, np.full((1, 2, 1), 65535, dtype=np.uint16)], axis=2)
    assert rgb(png16(opaque, 6)).tolist() == [[[255, 128, 0], [10, 200, 255]]]


def test_sixteen_bit_grey_with_alpha_is_laid_over_white():
    values = np.array([[[32768, 65535], [0, 0]]], dtype=np.uint16)  # grey 128 opaque; black fully transparent
    assert rgb(png16(values, 4)).tolist() == [[[128, 128, 128], [255, 255, 255]]]


def test_transparent_pixels_of_rgba_and_la_show_white_not_their_hidden_colour():
    rgba = np.array([[[200, 30, 30, 255], [0, 0, 0, 0], [0, 0, 0, 128]]], dtype=np.uint8)
    assert rgb(encoded(Image.fromarray(rgba, "RGBA"))).tolist() == [[[200, 30, 30], [255, 255, 255], [127, 127, 127]]]
    la = np.array([[[50, 255], [0, 0]]], dtype=np.uint8)
    assert rgb(encoded(Image.fromarray(la, "LA"))).tolist() == [[[50, 50, 50], [255, 255, 255]]]


def test_palette_with_a_transparent_index_shows_white_there():
    img = Image.new("P", (2, 1))
    img.putpalette([200, 30, 30, 0, 0, 0] + [0] * 762)
    img.putpixel((0, 0), 0)
    img.putpixel((1, 0), 1)
    img.info["transparency"] = 1
    data = encoded(img)
    assert Image.open(io.BytesIO(data)).mode == "P"
    assert rgb(data).tolist() == [[[200, 30, 30], [255, 255, 255]]]


def test_palette_without_transparency_keeps_its_colours():
    img = Image.new("P", (1, 1))
    img.putpalette([10, 20, 30] + [0] * 765)
    assert rgb(encoded(img)).tolist() == [[[10, 20, 30]]]


def test_cmyk_jpeg_decodes_to_its_colour():
    data = encoded(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG")  # no black, full magenta and yellow: red
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    red, green, blue = rgb(data)[4, 4].tolist()
    assert red > 240 and green < 15 and blue < 15


def test_one_bit_images_are_black_and_white():
    img = Image.new("1", (2, 1))
    img.putpixel((1, 0), 1)
    assert rgb(encoded(img)).tolist() == [[[0, 0, 0], [255, 255, 255]]]


def test_float_images_in_unit_range_scale_by_255_and_in_byte_range_stay():
    unit = np.array([[0.0, 0.5, 1.0]], dtype=np.float32)
    assert rgb(encoded(Image.fromarray(unit, "F"), "TIFF"))[..., 0].tolist() == [[0, 128, 255]]
    byte_range = np.array([[0.0, 100.4, 255.0]], dtype=np.float32)
    assert rgb(encoded(Image.fromarray(byte_range, "F"), "TIFF"))[..., 0].tolist() == [[0, 100, 255]]


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ([[0.0, 1000.0]], "float pixels from 0 to 1000"),
        ([[-1.0, 0.5]], "float pixels from -1 to 0.5"),
        ([[np.nan, 0.0]], "NaN"),
    ],
)
def test_float_images_without_a_known_scale_are_refused_naming_the_file(values, words):
    data = encoded(Image.fromarray(np.array(values, dtype=np.float32), "F"), "TIFF")
    with pytest.raises(ImageProblem, match="depth.tif") as err:
        decode_image(data, "depth.tif", POLICY)
    assert words in str(err.value)


def test_plain_rgb_and_grey_are_unchanged(tmp_path: Path):
    colours = np.array([[[1, 2, 3], [250, 128, 0]]], dtype=np.uint8)
    (tmp_path / "c.png").write_bytes(encoded(Image.fromarray(colours, "RGB")))
    assert np.asarray(open_image(tmp_path / "c.png", POLICY)).tolist() == colours.tolist()
    grey = np.array([[7, 200]], dtype=np.uint8)
    assert rgb(encoded(Image.fromarray(grey, "L"))).tolist() == [[[7, 7, 7], [200, 200, 200]]]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_exif_orientation_turns_the_image_as_it_is_shown(fmt):
    """Stored 3 wide and 2 high with a red top-left pixel, tagged "turn 90 degrees clockwise to show" (EXIF
    orientation 6): decoded 2 wide and 3 high, the red pixel at the top right, as transformers' `load_image` shows
    it; the same pixels without the tag stay as stored."""
    stored = Image.new("RGB", (3, 2), (0, 0, 255))
    stored.putpixel((0, 0), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    buf = io.BytesIO()
    stored.save(buf, format=fmt, exif=exif.tobytes(), **({"quality": 100, "subsampling": 0} if fmt == "JPEG" else {}))
    shown = rgb(buf.getvalue())
    assert shown.shape == (3, 2, 3)
    assert shown[0, 1, 0] > 200 and shown[0, 1, 2] < 60  # red, top right
    assert shown[0, 0, 2] > 200  # blue, top left
    assert rgb(encoded(stored, fmt)).shape == (2, 3, 3)


def test_the_header_size_of_a_turned_image_is_its_shown_size(tmp_path):
    from hellbender.data.images import image_header_size

    exif = Image.Exif()
    exif[0x0112] = 8  # turn 90 degrees counter-clockwise to show
    Image.new("RGB", (30, 20)).save(tmp_path / "turned.png", exif=exif.tobytes())
    Image.new("RGB", (30, 20)).save(tmp_path / "plain.png")
    policy = ImagePolicy(base_dir=tmp_path, allow_remote=False, max_pixels=1_000_000)
    assert image_header_size(tmp_path / "turned.png", policy) == (20, 30)
    assert image_header_size(tmp_path / "plain.png", policy) == (30, 20)
