"""RLOO (`rl: rloo`) on TRL's RLOOTrainer through hellbender: the `trl:` keys it reads (GRPO's own refused by name),
TRL's RLOO defaults written into the config, the leave-one-out advantages, and learning a reward on a tiny task."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hellbender.config.loading import load_config, validate_config
from hellbender.errors import ConfigError
from tests.test_grpo import grpo_config, grpo_settings, logged_rewards, recording_trainer


def rloo_config(tmp_path: Path, trl: dict | None = None, **overrides):
    return grpo_config(tmp_path, trl, **{"rl": "rloo", **overrides})


def test_rloo_takes_trls_rloo_defaults_and_leaves_grpos_keys_unset(tmp_path):
    cfg = rloo_config(tmp_path)
    assert cfg.rl == "rloo"
    assert (cfg.trl.beta, cfg.trl.loss_type, cfg.trl.scale_rewards) == (0.05, None, None)
    grpo = grpo_config(tmp_path)
    assert (grpo.trl.beta, grpo.trl.loss_type, grpo.trl.scale_rewards) == (0.0, "dapo", "group")
    assert rloo_config(tmp_path, {"beta": 0.0}).trl.beta == 0.0  # a chosen 0 stays 0


@pytest.mark.parametrize(
    ("trl", "overrides", "needles"),
    [
        ({"loss_type": "dapo"}, {}, ["`trl.loss_type` is a setting of GRPO", "rl: rloo", "set `rl: grpo`"]),
        ({"scale_rewards": False}, {}, ["`trl.scale_rewards` is a setting of GRPO", "rl: rloo"]),
        ({"num_generations": 3}, {}, ["trl.num_generations: 3", "batch here is 8"]),
        ({}, {"rl_beta": 0.1}, ["rl_beta", "the KL weight of `rl: rloo` is `trl.beta`"]),
        ({}, {"val_set_size": 4, "eval_batch_size": 2}, ["eval_batch_size: 2", "multiple of 4"]),
        ({"use_liger_loss": True}, {}, ["trl.use_liger_loss", "not offered yet"]),
    ],
)
def test_rloo_config_errors_name_the_key(tmp_path, trl, overrides, needles):
    with pytest.raises(ConfigError) as error:
        rloo_config(tmp_path, trl, **overrides)
    for needle in needles:
        assert needle in str(error.value), str(error.value)


def test_rloo_without_reward_functions_is_refused(tmp_path):
    raw = grpo_settings(tmp_path, rl="rloo")
    del raw["trl"]["reward_funcs"]
    with pytest.raises(ConfigError, match=r"`rl: rloo` scores its generated completions with reward functions"):
        validate_config(raw)


def test_rloo_advantages_are_each_reward_minus_the_mean_of_the_others(tmp_path):
    """With `beta: 0` the advantage TRL trains with is the completion's reward minus the mean reward of the other
    completions of its prompt (not divided by any spread, unlike GRPO's)."""
    from hellbender.config.reward_functions import load_reward_function

    cfg = rloo_config(tmp_path, {"beta": 0.0}, max_steps=1, micro_batch_size=16)
    trainer, batches = recording_trainer(cfg)
    trainer.train()
    batch = batches[0]
    ids = [
        row[mask.bool()].tolist() for row, mask in zip(batch["completion_ids"], batch["completion_mask"], strict=True)
    ]
    score = load_reward_function("rewards.even_share", tmp_path)
    rewards = torch.tensor(score(prompts=[], completions=[], completion_ids=ids)).view(-1, 4)
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / 3
    assert rewards.std() > 0
    torch.testing.assert_close(batch["advantages"].cpu(), (rewards - others).flatten(), atol=1e-6, rtol=1e-6)


def test_rloo_learns_the_reward_of_a_tiny_task(tmp_path):
    """Full fine-tuning with TRL's default KL weight (0.05, against a frozen copy of the starting weights), 20 steps
    of 2 prompts x 4 completions of 4 tokens at learning rate 5e-2: the mean reward of the first 5 steps is 0.53, of
    the last 5 steps 0.95 (measured on CPU, seed 42; at 2e-2 RLOO needs about 30 steps, GRPO 20)."""
    from hellbender.train.run import train

    cfg = rloo_config(tmp_path, max_steps=20, learning_rate=5e-2)
    train(cfg)
    rewards = logged_rewards(Path(cfg.output_dir))
    assert len(rewards) == 20
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.65 and last > 0.85, rewards
    report = (Path(cfg.output_dir) / "report" / "report.md").read_text()
    assert (
        "Method: RLOO (online reinforcement learning, 4 completions per prompt, beta 0.05), full fine-tuning" in report
    )
    resolved = load_config(Path(cfg.output_dir) / "hellbender_config.yml")  # as a resumed run reads it
    assert resolved.trl == cfg.trl and resolved.trl.loss_type is None


def test_a_stopped_rloo_run_resumes_in_a_new_process_exactly(tmp_path):
    """`rl: rloo` with its default KL weight (0.05: a frozen reference copy of the starting weights) and
    `num_iterations: 2`, stopped after checkpoint-3, between two optimizer steps on one generated batch, and resumed by
    a new `hellbender train` process: steps 4 to 6 log the same losses, rewards and completion lengths as the
    uninterrupted run, which ends with the same weights (the resumed run goes on with the completions generated at
    step 3, and samples the next ones from the same random state)."""
    from tests.test_grpo_e2e import assert_resumes_in_a_new_process_exactly

    trl = {
        "reward_funcs": ["rewards.even_share"],
        "num_generations": 4,
        "max_completion_length": 4,
        "num_iterations": 2,
    }
    assert_resumes_in_a_new_process_exactly(tmp_path, rl="rloo", trl=trl, learning_rate=5e-2)
