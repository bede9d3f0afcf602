"""Local directories named as a model or a tokenizer must hold one: checked at validation (before any data is
prepared) and again right before loading, so that a data folder named by mistake gets one paragraph rather than a
tokenizer library's traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "tekken.json",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _holds(directory: Path, wanted: Literal["model", "tokenizer"]) -> bool:
    if wanted == "model":
        return (directory / "config.json").is_file()
    return any((directory / name).is_file() for name in TOKENIZER_FILES) or any(directory.glob("tokenizer.model.v*"))


def local_source_problem(name: str, key: str, wanted: Literal["model", "tokenizer"]) -> str | None:
    """Why the existing local path `name` (the value of `key`) cannot be loaded as a `wanted`; None when it can, or
    when it is not a local path (a hub id)."""
    path = Path(name).expanduser()
    if not path.exists():
        return None
    what = "a model (`config.json` and weights)" if wanted == "model" else "a tokenizer (`tokenizer.json` or similar)"
    if not path.is_dir():
        return f"`{key}: {name}` is a file; it must be a directory holding {what}, or a hub id such as `org/model`."
    if _holds(path, wanted):
        return None
    inside = sorted(p.name for p in path.iterdir())
    holds = f"it holds {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''}" if inside else "it is empty"
    return (
        f"`{key}: {name}` is a directory without {what} ({holds}). Point `{key}` at the directory a model was saved "
        "to (`save_pretrained` writes it), or give a hub id such as `org/model`."
    )
