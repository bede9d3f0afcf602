"""The run report of online RL (`rl: grpo`, `rl: rloo`): per-step plots of the rewards, their spread, the completions'
length and the KL to the reference, and an outcome judged by the rewards rather than by the loss (which stays near 0
by construction)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hellbender.train.report import REPORT_DIR, SUMMARY_NAME, RunReport
from tests.test_grpo import grpo_config
from tests.test_run_report import assert_real_plot, fake_state, written_page

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")

ONLINE_PLOTS = ("reward.png", "reward_std.png", "completion_length.png", "kl.png")


def test_a_grpo_run_reports_its_rewards_lengths_and_kl_per_step(tmp_path):
    """Three steps with two reward functions and `beta: 0.1`: report/ holds a plot of the total and each function's
    reward, of their spread, of the completion length and of the KL, each linked from report.md; the outcome gives
    the rewards instead of a training-loss line, and names the loss for what it is."""
    from hellbender.train.run import train

    trl = {"reward_funcs": ["rewards.even_share", "rewards.low_share"], "beta": 0.1}
    cfg = grpo_config(tmp_path, trl, max_steps=3, learning_rate=2e-2)
    train(cfg)
    report = Path(cfg.output_dir) / REPORT_DIR
    page = (report / SUMMARY_NAME).read_text()
    for name in ONLINE_PLOTS:
        assert_real_plot(report / name)
        assert f"]({name})" in page, name
    assert not (report / "rewards.png").exists()  # DPO's implicit rewards: not drawn for GRPO
    assert "- Training loss:" not in page
    assert "- Mean reward (generated completions, per logged step):" in page
    assert "`even_share`" in page and "`low_share`" in page
    assert "- Reward spread (standard deviation):" in page and "- Completion length (mean tokens):" in page
    assert "- KL to the reference (per token):" in page
    assert "- Loss (no measure of progress here" in page
    assert "Evaluation loss" not in page  # online RL is not evaluated yet


def test_the_kl_plot_is_left_out_where_beta_is_zero_and_notes_speak_of_rewards(tmp_path):
    """Without `beta` TRL logs no KL, so there is no KL plot; a reward that does not rise and groups that all scored
    alike are named, and a flat loss (GRPO's normal) is not."""
    from hellbender.train.plots import report_plots

    cfg = grpo_config(tmp_path)
    history = [
        {
            "step": step,
            "loss": 0.0,
            "learning_rate": 1e-3,
            "reward": 0.5,
            "reward_std": 0.0,
            "frac_reward_zero_std": 0.9,
            "rewards/even_share/mean": 0.5,
            "rewards/even_share/std": 0.0,
            "completions/mean_length": 4.0,
        }
        for step in range(1, 9)
    ]
    plots = report_plots(history, "off")
    assert "kl.png" not in plots and "rewards.png" not in plots
    assert all(isinstance(plots[name], bytes) for name in ONLINE_PLOTS[:3])
    page = written_page(tmp_path, RunReport(cfg, None, None), fake_state(history, 8))
    assert "](kl.png)" not in page and "](reward.png)" in page
    assert "The mean reward did not rise: 0.5 over the first quarter" in page
    assert "every completion got the same reward" in page
    assert "did not fall" not in page
