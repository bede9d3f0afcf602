"""Kill a training run anywhere with SIGKILL, run it again, and get the run that was never killed.

The reference run records every file-system write under its run directory (tests/crash_run.py). Kill points are
drawn (seeded) from those writes, by where they land: checkpoint writes (including rotation), prepared-dataset
cache writes, the data loading and tokenizing writes of `datasets` and the final model, plus points a random number of milliseconds into a random step. For each
point a fresh run is killed there, every checkpoint a resume would trust is checked to load completely, and the
run is started again with the same config; its per-step losses must equal the reference run's.

CI runs `CI_POINTS` points; `HELLBENDER_FAULT_POINTS=all python -m pytest tests/test_fault_injection.py -m slow`
runs every point of `all_kill_points` (at least 20).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hellbender.storage import FINAL_MANIFEST, checkpoint_dirs, incompleteness, latest_checkpoint
from tests.conftest import EXAMPLES
from tests.helpers import logged_losses

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "crash_run.py"
MAX_STEPS = 8
SEED = 20261126


def run_config(root: Path) -> Path:
    cfg = {
        "base_model": "hellbender/tiny-llama",
        "datasets": [{"path": str(EXAMPLES / "data" / "chat.jsonl"), "type": "chat_template"}],
        "sequence_len": 128,
        "micro_batch_size": 2,
        "max_steps": MAX_STEPS,
        "learning_rate": 3e-3,
        "lr_scheduler": "cosine",
        "adapter": "lora",
        "lora_dropout": 0.1,  # the RNG must resume too
        "logging_steps": 1,
        "save_steps": 2,
        "save_total_limit": 1,  # rotation runs at every save
        "memory_watchdog": "off",
        "auto_resume_from_checkpoints": True,
        "bf16": False,
        "output_dir": str(root / "out"),
        "dataset_prepared_path": str(root / "prepared"),
    }
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def crash_run(config: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        # Inside the run directory, so the writes of loading and tokenizing the data are kill points too.
        "HF_DATASETS_CACHE": str(config.parent / "hf-datasets"),
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(config), *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict[int, float], list[tuple[str, str]]]:
    root = tmp_path_factory.mktemp("reference")
    events = root / "events.log"
    done = crash_run(run_config(root), "--events", str(events))
    assert done.returncode == 0, done.stderr[-3000:]
    recorded = [tuple(line.split("\t", 1)) for line in events.read_text().splitlines()]
    relative = [(kind, str(Path(path).relative_to(root))) for kind, path in recorded]
    return logged_losses(root / "out"), relative


def all_kill_points(events: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """(label, crash_run arguments) for every kill point: per category, seeded picks among the recorded writes."""
    rng = random.Random(SEED)
    categories = {
        "checkpoint": [i for i, (_, p) in enumerate(events) if "checkpoint-" in p],
        "cache": [i for i, (_, p) in enumerate(events) if p.startswith("prepared")],
        "tokenization": [i for i, (_, p) in enumerate(events) if p.startswith("hf-datasets")],
        "final model": [i for i, (_, p) in enumerate(events) if "final-model" in p or FINAL_MANIFEST in p],
    }
    wanted = {"checkpoint": 10, "cache": 5, "tokenization": 4, "final model": 3}
    points = []
    for category, indices in categories.items():
        assert indices, f"the reference run made no {category} write: the harness would not test it"
        for index in sorted(rng.sample(indices, min(wanted[category], len(indices)))):
            kind, path = events[index]
            points.append((f"{category}: {kind} {path}", ["--kill-at-event", str(index)]))
    for _ in range(6):
        step, delay = rng.randint(1, MAX_STEPS), rng.uniform(0, 40)
        points.append((f"step {step} + {delay:.0f} ms", ["--kill-in-step", str(step), "--delay-ms", f"{delay:.1f}"]))
    return points


def assert_trusted_checkpoints_load(output_dir: Path) -> None:
    """Every checkpoint hellbender would resume from opens completely: no half-trusted checkpoint."""
    from safetensors.torch import load_file
    from transformers.trainer_pt_utils import safe_globals  # the numpy types of the RNG state, as the Trainer allows

    for _, path in checkpoint_dirs(output_dir):
        if incompleteness(path) is not None:
            continue
        json.loads((path / "trainer_state.json").read_text())
        load_file(path / "adapter_model.safetensors")
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            with safe_globals():
                torch.load(path / name, weights_only=True)


def kill_and_resume(root: Path, arguments: list[str], expected: dict[int, float]) -> None:
    config = run_config(root)
    killed = crash_run(config, *arguments)
    assert killed.returncode == -9, f"not killed (exit {killed.returncode}): {killed.stderr[-2000:]}"
    assert_trusted_checkpoints_load(root / "out")
    trusted = latest_checkpoint(root / "out")
    resumed = crash_run(config)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    if trusted is not None:
        assert f"Resuming from {trusted}" in resumed.stderr
    got = logged_losses(root / "out")
    assert sorted(got) == sorted(expected)
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, abs=1e-6), (step, got, expected)
    assert incompleteness(root / "out", FINAL_MANIFEST) is None
    assert [p.name for _, p in checkpoint_dirs(root / "out")] == [f"checkpoint-{MAX_STEPS}"]


CI_POINTS = ("checkpoint", "cache", "tokenization", "final model", "step")


@pytest.mark.parametrize("category", CI_POINTS)
def test_a_run_killed_anywhere_resumes_to_the_same_losses(tmp_path, reference, category):
    expected, events = reference
    points = [p for p in all_kill_points(events) if p[0].startswith(category)]
    label, arguments = random.Random(SEED).choice(points)
    kill_and_resume(tmp_path / "run", arguments, expected)


@pytest.mark.slow
def test_every_kill_point_resumes_to_the_same_losses(tmp_path, reference):
    expected, events = reference
    points = all_kill_points(events)
    assert len(points) >= 20
    failures = []
    for number, (label, arguments) in enumerate(points):
        try:
            kill_and_resume(tmp_path / f"run-{number}", arguments, expected)
        except AssertionError as exc:
            failures.append(f"{label}: {str(exc)[:300]}")
    print(f"{len(points) - len(failures)} of {len(points)} kill points resumed to the reference losses")
    assert not failures, "\n".join(failures)
