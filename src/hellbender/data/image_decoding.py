"""What every image of a vision-language row must pass, wherever it comes from (a local file or a fetched URL): the
directory it must stay inside, its pixel count, and a decode into 8-bit RGB that refuses corrupt files."""

from __future__ import annotations

import errno
import io
from dataclasses import dataclass
from pathlib import Path

from hellbender.data.image_modes import UnsupportedImage, to_rgb


class ImageProblem(Exception):
    """An image that cannot be used; the message names the path and why, `reason` is the short kind of problem
    under which `skip_bad_images` counts dropped rows."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ImagePolicy:
    # The directory images must stay inside; None only for files the user names on the command line (`infer`).
    base_dir: Path | None
    allow_remote: bool
    max_pixels: int
    resize_to: tuple[int, int] | None = None  # (width, height)
    resample: str = "bilinear"
    download_dir: Path | None = None  # where remote images are stored while preparing


def os_problem(ref: str, exc: OSError) -> ImageProblem:
    """An operating-system error on an image path, as one sentence naming the path."""
    if exc.errno == errno.ENOENT:
        return ImageProblem(f"image `{ref}` does not exist", "image missing")
    if exc.errno == errno.ELOOP:
        return ImageProblem(
            f"image `{ref}` is a symlink loop (or a symlink that appeared after it was checked)", "image unreadable"
        )
    if exc.errno == errno.ENAMETOOLONG:
        return ImageProblem(
            f"image `{ref[:200]}...` has a path or file name too long for the file system", "bad image reference"
        )
    return ImageProblem(f"image `{ref}` cannot be read: {exc.strerror or exc}", "image unreadable")


def confined(ref: str, path: Path, roots: list[Path]) -> Path:
    """`path` with every `..` and symlink resolved, which must lie inside one of `roots` (the first is the one an
    error names, `image_base_dir`)."""
    if "\x00" in ref:
        raise ImageProblem(f"image {ref!r} has a NUL byte in its path", "bad image reference")
    try:
        real = path.resolve()
        bases = [root.resolve() for root in roots]
    except RuntimeError:  # Python 3.11 reports a symlink loop this way; later versions raise ELOOP
        raise ImageProblem(f"image `{ref}` is a symlink loop", "image unreadable") from None
    except OSError as exc:
        raise os_problem(ref, exc) from None
    if not any(real.is_relative_to(base) for base in bases):
        raise ImageProblem(
            f"image `{ref}` resolves to `{real}`, outside `image_base_dir` `{bases[0]}`; images must stay inside it",
            "image outside image_base_dir",
        )
    return real


def check_pixels(path: Path, size: tuple[int, int], policy: ImagePolicy) -> None:
    width, height = size
    if width * height > policy.max_pixels:
        raise ImageProblem(
            f"image `{path}` has {width}x{height} pixels, more than `max_image_pixels: {policy.max_pixels}`",
            "image too large",
        )


def corrupt_image(path: Path | str, data: bytes, exc: Exception) -> ImageProblem:
    if not data:
        return ImageProblem(f"image `{path}` is empty (0 bytes); the file is corrupt", "image corrupt")
    return ImageProblem(
        f"image `{path}` cannot be decoded ({exc}); the file is corrupt or not an image", "image corrupt"
    )


def decode_image(data: bytes, name: Path | str, policy: ImagePolicy):
    """Decode image bytes as 8-bit RGB (resized when the config asks), refusing corrupt and oversized images."""
    from PIL import Image, ImageOps

    if not data:
        raise corrupt_image(name, data, ValueError("empty"))
    try:
        with Image.open(io.BytesIO(data)) as img:
            check_pixels(Path(str(name)), img.size, policy)
            img.load()  # the whole file: a truncated one fails here
            # A camera's EXIF orientation says how the stored pixels are to be turned; transformers' `load_image`
            # applies it, so an image is trained the way it is shown.
            rgb = to_rgb(ImageOps.exif_transpose(img), str(name))
    except ImageProblem:
        raise
    except UnsupportedImage as exc:
        raise ImageProblem(str(exc), "image mode unsupported") from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise corrupt_image(name, data, exc) from None
    if policy.resize_to:
        rgb = rgb.resize(policy.resize_to, getattr(Image.Resampling, policy.resample.upper()))
    return rgb
