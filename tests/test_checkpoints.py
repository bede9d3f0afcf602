"""Checkpoints are complete and trusted or ignored; rotation keeps the newest complete one; SIGTERM / SIGINT save
and stop; the final model is written whole or not at all."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from transformers import TrainerCallback

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.storage import CHECKPOINT_MANIFEST, FINAL_MANIFEST, checkpoint_dirs, incompleteness, latest_checkpoint
from hellbender.train.resume import checkpoint_to_resume
from hellbender.train.run import train
from tests.helpers import base_config, logged_losses


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> dict:
    """A 6-step LoRA run that saved at steps 2, 4 and 6, keeping all three."""
    tmp_path = tmp_path_factory.mktemp("finished")
    cfg = base_config(tmp_path, adapter="lora", max_steps=6, save_steps=2, lora_dropout=0.1)
    train(validate_config(cfg))
    return cfg


def test_every_saved_checkpoint_and_the_final_model_carry_a_manifest(finished_run):
    out = Path(finished_run["output_dir"])
    assert [p.name for _, p in checkpoint_dirs(out)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for _, path in checkpoint_dirs(out):
        listed = json.loads((path / CHECKPOINT_MANIFEST).read_text())["files"]
        assert {"adapter_model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state.pth"} <= set(listed)
        assert incompleteness(path) is None
    final = json.loads((out / FINAL_MANIFEST).read_text())["files"]
    assert {"adapter_model.safetensors", "trainer_state.json"} <= set(final)
    assert incompleteness(out, FINAL_MANIFEST) is None
    assert not (out / ".final-model-staging").exists()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: (p / CHECKPOINT_MANIFEST).unlink(), f"it has no {CHECKPOINT_MANIFEST}"),
        (lambda p: (p / CHECKPOINT_MANIFEST).write_text('{"files": {"a'), f"its {CHECKPOINT_MANIFEST} is unreadable"),
        (lambda p: (p / "optimizer.pt").unlink(), "optimizer.pt is missing"),
        (
            lambda p: (p / "trainer_state.json").write_text("{"),
            "trainer_state.json has 1 bytes where the manifest says",
        ),
    ],
    ids=["no manifest", "torn manifest", "missing file", "truncated file"],
)
def test_a_damaged_checkpoint_is_never_trusted(tmp_path, finished_run, damage, reason):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(finished_run["output_dir"], out)
    damage(out / "checkpoint-6")
    assert reason in incompleteness(out / "checkpoint-6")
    assert latest_checkpoint(out) == out / "checkpoint-4"  # the newest complete one
    explicit = validate_config({**finished_run, "resume_from_checkpoint": str(out / "checkpoint-6")})
    with pytest.raises(
        ConfigError, match=r"checkpoint-6` is not a complete checkpoint: .*auto_resume_from_checkpoints"
    ):
        checkpoint_to_resume(explicit)


def test_auto_resume_skips_and_removes_a_half_written_checkpoint_and_reproduces_the_run(tmp_path, finished_run):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(finished_run["output_dir"], out)
    for name in ("checkpoint-6", FINAL_MANIFEST, "adapter_model.safetensors"):
        target = out / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    (out / "checkpoint-6").mkdir()  # a save killed just after creating its directory
    (out / "checkpoint-6" / "adapter_model.safetensors").write_bytes(b"partial")
    cfg = {**finished_run, "output_dir": str(out), "auto_resume_from_checkpoints": True}
    train(validate_config(cfg))
    assert logged_losses(out) == pytest.approx(logged_losses(finished_run["output_dir"]), abs=1e-6)
    assert incompleteness(out / "checkpoint-6") is None  # written again, completely


def test_save_total_limit_keeps_the_newest_complete_checkpoints(tmp_path):
    cfg = validate_config(base_config(tmp_path, max_steps=5, save_steps=1, save_total_limit=2))
    seen = []

    class Watch(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):  # runs after hellbender's keeper
            seen.append([p.name for _, p in checkpoint_dirs(args.output_dir)])

    train(cfg, callbacks=[Watch()])
    assert seen == [
        ["checkpoint-1"],
        ["checkpoint-1", "checkpoint-2"],
        ["checkpoint-2", "checkpoint-3"],
        ["checkpoint-3", "checkpoint-4"],
        ["checkpoint-4", "checkpoint-5"],
    ]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_a_checkpoint_at_the_end_of_the_step_and_stops(tmp_path, finished_run, signum):
    class SignalDuringStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:  # during step 3
                signal.raise_signal(signum)

    cfg = {**finished_run, "output_dir": str(tmp_path / "out"), "auto_resume_from_checkpoints": True}
    handler_before = signal.getsignal(signum)
    metrics = train(validate_config(cfg), callbacks=[SignalDuringStep()])
    assert signal.getsignal(signum) == handler_before  # put back after training
    out = tmp_path / "out"
    assert metrics["exit_code"] == 128 + signum
    assert [p.name for _, p in checkpoint_dirs(out)] == ["checkpoint-2", "checkpoint-3"]
    assert incompleteness(out / "checkpoint-3") is None
    assert not (out / FINAL_MANIFEST).exists()  # the run is not finished: no final model
    train(validate_config(cfg))
    assert logged_losses(out) == pytest.approx(logged_losses(finished_run["output_dir"]), abs=1e-6)


def test_a_resume_path_that_is_not_a_checkpoint_is_refused_before_any_work(tmp_path, finished_run):
    (tmp_path / "file.txt").write_text("x")
    for path, reason in (
        (tmp_path / "missing", "it does not exist"),
        (tmp_path / "file.txt", "it is not a directory"),
        (tmp_path, f"it has no {CHECKPOINT_MANIFEST}"),
    ):
        cfg = validate_config({**finished_run, "resume_from_checkpoint": str(path)})
        with pytest.raises(ConfigError, match=reason):
            train(cfg)


def test_hellbender_train_preempted_by_sigterm_exits_143_with_a_checkpoint_and_resumes(tmp_path):
    """The real command in its own process, stopped as a preempted machine stops it: SIGTERM mid-run."""
    import os
    import subprocess
    import sys
    import time

    import yaml

    cfg = base_config(tmp_path, max_steps=400, save_steps=2, logging_steps=50, auto_resume_from_checkpoints=True)
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(cfg))
    command = [sys.executable, "-m", "hellbender", "train", str(config)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    out = Path(cfg["output_dir"])
    deadline = time.monotonic() + 120
    while latest_checkpoint(out) is None and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr[-2000:]
    assert "Received SIGTERM: saving a checkpoint at the end of this step" in stderr
    assert "Traceback" not in stderr
    stopped = latest_checkpoint(out)
    step = int(stopped.name.split("-")[1])
    assert 2 <= step < 400 and not (out / FINAL_MANIFEST).exists()
    resumed = subprocess.run(
        [*command, "--set", "max_steps=" + str(step + 2)], capture_output=True, text=True, env=os.environ
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"Resuming from {stopped}" in resumed.stderr
    assert incompleteness(out, FINAL_MANIFEST) is None
