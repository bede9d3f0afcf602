"""`use_ray: true`: two Ray Train workers (DDP over gloo on CPU) train like one process with the same global batch,
rank 0 alone saves, and a hellbender error inside a worker reaches the user as its one paragraph."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from hellbender.cli import app
from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.plan.allocator import ALLOCATOR_VARIABLES
from hellbender.train import ray_launch
from hellbender.train.run import train
from tests.conftest import REPO
from tests.helpers import base_config, final_weights, logged_losses

COMMON = dict(adapter="lora", lora_target_linear=True, max_steps=4, lora_dropout=0.0, save_steps=2)


@pytest.fixture(scope="module")
def ray_cluster():
    """A small local Ray cluster for this module: 2 CPUs (one per worker), a 100 MiB object store, no dashboard,
    no usage report. Workers inherit this environment, so each trains on one thread. Without Ray installed the
    tests that need a cluster are skipped; the others (refusals, the missing-Ray message) still run."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        env.delenv("RAY_ADDRESS", raising=False)
        for name in ALLOCATOR_VARIABLES:  # an earlier run in this process set the default: workers inherit none
            env.delenv(name, raising=False)
        ray.init(address="local", num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False)
        try:
            yield
        finally:
            ray.shutdown()


def write_audit_callback(output_dir: Path, audit_dir: Path):
    """A callback that, from the Trainer's creation on, records in `audit_dir/rank-N.jsonl` each file or tree the
    worker writes, renames or removes under `output_dir` (Python's audit events). Defined in a function, so that
    Ray pickles the class by value and the workers need not import this test module."""
    from transformers import TrainerCallback

    class FileWriteAudit(TrainerCallback):
        def on_init_end(self, args, state, control, **kwargs):
            root, log = str(output_dir), audit_dir / f"rank-{os.environ['RANK']}.jsonl"

            def hook(event: str, event_args: tuple) -> None:
                if event == "open" and isinstance(event_args[0], (str, os.PathLike)):
                    path, mode, flags = event_args
                    writes = any(c in mode for c in "wax+") if mode else bool(flags & (os.O_WRONLY | os.O_RDWR))
                elif event == "os.rename":  # os.rename and os.replace; the destination is what gets written
                    path, writes = event_args[1], True
                elif event in ("os.remove", "shutil.rmtree"):
                    path, writes = event_args[0], True
                else:
                    return
                if not writes or not isinstance(path, (str, os.PathLike)):
                    return
                path = os.path.abspath(path)  # the config's paths are relative
                if path.startswith(root + os.sep):
                    with open(log, "a") as out:  # outside output_dir: not recorded
                        out.write(json.dumps([event, os.path.relpath(path, root)]) + "\n")

            sys.addaudithook(hook)  # for the worker's life: Ray ends the worker process after the run

    return FileWriteAudit()


def allocator_record_callback(record_dir: Path):
    """A callback that writes the allocator variables each worker's process started with to `record_dir/rank-N.json`
    (defined in a function: Ray pickles it by value)."""
    from transformers import TrainerCallback

    from hellbender.plan.allocator import ALLOCATOR_VARIABLES as variables

    class AllocatorRecord(TrainerCallback):
        def on_init_end(self, args, state, control, **kwargs):
            seen = {name: os.environ.get(name) for name in variables}
            (record_dir / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(seen))

    return AllocatorRecord()


def audited(audit_dir: Path, rank: int) -> list[list[str]]:
    log = audit_dir / f"rank-{rank}.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_two_ray_workers_train_like_one_process_with_the_same_global_batch(tmp_path, ray_cluster, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the Ray run's paths are relative: workers must read them from this directory
    single = validate_config(base_config(tmp_path / "single", micro_batch_size=4, **COMMON))
    expected_metrics = train(single)
    raw = base_config(Path("ray"), micro_batch_size=2, use_ray=True, ray_num_workers=2, **COMMON)
    cfg = validate_config(raw)
    assert cfg.output_dir == "ray/out"
    out, audit_dir = tmp_path / "ray" / "out", tmp_path / "audit"
    audit_dir.mkdir()

    # Set after the cluster started, so its workers could not inherit it: Ray must hand it to them (the
    # one-process run above set hellbender's default in this process).
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:256")

    metrics = ray_launch.train_with_ray(
        cfg, [write_audit_callback(out, audit_dir), allocator_record_callback(audit_dir)]
    )

    # Rank 0's metrics come back to the caller, as from a one-process run.
    assert metrics["input_tokens"] == expected_metrics["input_tokens"] > 0
    assert metrics["trained_tokens"] == expected_metrics["trained_tokens"] > 0
    assert metrics["train_loss"] == pytest.approx(expected_metrics["train_loss"], abs=1e-5)
    expected = logged_losses(single.output_dir)
    assert sorted(logged_losses(out)) == [1, 2, 3, 4]
    for step, loss in expected.items():
        assert logged_losses(out)[step] == pytest.approx(loss, abs=1e-5), (step, logged_losses(out))
    a, b = final_weights(single.output_dir), final_weights(out)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-4)

    # The final model is in output_dir once, complete; checkpoints were written once each; Ray Train's own
    # records are in output_dir/ray/hellbender and hold no model.
    manifest = json.loads((out / "hellbender_model.json").read_text())
    assert "adapter_model.safetensors" in manifest["files"]
    assert all((out / name).stat().st_size == entry["size"] for name, entry in manifest["files"].items())
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not list(out.glob(".final-model-staging*"))
    assert (out / "ray" / "hellbender").is_dir()
    assert not [p for p in (out / "ray").rglob("*") if p.suffix in (".safetensors", ".pt", ".bin", ".pth")]

    # Rank 0 alone wrote the model, checkpoints, config and report; rank 1 wrote nothing there but its own RNG
    # state, which every process saves into a checkpoint.
    rank0 = {path for _, path in audited(audit_dir, 0)}
    assert {"hellbender_model.json", "checkpoint-4/hellbender_checkpoint.json", "hellbender_config.yml"} <= rank0
    assert "report/report.md" in rank0
    rank1 = [path for _, path in audited(audit_dir, 1)]
    assert all(re.fullmatch(r"checkpoint-\d+/rng_state_1\.pth", path) for path in rank1), rank1

    # Each worker ran with the driver's allocator settings, not with a default of its own.
    for rank in (0, 1):
        seen = json.loads((audit_dir / f"rank-{rank}.json").read_text())
        assert seen == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:256", "PYTORCH_CUDA_ALLOC_CONF": None}, (rank, seen)


def bad_data_config(tmp_path: Path, **overrides) -> Path:
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}] * 8
    rows[3] = {"text": "a row without messages"}
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    raw = base_config(tmp_path, micro_batch_size=2, use_ray=True, ray_num_workers=2, **COMMON, **overrides)
    raw["datasets"] = [{"path": str(data), "type": "chat_template"}]
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(raw))
    return config


def test_a_hellbender_error_in_a_worker_reaches_the_cli_as_its_paragraph(tmp_path, ray_cluster, monkeypatch):
    monkeypatch.delenv("HELLBENDER_DEBUG", raising=False)
    config = bad_data_config(tmp_path, ray_run_name="bad-data")

    result = CliRunner().invoke(app, ["train", str(config)])

    detail = f"exit {result.exit_code}, exception {result.exception!r}\n{result.output}"
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), detail
    message = f"Dataset datasets[0] `{tmp_path / 'bad.jsonl'}`, row 3: column `messages` must be a non-empty list"
    assert f"error: {message}" in result.stderr, detail
    # Ray forwards its workers' and controller's logs, each line led by the process (in colour); the CLI's own
    # output holds no traceback.
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in result.output.splitlines()]
    own_lines = [line for line in plain if not re.match(r"\(\w+ pid=\d+", line)]
    assert not [line for line in own_lines if "Traceback" in line], detail
    assert (tmp_path / "out" / "ray" / "bad-data").is_dir()  # it ran under Ray Train, under its run name


def test_use_ray_refuses_a_second_launcher(tmp_path, monkeypatch):
    config = bad_data_config(tmp_path)
    result = CliRunner().invoke(app, ["train", str(config), "--nproc", "2"])
    assert result.exit_code == 2 and "pick one launcher" in result.stderr, result.output
    assert "`ray_num_workers`" in result.stderr
    monkeypatch.setenv("WORLD_SIZE", "2")  # inside a process that torchrun started
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 2 and "WORLD_SIZE=2" in result.stderr, result.output
    assert not (tmp_path / "out").exists()


def test_a_local_cluster_too_small_is_refused_and_a_remote_one_warns(caplog):
    with pytest.raises(ConfigError, match=r"`ray_num_workers: 3` asks for 3 CPUs .* has 2\. Lower"):
        ray_launch._check_capacity(3, False, {"CPU": 2.0}, local=True)
    with pytest.raises(ConfigError, match="asks for 2 GPUs"):
        ray_launch._check_capacity(2, True, {"CPU": 16.0, "GPU": 1.0}, local=True)
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        ray_launch._check_capacity(3, False, {"CPU": 2.0}, local=False)  # autoscaling may add nodes
    assert "Ray Train waits until it has them" in caplog.text
    ray_launch._check_capacity(2, False, {"CPU": 2.0}, local=True)


def test_use_ray_without_ray_installed_names_the_extra(tmp_path):
    raw = base_config(tmp_path, use_ray=True, ray_num_workers=2)
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(raw))
    done = subprocess.run(
        [sys.executable, "-m", "tests.without_ray", "train", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: `use_ray: true` needs Ray Train, which is not installed (`ray` is missing)" in done.stderr
    assert "pip install 'hellbender[ray]'" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "out").exists()
