"""Paths no file system accepts: a name longer than the file system allows, a path longer than the operating
system's limit. Found at validation, naming the key, because the operating system's own error for them (`File name
too long`) surfaces wherever the path is first used. (A NUL byte is refused by the path keys' own type.)"""

from __future__ import annotations

import os
from typing import Any

NAME_MAX = 255  # bytes in one path component (ext4, xfs, btrfs, tmpfs)
PATH_MAX = 4096  # bytes in a whole path (Linux)
ENTRY_LISTS = ("datasets", "test_datasets", "pretraining_dataset")
ENTRY_PATH_KEYS = ("path", "image_base_dir", "data_files")
TOP_PATH_KEYS = ("output_dir", "dataset_prepared_path", "base_model", "tokenizer_config")


def path_shape_problem(key: str, value: str) -> str | None:
    """Why `value` (the path under `key`) cannot name a file, or None."""
    shown = value if len(value) <= 80 else f"{value[:60]}...{value[-12:]}"
    encoded = os.fsencode(value)
    if len(encoded) > PATH_MAX:
        return f"`{key}` is a path of {len(encoded)} bytes, longer than the {PATH_MAX} the system allows; shorten it."
    longest = max(encoded.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        return (
            f"`{key}: {shown}` has a file or directory name of {len(longest)} bytes; file systems allow at most "
            f"{NAME_MAX}. Shorten the name."
        )
    return None


def path_shape_problems(cfg: Any) -> list[str]:
    """The problems of every path-valued key of the config and of its dataset entries."""
    found = [(key, getattr(cfg, key, None)) for key in TOP_PATH_KEYS]
    for list_key in ENTRY_LISTS:
        for i, entry in enumerate(getattr(cfg, list_key, None) or []):
            for key in ENTRY_PATH_KEYS:
                value = getattr(entry, key, None)
                values = value if isinstance(value, list) else [value]
                found += [(f"{list_key}[{i}].{key}", v) for v in values]
    problems = [path_shape_problem(key, value) for key, value in found if isinstance(value, str)]
    return [p for p in problems if p]
