"""A model or tokenizer whose classes live in its own repository's Python files, refused in one paragraph while
`trust_remote_code` is off."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hellbender.errors import ConfigError


@contextmanager
def remote_code_refused(source: str | Path) -> Iterator[None]:
    """transformers refuses a repository whose classes live in its own Python files (`auto_map`) unless
    `trust_remote_code` is on: say so in one paragraph."""
    try:
        yield
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise ConfigError(
            f"`{source}` needs Python code from its own repository to load (its config names custom classes in "
            "`auto_map`). hellbender does not run a model repository's code unless the config asks for it "
            "(`trust_remote_code` is off by default, so that loading a model cannot run code nobody reviewed). If "
            "you trust this repository's code, add `trust_remote_code: true`; otherwise pick a model transformers "
            "supports natively."
        ) from None
