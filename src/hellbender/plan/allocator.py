"""The CUDA caching allocator's settings a training process runs with: expandable segments unless the user chose
otherwise.

Without expandable segments the allocator keeps every block it got from the driver whole and splits it for smaller
requests; when the shapes change from step to step (packed rows with varying images, offloaded layer inputs) the
holes it cannot reuse add up, and it reserved 1.26-1.60x what the run allocated (docs/plan.md). With them it maps
pages into one growing range and reserved 1.09-1.11x on those runs. Axolotl sets the same default, so configs brought
from it see the memory they saw there. The planner reads the same settings for its allocator margin.
"""

from __future__ import annotations

import logging
import os

# torch reads either (the first is the newer name, torch >= 2.9); a user's value in either is left alone.
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
DEFAULT_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"  # the name every torch >= 2.6 reads
DEFAULT_ALLOCATOR_SETTINGS = "expandable_segments:True"


def allocator_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The allocator variables a training process started from `environ` (this process's by default) runs with, in
    the order torch reads them: the user's, else hellbender's default. Handed to processes that do not inherit
    `environ`, such as Ray workers on a cluster's other machines."""
    environ = os.environ if environ is None else environ
    chosen = {name: environ[name] for name in ALLOCATOR_VARIABLES if name in environ}
    return chosen or {DEFAULT_VARIABLE: DEFAULT_ALLOCATOR_SETTINGS}


def allocator_settings(environ: dict[str, str] | None = None) -> str:
    """The settings those variables give: the first that torch reads."""
    return next(iter(allocator_environment(environ).values()))


def uses_expandable_segments(environ: dict[str, str] | None = None) -> bool:
    """Whether those settings turn expandable segments on."""
    return "expandable_segments:true" in allocator_settings(environ).replace(" ", "").lower()


def set_default_allocator_settings() -> bool:
    """Expandable segments for this process and those it starts, unless the user set the allocator's variable or
    CUDA has already started (the allocator reads its settings once, when CUDA starts). Returns whether it set them."""
    if any(name in os.environ for name in ALLOCATOR_VARIABLES):
        return False
    import torch

    if torch.cuda.is_initialized():
        logging.getLogger("hellbender").info(
            "CUDA started before hellbender could set its allocator default: this process runs without expandable "
            "segments (set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA starts to have them)"
        )
        return False
    os.environ[DEFAULT_VARIABLE] = DEFAULT_ALLOCATOR_SETTINGS
    return True
