"""`save_only_model`, `early_stopping_patience` and `accelerator_config` on the real training path (tiny runs), and
their refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.train.arguments import accelerator_arguments, training_arguments
from hellbender.train.run import train
from hellbender.train.schedule import plan_schedule
from tests.helpers import base_config, trainer_state


def test_model_only_checkpoints_hold_no_optimizer_and_refuse_to_resume(tmp_path):
    cfg = validate_config(base_config(tmp_path, max_steps=2, save_steps=1, save_only_model=True))
    train(cfg)
    checkpoint = Path(cfg.output_dir) / "checkpoint-2"
    names = {p.name for p in checkpoint.iterdir()}
    assert "model.safetensors" in names
    assert not names & {"optimizer.pt", "scheduler.pt", "rng_state.pth"}, names
    assert json.loads((checkpoint / "hellbender_checkpoint.json").read_text())["model_only"] is True

    with pytest.raises(ConfigError, match=r"`resume_from_checkpoint`: `.*checkpoint-2` was written with `save_only_m"):
        train(validate_config(base_config(tmp_path, max_steps=4, resume_from_checkpoint=str(checkpoint))))
    with pytest.raises(ConfigError, match="the newest checkpoint of `output_dir`.*cannot continue exactly from it"):
        train(validate_config(base_config(tmp_path, max_steps=4, auto_resume_from_checkpoints=True)))


def test_full_checkpoints_still_resume(tmp_path):
    cfg = validate_config(base_config(tmp_path, max_steps=1, save_steps=1))
    train(cfg)
    manifest = json.loads((Path(cfg.output_dir) / "checkpoint-1" / "hellbender_checkpoint.json").read_text())
    assert "model_only" not in manifest
    train(validate_config(base_config(tmp_path, max_steps=2, auto_resume_from_checkpoints=True)))
    assert trainer_state(cfg.output_dir)["global_step"] == 2


def test_early_stopping_stops_when_the_eval_loss_cannot_improve_and_keeps_the_best_checkpoint(tmp_path):
    # A learning rate far below float32's resolution of the weights: no weight moves, the evaluation loss stays the
    # same, and an equal loss is no improvement.
    cfg = validate_config(
        base_config(
            tmp_path,
            learning_rate=1e-20,
            max_steps=20,
            val_set_size=0.05,
            eval_steps=1,
            save_steps=1,
            save_total_limit=1,
            early_stopping_patience=2,
        )
    )
    train(cfg)
    state = trainer_state(cfg.output_dir)
    evals = [e["eval_loss"] for e in state["log_history"] if "eval_loss" in e]
    assert state["global_step"] == 3, state["global_step"]  # the best at step 1, then two evaluations without gain
    assert len(evals) == 3 and len(set(evals)) == 1, evals
    assert state["best_model_checkpoint"].endswith("checkpoint-1")
    # rotation (`save_total_limit: 1`) never deletes the best checkpoint, which becomes the final model
    kept = sorted(p.name for p in Path(cfg.output_dir).glob("checkpoint-*"))
    assert kept == ["checkpoint-1", "checkpoint-3"], kept


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"early_stopping_patience": 2}, "`early_stopping_patience` stops training when the evaluation loss"),
        (
            {"early_stopping_patience": 2, "val_set_size": 0.1, "save_steps": 3, "eval_steps": 2},
            "`save_steps` \\(3\\) must be a multiple of `eval_steps` \\(2\\)",
        ),
        ({"save_only_model": True, "auto_resume_from_checkpoints": True}, "`auto_resume_from_checkpoints: true`"),
        ({"accelerator_config": {"split_batch": True}}, "`split_batch` is not a field of transformers' Accelera"),
        (
            {"accelerator_config": {"gradient_accumulation_kwargs": {"num_steps": 4}}},
            "`gradient_accumulation_kwargs.num_steps` cannot be honoured",
        ),
        ({"accelerator_config": {"use_seedable_sampler": False}}, "`use_seedable_sampler: false` cannot be honoured"),
    ],
)
def test_training_options_that_cannot_work_are_refused(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, **keys))


def test_early_stopping_refuses_intervals_from_the_data_that_do_not_line_up(tmp_path):
    cfg = validate_config(
        base_config(
            tmp_path, max_steps=None, val_set_size=0.1, saves_per_epoch=1, evals_per_epoch=4, early_stopping_patience=1
        )
    )
    with pytest.raises(ConfigError, match="would save every 11 steps and evaluate every 2"):
        plan_schedule(cfg, 44)  # 11 steps per epoch of 4 rows


def test_accelerator_config_is_passed_to_the_trainer(tmp_path):
    cfg = validate_config(
        base_config(tmp_path, accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}})
    )
    args = training_arguments(cfg, plan_schedule(cfg, 100), has_eval=False)
    assert args.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}
    assert args.accelerator_config.even_batches is True and args.accelerator_config.dispatch_batches is None
    plain = validate_config(base_config(tmp_path))
    assert training_arguments(plain, plan_schedule(plain, 100), has_eval=False).accelerator_config.to_dict() == (
        args.accelerator_config.to_dict() | {"gradient_accumulation_kwargs": None}
    )


def test_pinned_batches_are_copied_to_the_gpu_without_waiting_unless_the_config_says_otherwise(tmp_path):
    plain = validate_config(base_config(tmp_path))
    assert accelerator_arguments(plain, pinned=True) == {"non_blocking": True}
    assert accelerator_arguments(plain, pinned=False) is None  # transformers' defaults
    told = validate_config(base_config(tmp_path, accelerator_config={"non_blocking": False}))
    assert accelerator_arguments(told, pinned=True)["non_blocking"] is False
    args = training_arguments(plain, plan_schedule(plain, 100), has_eval=False)
    assert args.logging_nan_inf_filter is False  # it reads each micro-batch's loss: the divergence check stops instead


@pytest.mark.parametrize(("keys", "expected"), [({}, None), ({"tf32": False}, False)])
def test_tf32_false_is_said_to_the_trainer_and_left_out_leaves_it_to_transformers(tmp_path, keys, expected):
    """transformers turns TF32 on for the process when the Trainer compiles the whole model in bf16 unless its
    `tf32` argument is False: a config's `tf32: false` reaches it as False (the GPU test checks the precision)."""
    cfg = validate_config(base_config(tmp_path, **keys))
    assert training_arguments(cfg, plan_schedule(cfg, 100), has_eval=False).tf32 is expected
