"""The prepared-dataset cache: one directory per key, written whole or not at all.

The key covers everything that changes the prepared rows: the dataset entries, the data files' sizes and
modification times, the tokenizer (vocabulary, special tokens, chat template), the preparation settings and
`PREPARE_FORMAT_VERSION`. A directory is written under a staging name and renamed into place
(`storage.write_directory_atomically`), so a killed run leaves no directory that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hellbender.data.formats.mistral_chat import is_mistral_common
from hellbender.data.sources import is_url, local_files, looks_local
from hellbender.storage import write_directory_atomically, write_file_atomically

# Bump whenever a format, the packing or the stored layout changes what a cache directory holds.
PREPARE_FORMAT_VERSION = 4  # 2: message weights, tool calls and null contents change labels; 3: vision rows name the
# directory their images must stay inside; 4: images turned by their EXIF orientation (a turned image's size, and so
# its number of image tokens, can differ)
COMPLETE_MARKER = "hellbender_prepared.json"


def _backend_json(backend: Any) -> bytes:
    """The fast tokenizer's definition without its padding / truncation state, which batching changes in place
    and which does not change the tokens of a row."""
    data = json.loads(backend.to_str())
    data.pop("padding", None)
    data.pop("truncation", None)
    return json.dumps(data, sort_keys=True).encode()


def _mistral_common_fingerprint(tokenizer: Any) -> str:
    """A mistral-common tokenizer is its one file (vocabulary, special tokens, instruct format version) and the
    library's version, whose encoder lays conversations out."""
    from importlib.metadata import version

    h = hashlib.sha256(Path(tokenizer.tokenizer.instruct_tokenizer.tokenizer.file_path).read_bytes())
    h.update(f"mistral-common {version('mistral-common')} pad {tokenizer.pad_token_id}".encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    if is_mistral_common(tokenizer):
        return _mistral_common_fingerprint(tokenizer)
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    h.update(
        _backend_json(backend) if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    )
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(json.dumps({k: str(v) for k, v in sorted(tokenizer.added_tokens_decoder.items())}).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    h.update(type(tokenizer).__name__.encode())
    return h.hexdigest()


def files_fingerprint(path: str) -> list[tuple[str, int, int]]:
    """Size and modification time of local data files, so edited files invalidate the cache."""
    if is_url(path) or not looks_local(path):
        return []
    files = local_files(path)
    return [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]


def cache_key(parts: dict[str, Any]) -> str:
    payload = json.dumps({"version": PREPARE_FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def cached_dir(root: str | Path, key: str) -> Path | None:
    """The complete cache directory for `key`, or None."""
    path = Path(root) / key
    return path if (path / COMPLETE_MARKER).is_file() else None


def write_entry(root: str | Path, key: str, write: Callable[[Path], dict[str, Any]]) -> Path:
    """Write the cache directory of `key` whole or not at all: `write(staging)` fills it and returns metadata stored
    in the completion marker. A complete directory another process finished meanwhile is kept (equally valid); an
    incomplete one (e.g. a half-finished delete) is replaced."""

    def write_with_marker(staging: Path) -> None:
        meta = write(staging)
        write_file_atomically(staging / COMPLETE_MARKER, json.dumps({"key": key, **meta}, indent=2))

    return write_directory_atomically(
        Path(root) / key, write_with_marker, keep_if=lambda final: cached_dir(root, key) is not None
    )
