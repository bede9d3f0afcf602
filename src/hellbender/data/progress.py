"""Progress bars for the steps a user waits on (tokenizing, saving), none for `datasets`' quick bookkeeping steps
(filtering dropped rows, flattening indices, packing), which otherwise print a bar each in well under a second."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_progress() -> Iterator[None]:
    from datasets.utils import logging as datasets_logging

    was_enabled = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            datasets_logging.enable_progress_bar()
