"""Remote images (`allow_remote_images: true`): fetched once while preparing and stored under the prepared-data
directory, named by the hash of their URL, so training never fetches them again.

A stored copy is reused without asking the server again, so only a whole, decodable image is stored: a body
shorter than its `Content-Length`, an HTML page (a login wall, a 404 page served with status 200) or bytes that
do not decode completely as an image are refused, naming the URL. The copy is written under a temporary name and
renamed into place, so a killed run never leaves half a file under the final name.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from hellbender.data.image_decoding import ImagePolicy, ImageProblem, confined, decode_image

REMOTE_TIMEOUT_S = 30
REMOTE_MAX_BYTES = 64 * 1024 * 1024
FETCH_FAILED = "image could not be fetched"


@dataclass(frozen=True)
class FetchedBody:
    data: bytes
    content_type: str  # '' when the server sent none
    declared_length: int | None  # the Content-Length header, when sent


def fetch(url: str) -> FetchedBody:
    """One GET of `url`, at most REMOTE_MAX_BYTES + 1 bytes (the one seam through which images are fetched)."""
    with urllib.request.urlopen(url, timeout=REMOTE_TIMEOUT_S) as response:  # noqa: S310 (scheme checked)
        length = response.headers.get("Content-Length")
        return FetchedBody(
            data=response.read(REMOTE_MAX_BYTES + 1),
            content_type=response.headers.get("Content-Type") or "",
            declared_length=int(length) if length and length.strip().isdigit() else None,
        )


def download(url: str, policy: ImagePolicy) -> Path:
    """The stored copy of the image at `url`, fetched and checked first when there is none."""
    if policy.download_dir is None:
        raise ImageProblem(f"image `{url}` is remote but there is nowhere to store it", FETCH_FAILED)
    directory = policy.download_dir.absolute()
    target = directory / hashlib.sha256(url.encode()).hexdigest()
    if target.exists() or target.is_symlink():
        stored = confined(str(target), target, [directory])  # a stored copy swapped for a symlink is not followed
        if _whole(stored, url, policy):
            return stored
        target.unlink()  # a bad body stored by an older version: fetched anew
    try:
        body = fetch(url)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise ImageProblem(f"image `{url}` could not be fetched: {exc}", FETCH_FAILED) from None
    check_body(url, body, policy)
    _store(target, body.data, url)
    return target


def _whole(stored: Path, url: str, policy: ImagePolicy) -> bool:
    try:
        decode_image(stored.read_bytes(), url, policy)
    except (ImageProblem, OSError):
        return False
    return True


def check_body(url: str, body: FetchedBody, policy: ImagePolicy) -> None:
    """Refuse a body that is not one whole image."""
    size = len(body.data)
    if size > REMOTE_MAX_BYTES:
        raise ImageProblem(f"image `{url}` is larger than {REMOTE_MAX_BYTES} bytes", "image too large")
    if body.declared_length is not None and size != body.declared_length:
        raise ImageProblem(
            f"image `{url}` arrived cut short ({size} of the {body.declared_length} bytes the server announced); "
            "it was not stored, run again to fetch it anew",
            FETCH_FAILED,
        )
    kind = body.content_type.split(";")[0].strip().lower()
    if kind.startswith("text/") or "html" in kind:
        raise ImageProblem(
            f"image `{url}` returned a `{kind}` page, not an image (a login or error page?); check the URL",
            FETCH_FAILED,
        )
    try:
        decode_image(body.data, url, policy)  # the whole image decodes, or nothing is stored
    except ImageProblem as exc:
        raise ImageProblem(f"{exc}; it was not stored", exc.reason) from None


def _store(target: Path, data: bytes, url: str) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    except OSError as exc:
        raise ImageProblem(
            f"image `{url}` could not be stored in `{target.parent}`: {exc.strerror}", FETCH_FAILED
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, target)
    except OSError as exc:
        Path(partial).unlink(missing_ok=True)
        raise ImageProblem(f"image `{url}` could not be stored as `{target}`: {exc.strerror}", FETCH_FAILED) from None
