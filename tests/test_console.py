"""Training prints one readable line per logged step: numbers as numbers, no quoted strings, no FLOP counts."""

from __future__ import annotations

from hellbender.train.console import step_line


def test_a_logged_step_is_one_line_of_numbers():
    logs = {
        "loss": 5.8859965,
        "grad_norm": 2.26,
        "learning_rate": 0.00019,
        "tokens_per_second": 2492.4,
        "input_tokens": 1002,
        "epoch": 0.83,
        "total_flos": 1.4e11,
    }
    assert step_line(logs, 10, 144) == (
        "step 10/144  loss 5.886  grad_norm 2.26  learning_rate 1.900e-04  tokens_per_second 2,492  "
        "input_tokens 1,002  epoch 0.83"
    )


def test_a_training_run_prints_step_lines(tmp_path, capsys):
    from hellbender.config import validate_config
    from hellbender.train.run import train
    from tests.helpers import base_config

    train(validate_config(base_config(tmp_path, max_steps=2)))
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "step 1/2  loss " in text and "'loss'" not in text


def test_a_preference_step_line_leads_with_what_says_the_preference_is_learned():
    logs = {
        "loss": 0.6,
        "grad_norm": 0.2,
        "num_tokens": 512,
        "logits/chosen": -0.002,
        "rewards/chosen": 0.1,
        "rewards/accuracies": 0.75,
        "rewards/margins": 0.3,
        "eval_num_tokens": 512,
        "epoch": 0.5,
    }
    assert step_line(logs, 5, 84) == (
        "step 5/84  loss 0.6  rewards/accuracies 0.75  rewards/margins 0.3  grad_norm 0.2  rewards/chosen 0.1  epoch 0.5"
    )


def test_an_online_rl_step_line_leads_with_the_reward_and_leaves_out_the_length_extremes():
    logs = {
        "loss": 0.0,
        "grad_norm": 0.5,
        "completions/mean_length": 8.0,
        "completions/min_length": 4.0,
        "completions/max_length": 8.0,
        "completions/max_terminated_length": 0.0,
        "rewards/even_tokens/mean": 0.75,
        "reward": 0.75,
        "reward_std": 0.25,
        "clip_ratio/high_max": 0.0,
        "clip_ratio/region_mean": 0.0,
    }
    assert step_line(logs, 5, 40) == (
        "step 5/40  loss 0  reward 0.75  reward_std 0.25  grad_norm 0.5  completions/mean_length 8  "
        "rewards/even_tokens/mean 0.75  clip_ratio/region_mean 0"
    )
