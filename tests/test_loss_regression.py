"""Stored loss lists: a few seeded optimizer steps of the built-in tiny models, compared step by step with the
losses they gave when the lists were written.

The invariant tests (packed == unpacked, batch == accumulation, resumed == uninterrupted) compare two hellbender
paths with each other, so a change that moves both the same way passes them. These catch it: a transformers, PEFT
or torch upgrade that changes the numbers, or a refactor of hellbender that changes what a config trains.

How the lists were made: each config below trained on CPU (fp32, seed 42, the built-in tiny models built in code)
with torch 2.13.0+cpu, transformers 5.24, peft 0.21.2, from hellbender's code at commit 5e12c8e. Runs in separate
processes, in opposite test orders, with a cold or a warm tiny-model cache, after other tests in one session and
with OMP_NUM_THREADS=1 gave bit-identical losses; a packed-row mask that lets documents see each other moves the
packing losses by about 1e-3, ten times the tolerance.

A failure here means the numbers changed. If the change is deliberate (a library upgrade you accept, or a change
to what a config means), regenerate the lists and say why in the commit:

    HELLBENDER_REGENERATE_LOSSES=1 python -m pytest -rs tests/test_loss_regression.py

Each test then skips with its new list as the reason, ready to paste into EXPECTED_LOSSES.
"""

from __future__ import annotations

import os

import pytest

from hellbender.config import validate_config
from hellbender.train.run import train
from tests.helpers import TEXT_DATA, base_config, logged_losses, vlm_config

REGENERATE = os.environ.get("HELLBENDER_REGENERATE_LOSSES") == "1"
TOLERANCE = 1e-4  # absolute, per step; repeated runs agree exactly
STEPS = 5

LORA = dict(adapter="lora", lora_target_linear=True)

CONFIGS = {
    # tiny-llama, LoRA on every linear layer, the bundled chat data.
    "lora": lambda tmp: base_config(tmp, **LORA, max_steps=STEPS),
    # tiny-llama, every weight trained.
    "full": lambda tmp: base_config(tmp, max_steps=STEPS, learning_rate=1e-3),
    # tiny-llama, LoRA, several chat rows packed into each 128-token row.
    "sample_packing": lambda tmp: base_config(tmp, **LORA, sample_packing=True, max_steps=STEPS),
    # tiny Qwen2.5-VL, LoRA, the bundled image chat data (coloured squares).
    "vlm": lambda tmp: vlm_config(
        tmp, "hellbender/tiny-qwen2.5-vl", **LORA, micro_batch_size=2, max_steps=STEPS, learning_rate=3e-3
    ),
    # tiny-llama, continued pretraining on streamed raw text, full weights, length set by max_steps.
    "pretraining": lambda tmp: base_config(
        tmp,
        datasets=[],
        pretraining_dataset=[{"path": TEXT_DATA, "ds_type": "json", "text_column": "text"}],
        sequence_len=64,
        micro_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-3,
    ),
}

EXPECTED_LOSSES = {
    "lora": [6.287806, 6.274252, 6.174889, 6.124633, 6.070429],
    "full": [6.287806, 6.178329, 6.050876, 5.940339, 5.903499],
    "sample_packing": [6.277291, 6.239495, 6.136725, 6.117228, 5.968675],
    "vlm": [6.295428, 6.205379, 6.106481, 6.008173, 5.933176],
    "pretraining": [6.237380, 6.127358, 5.998659, 5.912249, 5.743628],
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_losses_match_the_stored_list(tmp_path, name):
    cfg = validate_config(CONFIGS[name](tmp_path))
    train(cfg)
    logged = logged_losses(cfg.output_dir)
    assert sorted(logged) == list(range(1, STEPS + 1)), logged
    losses = [logged[step] for step in sorted(logged)]
    if REGENERATE:
        pytest.skip(f'regenerated: "{name}": [{", ".join(f"{loss:.6f}" for loss in losses)}],')
    assert losses == pytest.approx(EXPECTED_LOSSES[name], abs=TOLERANCE), (name, losses)
