"""Several training processes (DDP over gloo on CPU) train like one process with the same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hellbender.config import validate_config
from hellbender.launch import Launch
from hellbender.train.run import train
from tests.helpers import base_config, final_weights, logged_losses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: Path, *args: str, timeout: float = 300, nproc: int = 2, **env: str) -> None:
    """`script ARGS` in `nproc` torchrun processes, with this repository importable; fails the test with their
    output."""
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(free_port()),
            str(script),
            *args,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env},
        timeout=timeout,
        cwd=repo,
    )
    assert done.returncode == 0, why_processes_failed(done.stdout + done.stderr)


# Lines that say why a training process died (a Python error, a C++ exception, a fatal interpreter error); shown
# ahead of the output's tail, which a long log would otherwise cut.
FAILURE_MARKERS = ("Error", "error:", "terminate called", "what():", "Fatal Python", "Traceback", "Signal ")


def why_processes_failed(output: str) -> str:
    reasons = [line for line in output.splitlines() if any(marker in line for marker in FAILURE_MARKERS)]
    return "\n".join(["why:", *reasons[:40], "tail:", output[-6000:]])


def train_in_two_processes(config: Path, timeout: float = 300, **env: str) -> str:
    """`hellbender train CONFIG --nproc 2`, as users launch it (one OpenMP thread each unless `env` says otherwise);
    fails the test with the processes' stderr, else returns it."""
    done = subprocess.run(
        [sys.executable, "-m", "hellbender", "train", str(config), "--nproc", "2", "--master-port", str(free_port())],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        timeout=timeout,
    )
    assert done.returncode == 0, why_processes_failed(done.stderr)
    return done.stderr


def test_two_processes_train_like_one_process_with_the_same_global_batch(tmp_path):
    common = dict(adapter="lora", lora_target_linear=True, max_steps=4, lora_dropout=0.0, save_steps=2)
    single = validate_config(base_config(tmp_path / "single", micro_batch_size=4, **common))
    train(single)
    config = tmp_path / "ddp.yml"
    config.write_text(yaml.safe_dump(base_config(tmp_path / "ddp", micro_batch_size=2, **common)))
    stderr = train_in_two_processes(config)
    ddp_out = tmp_path / "ddp" / "out"
    expected = logged_losses(single.output_dir)
    assert sorted(logged_losses(ddp_out)) == [1, 2, 3, 4]
    for step, loss in expected.items():
        assert logged_losses(ddp_out)[step] == pytest.approx(loss, abs=1e-5), (step, logged_losses(ddp_out))
    a, b = final_weights(single.output_dir), final_weights(ddp_out)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-4)
    # The token counters add up both processes' share.
    single_state, ddp_state = (
        json.loads((Path(d) / "trainer_state.json").read_text()) for d in (single.output_dir, ddp_out)
    )
    assert ddp_state["stateful_callbacks"]["TokenCounter"] == single_state["stateful_callbacks"]["TokenCounter"]
    # One process prepared and saved the data; the other read the cache. Checkpoints were written once.
    assert stderr.count("Saving the dataset (0/1 shards)") == 1, stderr[-3000:]
    assert sorted(p.name for p in ddp_out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_the_launcher_passes_the_torchrun_flags_and_is_not_nested(monkeypatch):
    launch = Launch(nproc=4, nnodes=2, node_rank=1, master_addr="10.0.0.5", master_port=23456)
    command = launch.command(["train", "config.yml", "--set", "seed=3"])
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert {
        "--nproc_per_node=4",
        "--nnodes=2",
        "--node_rank=1",
        "--master_addr=10.0.0.5",
        "--master_port=23456",
    } <= set(command)
    assert command[-6:] == ["-m", "hellbender", "train", "config.yml", "--set", "seed=3"]
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launch.needed and not Launch().needed
    monkeypatch.setenv("LOCAL_RANK", "0")  # already inside a launched process
    assert not launch.needed


def test_a_lone_process_on_a_machine_of_several_gpus_is_given_the_first(monkeypatch):
    """Without it, the Trainer splits every batch over the GPUs with nn.DataParallel (seen on two H200s: packed
    rows' losses off by half again, vision rows' image tokens no longer matching their images)."""
    import torch

    from hellbender.train.distributed import one_gpu_for_one_process

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    notice = one_gpu_for_one_process()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert "trains on GPU 3 only" in notice and "`--nproc 2`" in notice
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    one_gpu_for_one_process()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    # a launched process already has its GPU; one GPU needs nothing
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert one_gpu_for_one_process() is None and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert one_gpu_for_one_process() is None and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_training_arguments_refuse_one_process_on_several_gpus(tmp_path, monkeypatch):
    from transformers import TrainingArguments

    from hellbender.config import validate_config
    from hellbender.errors import EnvironmentProblem
    from hellbender.train.arguments import training_arguments
    from hellbender.train.schedule import plan_schedule

    cfg = validate_config(base_config(tmp_path))
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(EnvironmentProblem, match=r"This process sees 2 GPUs; hellbender trains one process per GPU"):
        training_arguments(cfg, plan_schedule(cfg, 100, 1), has_eval=False)
