"""GRPO (`rl: grpo`) runs as users start them, from a config file: a run stopped after a checkpoint and resumed by a
second `hellbender train` process repeats the uninterrupted run step for step, and two processes train like one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hellbender.config import load_config
from hellbender.train.run import train
from tests.conftest import REPO
from tests.helpers import StopAt, base_config, final_weights, trainer_state
from tests.test_grpo import grpo_dir

STEPS, SAVE_AT = 6, 3


def grpo_file(root: Path, **overrides) -> Path:
    """A config file for a short full fine-tuning GRPO run next to its reward file and prompts (the reward file is
    found there, as a user's is)."""
    root.mkdir(parents=True, exist_ok=True)
    grpo_dir(root)
    settings = {
        "rl": "grpo",
        "datasets": [{"path": "prompts.jsonl"}],
        "trl": {"reward_funcs": ["rewards.even_share"], "num_generations": 4, "max_completion_length": 4},
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 2,  # one generation feeds two micro-batches (TRL's buffer)
        "max_steps": STEPS,
        "save_steps": SAVE_AT,
        "learning_rate": 2e-2,
    }
    raw = base_config(root, **{**settings, **overrides})
    raw["datasets"] = [{"path": str(root / "prompts.jsonl")}]
    path = root / "config.yml"
    path.write_text(yaml.safe_dump(raw))
    return path


def per_step(output_dir: str | Path) -> dict[int, tuple[float | None, ...]]:
    """step -> (loss, gradient norm, mean reward, its spread, mean completion length) as logged; the generation's
    metrics are None at a step that trained on an earlier step's completions (`num_iterations` > 1)."""
    keys = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length")
    return {e["step"]: tuple(e.get(k) for k in keys) for e in trainer_state(output_dir)["log_history"] if "loss" in e}


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_a_stopped_grpo_run_resumes_in_a_new_process_exactly(tmp_path, num_iterations):
    """Stopped after checkpoint-3 and resumed by a new process, steps 4 to 6 generate, score and train exactly as the
    uninterrupted run did, to the same final weights. With `num_iterations: 2` a generated batch trains two optimizer
    steps, and checkpoint-3 falls between them: the resumed run goes on with the batch generated at step 3."""
    trl = {"reward_funcs": ["rewards.even_share"], "num_generations": 4, "max_completion_length": 4}
    trl["num_iterations"] = num_iterations
    reference = load_config(grpo_file(tmp_path / "reference", trl=trl))
    train(reference)
    expected = per_step(reference.output_dir)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert len({v[2] for v in expected.values()}) > 1  # the rewards vary: equal ones would prove nothing

    config = grpo_file(tmp_path / "stopped", trl=trl, auto_resume_from_checkpoints=True)
    train(load_config(config), callbacks=[StopAt(SAVE_AT)])
    out = tmp_path / "stopped" / "out"
    assert max(per_step(out)) == SAVE_AT
    done = subprocess.run(
        [sys.executable, "-m", "tests.stopped_run", str(config)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = (out / "report" / "report.md").read_text()
    assert f"resumed at step {SAVE_AT}" in report  # not trained again from the start
    assert per_step(out) == expected
    final, wanted = final_weights(out), final_weights(reference.output_dir)
    assert final.keys() == wanted.keys()
    for name in final:
        torch.testing.assert_close(final[name], wanted[name], atol=0, rtol=0)
