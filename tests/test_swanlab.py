"""SwanLab reporting (Axolotl's SwanLab plugin keys): the resolved config, the TrainingArguments and environment a
run gets, and what transformers' SwanLab callback passes to `swanlab.init` from them. SwanLab itself is not
installed here: a stand-in module records the calls."""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types

import pytest

from hellbender.config import validate_config
from hellbender.errors import ConfigError, EnvironmentProblem
from tests.helpers import base_config

PLUGIN = "axolotl.integrations.swanlab.SwanLabPlugin"
SWANLAB_KEYS = {
    "swanlab_project": "lora-profiling",
    "swanlab_experiment_name": "first-try",
    "swanlab_description": "LoRA with profiling",
    "swanlab_workspace": "ml-team",
    "swanlab_mode": "offline",
}


@pytest.fixture
def fake_swanlab(monkeypatch):
    """A `swanlab` module that records `init` and `log`, and an environment the run may change freely."""
    module = types.ModuleType("swanlab")
    module.__spec__ = importlib.machinery.ModuleSpec("swanlab", None)
    module.calls = []
    module.run = None
    module.config = {}

    def init(**kwargs):
        module.calls.append(("init", kwargs))
        module.run = object()

    module.init = init
    module.get_run = lambda: module.run
    module.log = lambda data, step=None: module.calls.append(("log", data))
    monkeypatch.setitem(sys.modules, "swanlab", module)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for variable in ("SWANLAB_PROJECT", "SWANLAB_RUN_ID", "SWANLAB_RESUME", "SWANLAB_LOG_MODEL"):
        os.environ.pop(variable, None)
    return module


def test_the_plugin_and_a_project_turn_on_swanlab_reporting(tmp_path):
    cfg = validate_config(base_config(tmp_path, plugins=[PLUGIN], **SWANLAB_KEYS))
    assert cfg.use_swanlab is True
    assert cfg.report_targets == ["swanlab"]
    for key, value in SWANLAB_KEYS.items():
        assert getattr(cfg, key) == value
    # a project alone turns it on too (as Axolotl's plugin does); `use_swanlab: false` keeps it off
    assert validate_config(base_config(tmp_path, swanlab_project="p")).report_targets == ["swanlab"]
    off = validate_config(base_config(tmp_path, plugins=[PLUGIN], use_swanlab=False, swanlab_project="p"))
    assert off.use_swanlab is False and off.report_targets == []


def test_swanlab_beside_other_trackers_adds_itself(tmp_path):
    cfg = validate_config(base_config(tmp_path, use_swanlab=True, swanlab_project="p", report_to="tensorboard"))
    assert cfg.report_targets == ["tensorboard", "swanlab"]


def test_swanlab_keys_reach_the_run_through_run_name_and_the_environment(tmp_path, fake_swanlab):
    from transformers.integrations.integration_utils import SwanLabCallback
    from transformers.trainer_callback import TrainerState

    from hellbender.train.arguments import tracker_environment, training_arguments
    from hellbender.train.schedule import plan_schedule

    cfg = validate_config(base_config(tmp_path, plugins=[PLUGIN], **SWANLAB_KEYS))
    assert tracker_environment(cfg) == {
        "SWANLAB_PROJECT": "lora-profiling",
        "SWANLAB_WORKSPACE": "ml-team",
        "SWANLAB_DESCRIPTION": "LoRA with profiling",
        "SWANLAB_MODE": "offline",
    }
    args = training_arguments(cfg, plan_schedule(cfg, 100, 1), has_eval=False)
    assert args.report_to == ["swanlab"]
    assert args.run_name == "first-try"
    assert os.environ["SWANLAB_MODE"] == "offline"

    # transformers' own callback, as the Trainer starts it, opens the experiment with the project and name
    state = TrainerState()
    state.is_world_process_zero = True
    SwanLabCallback().setup(args, state, model=None)
    init_calls = [kwargs for name, kwargs in fake_swanlab.calls if name == "init"]
    assert init_calls == [{"experiment_name": "first-try", "project": "lora-profiling"}]


def test_swanlab_keys_stay_out_of_the_environment_when_swanlab_is_off(tmp_path):
    from hellbender.train.arguments import tracker_environment

    cfg = validate_config(base_config(tmp_path, use_swanlab=False, **SWANLAB_KEYS))
    assert tracker_environment(cfg) == {}
    assert cfg.report_targets == []


def test_the_wandb_name_names_the_swanlab_experiment_too(tmp_path):
    from hellbender.config.tracking_checks import run_name

    cfg = validate_config(base_config(tmp_path, swanlab_project="p", wandb_name="shared"))
    assert run_name(cfg) == "shared"
    same = validate_config(base_config(tmp_path, swanlab_project="p", wandb_name="x", swanlab_experiment_name="x"))
    assert run_name(same) == "x"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"plugins": [PLUGIN]}, rf"`plugins` lists `{PLUGIN}`, but `swanlab_project` is not set"),
        ({"use_swanlab": True}, r"`use_swanlab` is true, but `swanlab_project` is not set"),
        (
            {"swanlab_project": "p", "wandb_name": "a", "swanlab_experiment_name": "b"},
            r"`wandb_name: a` and `swanlab_experiment_name: b` name the run differently",
        ),
        ({"swanlab_project": "p", "swanlab_mode": "online"}, r"swanlab_mode"),
        ({"swanlab_project": "p", "swanlab_log_model": True}, r"does not upload models"),
        ({"swanlab_project": " "}, r"`swanlab_project`.*is empty"),
    ],
)
def test_swanlab_settings_that_cannot_work_are_refused(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, **keys))


def test_swanlab_without_the_package_is_refused_at_train_time_with_the_pip_command(tmp_path, monkeypatch):
    import importlib.util

    from hellbender.train.arguments import report_targets

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "swanlab" else real(name, *a))
    cfg = validate_config(base_config(tmp_path, plugins=[PLUGIN], swanlab_project="p"))
    with pytest.raises(EnvironmentProblem, match=r"`use_swanlab` is set, but the `swanlab` package is not installed.*"
                       r"`pip install swanlab`\), or set `use_swanlab: false`"):  # fmt: skip
        report_targets(cfg)


def test_completion_tables_belong_to_preference_training(tmp_path):
    with pytest.raises(
        ConfigError, match=r"`swanlab_log_completions` is not supported yet: it belongs to more preference tuning"
    ):
        validate_config(base_config(tmp_path, swanlab_project="p", swanlab_log_completions=True))
    # off, the completion-table keys ask for nothing (Axolotl's non-preference example sets it false)
    cfg = validate_config(
        base_config(
            tmp_path,
            swanlab_project="p",
            swanlab_log_completions=False,
            swanlab_completion_log_interval=100,
            swanlab_completion_max_buffer=128,
        )
    )
    assert cfg.use_swanlab
