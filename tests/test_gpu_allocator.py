"""On a GPU: hellbender's default allocator settings take effect when set after `import torch` and before the
training code's imports (as `hellbender train` sets them), and a user's setting wins.

Each case runs in a fresh interpreter: the allocator reads its settings once, when CUDA starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hellbender.plan.allocator import ALLOCATOR_VARIABLES

pytestmark = pytest.mark.gpu

ALLOCATIONS = textwrap.dedent(
    """
    import json

    import torch

    from hellbender.plan.allocator import set_default_allocator_settings

    set_default = set_default_allocator_settings()  # as `hellbender train` sets it, before the training code's imports
    from hellbender.train.run import train  # noqa: E402, F401  (peft's import can start CUDA: torchao probes the GPU)

    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    expandable = {segment["is_expandable"] for segment in torch.cuda.memory_snapshot()}
    print(json.dumps({"set_default": set_default, "expandable": sorted(expandable)}))
    """
)


def _allocate(environ: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", ALLOCATIONS], capture_output=True, text=True, timeout=300, check=False, env=environ,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _environ_without_allocator_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}


def test_the_default_takes_effect():
    result = _allocate(_environ_without_allocator_settings())
    assert result == {"set_default": True, "expandable": [True]}, result


def test_a_users_allocator_setting_wins():
    result = _allocate(
        {**_environ_without_allocator_settings(), "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    )
    assert result == {"set_default": False, "expandable": [False]}, result
