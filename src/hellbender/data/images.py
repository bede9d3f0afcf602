"""Finding and opening the images of vision-language rows, safely.

Local paths resolve under a base directory and may not leave it (no `..`, no absolute path outside it, no
symlink pointing out). The check is made again every time a file is opened, while preparing and at batch time,
so an image replaced by an outgoing symlink after preparation is refused too. `http(s)` URLs are fetched only
when the dataset allows remote images (`data.remote_images`), and are stored in the prepared-data directory so
training never fetches them again. Every image is decoded once while preparing, so a missing, corrupt or
oversized image is found before training starts.

Every image file read is logged at DEBUG level on the `hellbender.data.images` logger, with the path read (resolved
when the rows have an `image_base_dir`): a run can be audited for exactly which images it touched, e.g. that a
resumed stream opens none of the rows trained before its checkpoint.
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Any

from hellbender.data.image_decoding import (  # noqa: F401 (the names rows and collators import from here)
    ImagePolicy,
    ImageProblem,
    check_pixels,
    confined,
    corrupt_image,
    decode_image,
    os_problem,
)

REMOTE_SCHEMES = ("http://", "https://")
logger = logging.getLogger(__name__)


def image_reference(part_or_path: Any) -> str:
    """The path or URL an image part (`{"type": "image", "path"/"url"/"image": ...}`) or column entry names."""
    if isinstance(part_or_path, str):
        return part_or_path
    if isinstance(part_or_path, dict):
        for key in ("path", "url", "image"):
            value = part_or_path.get(key)
            if isinstance(value, str) and value:
                return value
    if isinstance(part_or_path, dict):
        shown = {k: v for k, v in part_or_path.items() if v is not None}  # Arrow fills absent keys with None
        raise ImageProblem(f"an image part needs a `path` or `url` (got {shown!r})", "bad image reference")
    raise ImageProblem(
        f"an image entry must be a path or URL string, or a part with `path` / `url` (got {part_or_path!r})",
        "bad image reference",
    )


def resolve_image(ref: str, policy: ImagePolicy) -> Path:
    """A local path for `ref`: inside the base directory, or a downloaded copy of an allowed URL."""
    if ref.startswith(REMOTE_SCHEMES):
        if not policy.allow_remote:
            raise ImageProblem(
                f"image `{ref}` is a remote URL, and remote images are off; set `allow_remote_images: true` on the "
                "dataset to fetch them",
                "remote image not allowed",
            )
        from hellbender.data.remote_images import download

        return download(ref, policy)
    if "://" in ref:
        raise ImageProblem(
            f"image `{ref}` uses an unsupported scheme; use a local path or an http(s) URL", "bad image reference"
        )
    base = policy.base_dir if policy.base_dir is not None else Path(".")
    path = confined(ref, base / ref, [base])
    try:
        if path.is_dir():
            raise ImageProblem(f"image `{ref}` is a directory (`{path}`), not an image file", "image missing")
        if not path.is_file():
            raise ImageProblem(f"image `{ref}` does not exist (looked for `{path}`)", "image missing")
    except OSError as exc:
        raise os_problem(ref, exc) from None
    return path


def _allowed_roots(policy: ImagePolicy) -> list[Path]:
    roots = [policy.base_dir] if policy.base_dir is not None else []
    return roots + ([policy.download_dir] if policy.download_dir is not None else [])


def read_image_file(path: Path, policy: ImagePolicy) -> bytes:
    """The bytes of the image file `path`, checked (again) to lie inside the policy's directories: the file is read
    through its resolved path, and a symlink put in its place after the check is not followed."""
    ref = str(path)
    sandboxed = policy.base_dir is not None
    real = confined(ref, path, _allowed_roots(policy)) if sandboxed else path
    try:
        fd = os.open(real, os.O_RDONLY | (os.O_NOFOLLOW if sandboxed else 0))
    except ValueError:  # NUL byte in a command-line path
        raise ImageProblem(f"image {ref!r} has a NUL byte in its path", "bad image reference") from None
    except IsADirectoryError:
        raise ImageProblem(f"image `{ref}` is a directory, not an image file", "image missing") from None
    except OSError as exc:
        raise os_problem(ref, exc) from None
    logger.debug("read image file %s", real)
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read()
    except IsADirectoryError:
        raise ImageProblem(f"image `{ref}` is a directory, not an image file", "image missing") from None
    except OSError as exc:
        raise os_problem(ref, exc) from None


EXIF_ORIENTATION = 0x0112
TURNED_A_QUARTER = {5, 6, 7, 8}  # EXIF orientations that show the stored pixels turned by 90 or 270 degrees


def _orientation(img: Any) -> int | None:
    """The EXIF orientation an image's header states, or None. A PNG may keep its EXIF after the pixels, and a
    truncated file fails to read it: the pixels' decoding names that corruption, not this size check."""
    try:
        return img.getexif().get(EXIF_ORIENTATION)
    except (OSError, ValueError, SyntaxError):
        return None


def image_header_size(path: Path, policy: ImagePolicy) -> tuple[int, int]:
    """(width, height) of an image as its file header states it, without decoding the pixels; the size the
    model sees when the config resizes images. Refuses a file over `max_image_pixels`."""
    from PIL import Image

    data = read_image_file(path, policy)
    try:
        with Image.open(io.BytesIO(data)) as img:
            size = img.size
            if _orientation(img) in TURNED_A_QUARTER:  # shown turned, as decode_image turns it
                size = size[::-1]
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise corrupt_image(path, data, exc) from None
    check_pixels(path, size, policy)
    return policy.resize_to or size


def open_image(path: Path, policy: ImagePolicy):
    """Decode the image file `path` as RGB (resized when the config asks), refusing a file outside the policy's
    directories, corrupt and oversized files."""
    return decode_image(read_image_file(path, policy), path, policy)


def pack_pixels(images: list[Any]) -> list[dict[str, Any]]:
    """Decoded RGB images as plain data for the prepared dataset (`cache_images`)."""
    return [{"width": img.width, "height": img.height, "rgb": img.tobytes()} for img in images]


def unpack_pixels(stored: list[dict[str, Any]]) -> list[Any]:
    from PIL import Image

    images = []
    for p in stored:
        if len(p["rgb"]) != p["width"] * p["height"] * 3:
            raise ImageProblem(
                f"a cached image ({p['width']}x{p['height']}) holds {len(p['rgb'])} bytes of pixels instead of "
                f"{p['width'] * p['height'] * 3}; the prepared data is damaged",
                "image corrupt",
            )
        images.append(Image.frombytes("RGB", (p["width"], p["height"]), p["rgb"]))
    return images
