"""bench/checkpoint_host_time.py on CPU: its table counts what a checkpointed layer re-runs in backward."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "bench" / "checkpoint_host_time.py"


@pytest.mark.parametrize("options", [[], ["--lora"]], ids=["plain", "lora"])
def test_each_checkpointed_layer_adds_at_least_its_forwards_operations_to_the_backward(options):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--repeats", "1", "--rounds", "1", *options],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "ms" not in line]
    table = {int(r[0]): (int(r[4]), int(r[5])) for r in rows}  # checkpointed layers: forward ops, backward ops
    assert sorted(table) == [0, 4, 8, 16]
    forward_none, backward_none = table[0]
    for layers in (4, 8, 16):
        forward, backward = table[layers]
        assert forward <= forward_none  # a checkpointed layer's forward saves less, and runs no more
        # Each checkpointed layer runs its forward again in backward: at least a sixteenth of the whole forward.
        assert backward - backward_none >= layers * forward_none / 16 * 0.8, (layers, table)
    assert "one checkpointed layer adds" in done.stdout and "beyond the forward" in done.stdout
    assert ("with LoRA" in done.stdout) is bool(options)
