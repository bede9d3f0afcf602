"""One `output_dir`, one run: manifests carry content hashes and the run's identity, a run never mixes its outputs
with another run's, the use commands load the current output, and a run that stops being finite stops with exit 3,
keeping its last good checkpoint and reporting no NaN as progress."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.storage import (
    CHECKPOINT_MANIFEST,
    FINAL_MANIFEST,
    checkpoint_dirs,
    content_mismatch,
    incompleteness,
    manifest_run,
)
from hellbender.train.loss_watchdog import DIVERGED_EXIT_CODE
from hellbender.train.run import train
from hellbender.train.run_identity import RUN_FILE, OutputDirTakenOver
from hellbender.use.trained import NotATrainedModel, find_trained
from tests.helpers import base_config, logged_losses, trainer_state


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> dict:
    """A 4-step LoRA run that saved at steps 2 and 4."""
    cfg = base_config(tmp_path_factory.mktemp("lora"), adapter="lora", max_steps=4, save_steps=2)
    train(validate_config(cfg))
    return cfg


def copy_run(cfg: dict, tmp_path: Path, **overrides) -> dict:
    out = tmp_path / "out"
    shutil.copytree(cfg["output_dir"], out)
    return {**cfg, "output_dir": str(out), **overrides}


def test_manifests_carry_hashes_and_one_run_identity(lora_run):
    out = Path(lora_run["output_dir"])
    runs = {manifest_run(path)["run_id"] for _, path in checkpoint_dirs(out)}
    runs.add(manifest_run(out, FINAL_MANIFEST)["run_id"])
    assert runs == {json.loads((out / RUN_FILE).read_text())["run_id"]}  # one run wrote all of it
    entry = json.loads((out / "checkpoint-2" / CHECKPOINT_MANIFEST).read_text())["files"]["adapter_model.safetensors"]
    assert set(entry) == {"size", "sha256_chunks"} and len(entry["sha256_chunks"]) == 64
    assert manifest_run(out, FINAL_MANIFEST)["defines"]["lora_r"] == lora_run.get("lora_r", 8)


def test_a_same_size_edit_is_caught_before_resume_and_before_use(tmp_path, lora_run):
    cfg = copy_run(lora_run, tmp_path, auto_resume_from_checkpoints=True, max_steps=6)
    out = Path(cfg["output_dir"])
    weights = out / "checkpoint-4" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same length: the size check alone trusts it
    weights.write_bytes(bytes(data))
    assert incompleteness(out / "checkpoint-4") is None
    assert "adapter_model.safetensors is not the file that was saved" in content_mismatch(out / "checkpoint-4")
    before = json.loads((out / RUN_FILE).read_text())
    with pytest.raises(ConfigError, match=r"checkpoint-4`, was changed after it was saved.*Delete that checkpoint"):
        train(validate_config(cfg))
    assert json.loads((out / RUN_FILE).read_text()) == before  # refused before anything was written
    with pytest.raises(NotATrainedModel, match="was changed after hellbender saved it"):
        find_trained(validate_config(cfg), out / "checkpoint-4", "--model")


def test_resuming_may_change_max_steps_but_not_the_keys_that_define_the_run(tmp_path, lora_run):
    cfg = copy_run(lora_run, tmp_path, auto_resume_from_checkpoints=True)
    out = Path(cfg["output_dir"])
    run_id = json.loads((out / RUN_FILE).read_text())["run_id"]
    for key, value in (("lora_r", 16), ("base_model", "hellbender/tiny-qwen2-vl"), ("adapter", None)):
        with pytest.raises(ConfigError, match=rf"belongs to another run \(run {run_id}\): it was trained with `{key}"):
            train(validate_config({**cfg, key: value}))
    train(validate_config({**cfg, "max_steps": 6, "learning_rate": 1e-3}))  # the same run, continued
    assert sorted(logged_losses(out)) == [1, 2, 3, 4, 5, 6]
    assert {manifest_run(path)["run_id"] for _, path in checkpoint_dirs(out)} == {run_id}
    assert manifest_run(out, FINAL_MANIFEST)["run_id"] == run_id


def test_a_new_run_refuses_an_output_dir_holding_another_runs_outputs(tmp_path, lora_run):
    cfg = copy_run(lora_run, tmp_path)
    out = Path(cfg["output_dir"])
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(ConfigError, match=r"holds outputs of another run: checkpoint-2, checkpoint-4, the final model"):
        train(validate_config(cfg))  # the same config, without resuming: a second run
    with pytest.raises(ConfigError, match=r"That run was trained with `adapter: lora` there, `adapter: null` here"):
        train(validate_config({**cfg, "adapter": None}))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_a_run_stops_when_another_run_claims_its_output_dir(tmp_path):
    class Intruder(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:  # a second run started in the same directory
                (Path(args.output_dir) / RUN_FILE).write_text(json.dumps({"run_id": "intruder"}))

    cfg = base_config(tmp_path, max_steps=6, save_steps=2)
    with pytest.raises(OutputDirTakenOver, match="was claimed by another run \\(intruder\\)"):
        train(validate_config(cfg), callbacks=[Intruder()])
    out = Path(cfg["output_dir"])
    assert [p.name for _, p in checkpoint_dirs(out)] == ["checkpoint-2"]  # nothing written after the takeover
    assert not (out / FINAL_MANIFEST).exists()


def test_resuming_from_an_older_checkpoint_rewrites_the_newer_ones_whole(tmp_path, lora_run):
    cfg = copy_run(lora_run, tmp_path, max_steps=4)
    out = Path(cfg["output_dir"])
    (out / "checkpoint-4" / "leftover.bin").write_bytes(b"x")  # a file the new checkpoint-4 does not write
    train(validate_config({**cfg, "resume_from_checkpoint": str(out / "checkpoint-2")}))
    assert not (out / "checkpoint-4" / "leftover.bin").exists()
    assert content_mismatch(out / "checkpoint-4") is None


def test_a_full_fine_tune_supersedes_an_adapter_left_in_output_dir(tmp_path, lora_run):
    """An adapter whose run left only its files (its manifests and checkpoints deleted) is not taken for the output
    of the full fine-tune that follows in the same directory."""
    cfg = copy_run(lora_run, tmp_path, adapter=None, max_steps=2)
    out = Path(cfg["output_dir"])
    for _, path in checkpoint_dirs(out):
        shutil.rmtree(path)
    (out / FINAL_MANIFEST).unlink()
    assert (out / "adapter_model.safetensors").is_file()
    train(validate_config(cfg))
    assert not (out / "adapter_model.safetensors").exists() and not (out / "adapter_config.json").exists()
    trained = find_trained(validate_config(cfg), None, "--model")
    assert not trained.is_adapter and trained.step == 2
    # A stray adapter file put back beside it is not in the final manifest, so the use commands ignore it.
    shutil.copy(Path(lora_run["output_dir"]) / "adapter_config.json", out / "adapter_config.json")
    assert not find_trained(validate_config(cfg), None, "--model").is_adapter


# ---------------------------------------------------------------------------------------------- divergence


class PoisonWeights(TrainerCallback):
    """Sets one trainable weight to `value` at the start of step `step` (1-based)."""

    def __init__(self, step: int, value: float, when: str = "begin") -> None:
        self.step, self.value, self.when = step, value, when

    def _poison(self, model):
        with torch.no_grad():
            next(p for p in model.parameters() if p.requires_grad).fill_(self.value)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.when == "begin" and state.global_step == self.step - 1:
            self._poison(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.when == "end" and state.global_step == self.step:
            self._poison(model)


@pytest.mark.parametrize(
    ("poison", "stopped_at", "what"),
    [
        (PoisonWeights(3, float("nan")), 3, "loss and gradient norm"),
        (PoisonWeights(4, float("inf"), when="end"), 4, "weights"),  # finite loss, then a save with inf weights
    ],
    ids=["nan loss", "inf weights at a save"],
)
def test_a_diverged_run_stops_with_exit_3_and_keeps_its_last_good_checkpoint(tmp_path, poison, stopped_at, what):
    cfg = base_config(tmp_path, max_steps=8, save_steps=2, save_total_limit=1)
    metrics = train(validate_config(cfg), callbacks=[poison])
    out = Path(cfg["output_dir"])
    assert metrics["exit_code"] == DIVERGED_EXIT_CODE
    assert [p.name for _, p in checkpoint_dirs(out)] == ["checkpoint-2"]  # rotation kept the last good one
    assert not (out / FINAL_MANIFEST).exists()
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    report = (out / "report" / "report.md").read_text()
    assert f"**Stopped: training diverged**. Training diverged at step {stopped_at}: the {what}" in report
    assert "checkpoint-2` (the newest checkpoint, saved with finite weights) is kept" in report
    assert re.search(r"\b(nan|inf)\b", report.split("## Config")[0]) is None  # no non-finite number shown
    assert "train_loss" not in metrics  # the Trainer's mean would count the unlogged step
    # The last good checkpoint resumes; with the poison gone, the run finishes with finite losses only.
    train(validate_config({**cfg, "auto_resume_from_checkpoints": True}))
    losses = logged_losses(out)
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
    assert all(math.isfinite(e.get("grad_norm", 0.0)) for e in trainer_state(out)["log_history"])


class StepsRun(TrainerCallback):
    """The optimizer steps that ran (their ends), and those whose loss was logged."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.logged: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in (logs or {}):
            self.logged.append(state.global_step)


@pytest.mark.parametrize(
    ("poisoned", "last_run"),
    [(2, 3), (3, 4)],
    ids=["found at the next ordinary step", "found before the next step's log and save"],
)
def test_a_step_that_neither_logs_nor_saves_is_checked_at_most_one_step_late(tmp_path, poisoned, last_run):
    """Logs and saves at steps 1 and 4 only: an ordinary step's flags are read at the next step's end (so the host
    never waits for the GPU there), and a log or save waits for its own. The NaN step is named, training stops by the
    next step's end, and no checkpoint or log comes after it."""
    cfg = base_config(tmp_path, max_steps=8, logging_steps=4, save_steps=4)
    ran = StepsRun()
    metrics = train(validate_config(cfg), callbacks=[PoisonWeights(poisoned, float("nan")), ran])
    out = Path(cfg["output_dir"])
    assert metrics["exit_code"] == DIVERGED_EXIT_CODE
    assert ran.steps == list(range(1, last_run + 1))
    assert checkpoint_dirs(out) == [] and ran.logged == [1]
    report = (out / "report" / "report.md").read_text()
    assert f"Training diverged at step {poisoned}: the loss and gradient norm" in report
    assert "no checkpoint had been saved yet" in report


def test_hellbender_train_exits_3_on_divergence_with_one_paragraph(tmp_path, caplog):
    """The real command: an fp32 run with a learning rate that overflows the weights."""
    import yaml
    from typer.testing import CliRunner

    from hellbender.cli import app

    cfg = base_config(tmp_path, max_steps=4, learning_rate=1e30)
    (tmp_path / "config.yml").write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["train", str(tmp_path / "config.yml")])
    assert result.exit_code == DIVERGED_EXIT_CODE, result.output[-2000:]
    assert "Traceback" not in result.output and "loss 6.2" in result.output  # step 1 is logged, step 2 is not
    assert "step 2/4  loss" not in result.output
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith("Training diverged at step 2: the loss")
    assert not (Path(cfg["output_dir"]) / FINAL_MANIFEST).exists()
