"""Finding and opening the images of vision-language rows, safely.

Local paths resolve under a base directory and may not leave it (no `..`, no absolute path outside it, no
symlink pointing out). `http(s)` URLs are fetched only when the dataset allows remote images, and are stored
in the prepared-data directory so training never fetches them again. Every image is decoded once while
preparing, so a missing, corrupt or oversized image is found before training starts.
"""

from __future__ import annotations

import hashlib
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REMOTE_SCHEMES = ("http://", "https://")
REMOTE_TIMEOUT_S = 30
REMOTE_MAX_BYTES = 64 * 1024 * 1024


class ImageProblem(Exception):
    """An image that cannot be used; the message names the path and why, `reason` is the short kind of problem
    under which `skip_bad_images` counts dropped rows."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ImagePolicy:
    base_dir: Path
    allow_remote: bool
    max_pixels: int
    resize_to: tuple[int, int] | None = None  # (width, height)
    resample: str = "bilinear"
    download_dir: Path | None = None  # where remote images are stored while preparing


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
        return _download(ref, policy)
    if "://" in ref:
        raise ImageProblem(
            f"image `{ref}` uses an unsupported scheme; use a local path or an http(s) URL", "bad image reference"
        )
    base = policy.base_dir.resolve()
    path = (base / ref).resolve()  # resolves `..` and symlinks, so both are caught by the check below
    if not path.is_relative_to(base):
        raise ImageProblem(
            f"image `{ref}` resolves to `{path}`, outside `image_base_dir` `{base}`; images must stay inside it",
            "image outside image_base_dir",
        )
    if path.is_dir():
        raise ImageProblem(f"image `{ref}` is a directory (`{path}`), not an image file", "image missing")
    if not path.is_file():
        raise ImageProblem(f"image `{ref}` does not exist (looked for `{path}`)", "image missing")
    return path


def _download(url: str, policy: ImagePolicy) -> Path:
    if policy.download_dir is None:
        raise ImageProblem(f"image `{url}` is remote but there is nowhere to store it", "image could not be fetched")
    target = policy.download_dir / hashlib.sha256(url.encode()).hexdigest()
    if target.is_file():
        return target
    try:
        with urllib.request.urlopen(url, timeout=REMOTE_TIMEOUT_S) as response:  # noqa: S310 (scheme checked)
            data = response.read(REMOTE_MAX_BYTES + 1)
    except OSError as exc:
        raise ImageProblem(f"image `{url}` could not be fetched: {exc}", "image could not be fetched") from None
    if len(data) > REMOTE_MAX_BYTES:
        raise ImageProblem(f"image `{url}` is larger than {REMOTE_MAX_BYTES} bytes", "image too large")
    policy.download_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")  # renamed into place whole, never half-written
    partial.write_bytes(data)
    os.replace(partial, target)
    return target


def open_image(path: Path, policy: ImagePolicy):
    """Decode an image as RGB (resized when the config asks), refusing corrupt and oversized files."""
    from PIL import Image

    if not path.is_file():
        raise ImageProblem(f"image `{path}` does not exist", "image missing")
    if path.stat().st_size == 0:
        raise ImageProblem(f"image `{path}` is empty (0 bytes); the file is corrupt", "image corrupt")
    try:
        with Image.open(path) as img:
            width, height = img.size
            if width * height > policy.max_pixels:
                raise ImageProblem(
                    f"image `{path}` has {width}x{height} pixels, more than `max_image_pixels: {policy.max_pixels}`",
                    "image too large",
                )
            img.load()
            rgb = img.convert("RGB")
    except ImageProblem:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageProblem(
            f"image `{path}` cannot be decoded ({exc}); the file is corrupt or not an image", "image corrupt"
        ) from None
    if policy.resize_to:
        rgb = rgb.resize(policy.resize_to, getattr(Image.Resampling, policy.resample.upper()))
    return rgb


def pack_pixels(images: list[Any]) -> list[dict[str, Any]]:
    """Decoded RGB images as plain data for the prepared dataset (`cache_images`)."""
    return [{"width": img.width, "height": img.height, "rgb": img.tobytes()} for img in images]


def unpack_pixels(stored: list[dict[str, Any]]) -> list[Any]:
    from PIL import Image

    return [Image.frombytes("RGB", (p["width"], p["height"]), p["rgb"]) for p in stored]
