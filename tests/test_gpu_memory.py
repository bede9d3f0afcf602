"""The allocator settings a training process runs with (expandable segments unless the user set them), and a step
that runs out of GPU memory ending in one paragraph that names the step and the budget it was planned for."""

from __future__ import annotations

import os

import pytest
import torch
import yaml
from transformers import TrainerCallback
from typer.testing import CliRunner

from hellbender.cli import app
from hellbender.config import validate_config
from hellbender.plan.allocator import (
    ALLOCATOR_VARIABLES,
    allocator_environment,
    allocator_settings,
    set_default_allocator_settings,
    uses_expandable_segments,
)
from hellbender.train.out_of_memory import OutOfGpuMemory
from hellbender.train.run import train
from tests.helpers import base_config


@pytest.fixture
def environ(monkeypatch) -> dict[str, str]:
    """This process's environment without the allocator's variables, restored afterwards."""
    copy = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
    monkeypatch.setattr(os, "environ", copy)
    return copy


def test_the_default_is_expandable_segments_and_a_users_setting_in_either_variable_wins(environ):
    assert allocator_settings() == "expandable_segments:True" and uses_expandable_segments()
    for name in ALLOCATOR_VARIABLES:
        assert not uses_expandable_segments({name: "max_split_size_mb:128"})
        assert not uses_expandable_segments({name: "expandable_segments:False"})
        assert uses_expandable_segments({name: "max_split_size_mb:128, expandable_segments:True"})


def test_the_default_is_set_for_the_process_unless_the_user_set_it(environ):
    assert set_default_allocator_settings()
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert not set_default_allocator_settings()  # set already: the value stays
    environ.clear()
    environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:False"
    assert not set_default_allocator_settings()
    assert environ == {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}


def test_processes_that_do_not_inherit_the_environment_get_the_users_settings_or_the_default(environ):
    assert allocator_environment() == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    users = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128", "PATH": "/bin"}
    assert allocator_environment(users) == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}


def test_training_sets_the_default_before_it_starts(environ, tmp_path):
    train(validate_config(base_config(tmp_path, max_steps=1, memory_watchdog="off")))
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


class RunOutOfMemoryAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


def test_a_step_out_of_memory_is_one_paragraph_naming_the_step(tmp_path):
    cfg = validate_config(base_config(tmp_path, max_steps=3, memory_watchdog="off"))
    with pytest.raises(OutOfGpuMemory, match="at step 2 \\(no `gpu_memory_limit` was planned for;") as error:
        train(cfg, callbacks=[RunOutOfMemoryAt(2)])
    assert "`gradient_checkpointing_layers`" in str(error.value) and "`micro_batch_size`" in str(error.value)
    assert "hellbender plan CONFIG" in str(error.value) and "\n" not in str(error.value)


def test_under_a_limit_the_error_names_it_as_the_user_wrote_it(tmp_path):
    cfg = validate_config(base_config(tmp_path, max_steps=2, memory_watchdog="off", gpu_memory_limit="20GiB"))
    with pytest.raises(OutOfGpuMemory, match="at step 1 \\(the run was planned to fit `gpu_memory_limit: 20GiB`;"):
        train(cfg, callbacks=[RunOutOfMemoryAt(1)])


def test_the_cli_prints_the_paragraph_and_exits_2(tmp_path, monkeypatch):
    """The CLI's one error format, with no traceback."""
    import hellbender.train.run as run

    real_train = run.train
    monkeypatch.setattr(run, "train", lambda cfg: real_train(cfg, callbacks=[RunOutOfMemoryAt(1)]))
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(base_config(tmp_path, max_steps=2, memory_watchdog="off")))
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 2, result.output
    assert "ran out of GPU memory at step 1" in result.output and "Traceback" not in result.output
