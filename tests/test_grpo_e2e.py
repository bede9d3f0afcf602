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
from tests.test_distributed import run_torchrun
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


def assert_resumes_in_a_new_process_exactly(tmp_path: Path, **overrides) -> None:
    """Train the config of `grpo_file(**overrides)` uninterrupted; train it again, stopped after checkpoint-3 and
    resumed by a new `hellbender train` process: every step logs the same loss, gradient norm, rewards and completion
    lengths, and the final weights are equal, bit for bit."""
    reference = load_config(grpo_file(tmp_path / "reference", **overrides))
    train(reference)
    expected = per_step(reference.output_dir)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert len({v[2] for v in expected.values()}) > 1  # the rewards vary: equal ones would prove nothing

    config = grpo_file(tmp_path / "stopped", auto_resume_from_checkpoints=True, **overrides)
    train(load_config(config), callbacks=[StopAt(SAVE_AT)])
    out = tmp_path / "stopped" / "out"
    assert max(per_step(out)) == SAVE_AT
    if overrides.get("trl", {}).get("num_iterations", 1) > 1:
        assert (out / f"checkpoint-{SAVE_AT}" / "generation_buffer_0.pt").is_file()  # step 4's completions
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


def test_a_stopped_grpo_run_resumes_in_a_new_process_exactly(tmp_path):
    """Stopped after checkpoint-3 and resumed by a new process, steps 4 to 6 generate, score and train exactly as the
    uninterrupted run did, to the same final weights. With `num_iterations: 2` a generated batch trains two optimizer
    steps, and checkpoint-3 falls between them: the resumed run goes on with the batch generated at step 3 (a new
    trainer would otherwise count from 0 and generate again). With `num_iterations: 1` every checkpoint is at a
    generation boundary; tests/test_grpo.py resumes that case."""
    trl = {
        "reward_funcs": ["rewards.even_share"],
        "num_generations": 4,
        "max_completion_length": 4,
        "num_iterations": 2,
    }
    assert_resumes_in_a_new_process_exactly(tmp_path, trl=trl)


def test_two_processes_train_like_one_with_the_same_global_batch(tmp_path):
    """8 completions per step (2 prompts x 4) in one process, and 4 in each of two processes (gloo): the same rewards,
    reward spread, loss and gradient norm at every step, and the same final weights. `scale_rewards: batch` divides
    by the spread of the whole global batch, which each process knows only after the rewards are gathered; `dapo`
    divides the loss by the completion tokens of the global batch.

    Sampling itself cannot match: each process draws from its own random stream, so 2 x 4 completions are other
    draws than 1 x 8 (and greedy decoding would make the completions of a group equal, their advantages zero and the
    comparison empty). tests/grpo_seeded_run.py samples each completion from a seed of its own (step, prompt, copy),
    the same in both runs; everything after generation is hellbender's and TRL's code as it runs."""
    trl = {
        "reward_funcs": ["rewards.even_share"],
        "num_generations": 4,
        "max_completion_length": 4,
        "scale_rewards": "batch",
    }
    common = dict(trl=trl, gradient_accumulation_steps=1, max_steps=3, save_steps=3)
    single = grpo_file(tmp_path / "single", micro_batch_size=8, **common)
    from tests.grpo_seeded_run import RowSeededSampling

    train(load_config(single), callbacks=[RowSeededSampling()])
    expected = per_step(tmp_path / "single" / "out")
    assert len({v[2] for v in expected.values()}) > 1 and all(v[1] > 0 for v in expected.values())
    ddp = grpo_file(tmp_path / "ddp", micro_batch_size=4, **common)
    run_torchrun(REPO / "tests" / "grpo_seeded_run.py", str(ddp), OMP_NUM_THREADS="1")
    got = per_step(tmp_path / "ddp" / "out")
    assert sorted(got) == [1, 2, 3]
    for step, values in expected.items():
        assert got[step] == pytest.approx(values, abs=1e-5, rel=1e-4), step
    a, b = final_weights(tmp_path / "single" / "out"), final_weights(tmp_path / "ddp" / "out")
    for name in a:
        # Adam divides each update by the gradient's running spread: where a gradient is near zero, the two summation
        # orders' rounding moves a weight by up to ~0.1 % of the learning rate (2.7e-5 measured at lr 2e-2).
        torch.testing.assert_close(b[name], a[name], atol=1e-4, rtol=1e-4)


def test_a_sigterm_stopped_lora_run_resumes_then_merges_and_answers(tmp_path):
    """SIGTERM during a step saves that step's checkpoint and exits 143; the next run resumes and finishes; the
    adapter merges into a model plain transformers loads, and `hellbender inference` answers with it."""
    import signal

    from transformers import AutoModelForCausalLM, TrainerCallback

    from hellbender.config import validate_config
    from hellbender.storage import FINAL_MANIFEST, complete_checkpoints
    from tests.helpers import invoke
    from tests.test_grpo import grpo_settings

    class SigtermDuringStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                signal.raise_signal(signal.SIGTERM)

    raw = grpo_settings(
        tmp_path,
        adapter="lora",
        lora_r=8,
        lora_alpha=16,
        lora_target_linear=True,
        max_steps=4,
        save_steps=2,
        auto_resume_from_checkpoints=True,
    )
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(raw))
    cfg = load_config(config)
    metrics = train(cfg, callbacks=[SigtermDuringStep()])
    out = Path(cfg.output_dir)
    assert metrics["exit_code"] == 128 + signal.SIGTERM
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]
    assert not (out / FINAL_MANIFEST).exists()
    train(validate_config(cfg.model_dump()))
    assert max(e["step"] for e in trainer_state(out)["log_history"] if "reward" in e) == 4
    assert (out / FINAL_MANIFEST).exists()

    merged = invoke("merge-lora", config)
    assert merged.exit_code == 0, merged.output
    model = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert model.config.model_type == "llama"
    answer = invoke("inference", config, "--prompt", "question 1", "--max-new-tokens", "3")
    assert answer.exit_code == 0, answer.output
    assert answer.stdout.strip()
