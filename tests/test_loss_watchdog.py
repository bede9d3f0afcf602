"""`loss_watchdog_threshold`: a run whose loss stays above the threshold stops with a checkpoint, no final model and
its own exit code; a run below it is untouched."""

from __future__ import annotations

import logging

import yaml

from hellbender.config import validate_config
from hellbender.storage import FINAL_MANIFEST, checkpoint_dirs, incompleteness
from hellbender.train.loss_watchdog import DIVERGED_EXIT_CODE
from hellbender.train.run import train
from tests.helpers import base_config, invoke, logged_losses


def test_a_loss_above_the_threshold_stops_the_run_with_a_checkpoint(tmp_path, caplog):
    cfg = validate_config(
        base_config(tmp_path, max_steps=6, save_steps=100, loss_watchdog_threshold=0.01, loss_watchdog_patience=2)
    )
    with caplog.at_level(logging.ERROR, logger="hellbender"):
        metrics = train(cfg)
    out = tmp_path / "out"
    assert metrics["exit_code"] == DIVERGED_EXIT_CODE
    assert sorted(logged_losses(out / "checkpoint-2")) == [1, 2]  # stopped at the second high loss in a row
    assert [p.name for _, p in checkpoint_dirs(out)] == ["checkpoint-2"]
    assert incompleteness(out / "checkpoint-2") is None
    assert not (out / FINAL_MANIFEST).exists()
    assert "stayed above `loss_watchdog_threshold: 0.01` for 2 logged steps in a row" in caplog.text
    assert "saved checkpoint-2 and wrote no final model" in caplog.text


def test_a_loss_below_the_threshold_trains_to_the_end(tmp_path):
    cfg = validate_config(base_config(tmp_path, max_steps=3, loss_watchdog_threshold=1000.0))
    assert "exit_code" not in train(cfg)
    assert (tmp_path / "out" / FINAL_MANIFEST).is_file()


def test_the_command_line_exits_with_the_watchdogs_code(tmp_path):
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(base_config(tmp_path, max_steps=4, loss_watchdog_threshold=0.01)))
    result = invoke("train", config)
    assert result.exit_code == DIVERGED_EXIT_CODE, result.output
    assert "done:" not in result.output
    assert not (tmp_path / "out" / FINAL_MANIFEST).exists()
