"""`hellbender evaluate`: loss, perplexity and token accuracy over the trained tokens of the evaluation rows, equal
to the Trainer's own evaluation loss at the same step, written as JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets  # noqa: F401 - imported before any CliRunner call (see tests/test_cli_errors.py)
import pytest
import torch
import yaml

from tests.helpers import assert_user_error, invoke

METRIC_KEYS = {"loss", "perplexity", "token_accuracy", "tokens"}


def trainer_eval_losses(output_dir: Path) -> dict[int, float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {e["step"]: e["eval_loss"] for e in state["log_history"] if "eval_loss" in e}


def evaluate(*args) -> dict:
    result = invoke("evaluate", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("run_name", ["trained_text_lora", "trained_vlm_lora"])
def test_evaluate_writes_finite_metrics_equal_to_the_trainers_eval_loss(request, run_name):
    run = request.getfixturevalue(run_name)
    printed = evaluate(run.config)
    written = json.loads((run.output_dir / "eval_results.json").read_text())
    assert printed == written
    assert set(written) >= METRIC_KEYS
    assert all(math.isfinite(written[k]) for k in METRIC_KEYS)
    assert written["perplexity"] == pytest.approx(math.exp(written["loss"]))
    assert 0 <= written["token_accuracy"] <= 1 and written["tokens"] > 0
    assert written["rows"] == run.raw["val_set_size"] and written["adapter"] is True
    assert written["eval_rows_also_trained"] is False  # val_set_size holds its rows out of training
    # The held-out rows fit one evaluation batch, so the Trainer's mean is per token too.
    final_step = run.raw["max_steps"]
    assert written["step"] == final_step
    assert written["loss"] == pytest.approx(trainer_eval_losses(run.output_dir)[final_step], abs=1e-5)


def test_evaluate_a_checkpoint_into_a_chosen_file(trained_text_lora, tmp_path):
    run = trained_text_lora
    target = tmp_path / "metrics" / "step10.json"
    results = evaluate(run.config, "--checkpoint", run.output_dir / "checkpoint-10", "--output", target)
    assert json.loads(target.read_text()) == results
    assert results["step"] == 10
    assert results["loss"] == pytest.approx(trainer_eval_losses(run.output_dir)[10], abs=1e-5)


def test_token_metrics_count_only_trained_tokens():
    """Known logits: the loss, perplexity and accuracy follow from the labels that are not -100, shifted by one."""
    from hellbender.use.evaluate import token_metrics

    vocab = 4
    logits = torch.zeros(1, 4, vocab)
    logits[0, 0, 2] = 5.0  # predicts token 2 at position 1: right
    logits[0, 1, 1] = 5.0  # predicts token 1 at position 2: wrong (label 3)
    logits[0, 2, 0] = 9.0  # position 3 is masked: not counted

    class Fixed(torch.nn.Module):
        device = torch.device("cpu")

        def forward(self, input_ids, attention_mask, use_cache):
            return type("Out", (), {"logits": logits})()

    def collate(rows):
        return {
            "input_ids": torch.zeros(1, 4, dtype=torch.long),
            "attention_mask": torch.ones(1, 4, dtype=torch.long),
            "labels": torch.tensor([[-100, 2, 3, -100]]),
        }

    metrics = token_metrics(Fixed(), [{}], collate, batch_size=1)
    expected = torch.nn.functional.cross_entropy(logits[0, :2], torch.tensor([2, 3])).item()
    assert metrics["tokens"] == 2
    assert metrics["token_accuracy"] == 0.5
    assert metrics["loss"] == pytest.approx(expected)
    assert metrics["perplexity"] == pytest.approx(math.exp(expected))


# ------------------------------------------------------------------------------------------------ errors


def test_a_config_without_evaluation_data_is_refused(trained_text_lora, tmp_path):
    raw = {k: v for k, v in trained_text_lora.raw.items() if k not in ("val_set_size", "eval_steps")}
    config = tmp_path / "no-eval.yml"
    config.write_text(yaml.safe_dump(raw))
    assert_user_error(invoke("evaluate", config), "no evaluation data", "val_set_size", "test_datasets")


@pytest.mark.parametrize("kind", ["run_dir", "plain_dir", "half_written"])
def test_a_checkpoint_that_is_not_one_is_refused(trained_text_lora, tmp_path, kind):
    import shutil

    run = trained_text_lora
    if kind == "run_dir":  # the run's output directory's parent-like layout: holds checkpoints, is none
        checkpoint, needles = tmp_path, ["point at one of those", "checkpoint-10"]
        shutil.copytree(run.output_dir / "checkpoint-10", tmp_path / "checkpoint-10")
    elif kind == "plain_dir":
        checkpoint, needles = tmp_path / "somewhere", ["hellbender_checkpoint.json"]
        checkpoint.mkdir()
    else:
        checkpoint, needles = tmp_path / "checkpoint-10", ["optimizer.pt is missing"]
        shutil.copytree(run.output_dir / "checkpoint-10", checkpoint)
        (checkpoint / "optimizer.pt").unlink()
    result = invoke("evaluate", run.config, "--checkpoint", checkpoint, "--output", tmp_path / "m.json")
    assert_user_error(result, "--checkpoint", "is not a complete checkpoint", *needles)
    assert not (tmp_path / "m.json").exists()


def test_evaluating_on_the_training_rows_is_said(tmp_path, caplog):
    from hellbender.config import validate_config
    from hellbender.use.evaluate import trained_on_eval_data
    from tests.helpers import base_config

    cfg = validate_config(base_config(tmp_path))
    same = validate_config(
        base_config(tmp_path, test_datasets=[dict(cfg.datasets[0].model_dump(), type="chat_template")])
    )
    assert trained_on_eval_data(same) == [cfg.datasets[0].path]
    other_split = dict(cfg.datasets[0].model_dump(), split="test")
    assert trained_on_eval_data(validate_config(base_config(tmp_path, test_datasets=[other_split]))) == []
