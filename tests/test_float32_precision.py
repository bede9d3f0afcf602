"""TF32 as transformers sets it stays readable through torch's legacy API, which torch's compiler still reads.

Each case runs in a fresh interpreter: the precision is process-wide state that the new API cannot put back to
torch's start-up state once written."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from transformers.utils.import_utils import enable_tf32

    from hellbender.train.float32_precision import legacy_readers_raise, restate_for_legacy_readers

    def per_backend():
        b = torch.backends
        return [b.fp32_precision, b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision,
                b.cudnn.rnn.fp32_precision, b.mkldnn.matmul.fp32_precision, b.mkldnn.conv.fp32_precision]

    enable_tf32(sys.argv[1] == "on")  # what TrainingArguments does for `tf32`, or when the Trainer compiles in bf16
    raised_before = legacy_readers_raise()
    written = per_backend()
    if sys.argv[2] == "training-arguments":  # hellbender's arguments for a run, built after the write
        from hellbender.config import validate_config
        from hellbender.train.arguments import training_arguments
        from hellbender.train.schedule import plan_schedule
        from tests.helpers import base_config

        cfg = validate_config(base_config(Path(sys.argv[3])))
        training_arguments(cfg, plan_schedule(cfg, 8), has_eval=False)
    else:
        restate_for_legacy_readers()
    print(json.dumps({
        "raised_before": raised_before,
        "raises_after": legacy_readers_raise(),
        "per_backend_kept": per_backend() == written,
        "matmul": torch.get_float32_matmul_precision(),
        "cuda_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
    }))
    """
)


@pytest.mark.parametrize(
    ("tf32", "matmul", "by"),
    [("on", "high", "restatement"), ("off", "highest", "training-arguments")],
)
def test_tf32_written_the_new_way_reads_back_through_the_legacy_api(tmp_path, tf32, matmul, by):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, tf32, by, str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPOSITORY,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # With torch 2.13 and transformers 5.x the legacy readers refuse after transformers' write; should a later torch
    # answer them, the restatement is a no-op and the rest still holds.
    assert not result["raises_after"], result
    assert result["per_backend_kept"], result
    assert result["matmul"] == matmul
    assert result["cuda_matmul_tf32"] is (tf32 == "on") and result["cudnn_tf32"] is (tf32 == "on"), result
