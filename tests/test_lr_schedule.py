"""The cosine schedule's Axolotl keys (`cosine_min_lr_ratio`, `cosine_constant_lr_ratio`, `lr_quadratic_warmup`) and
`warmup_steps` given as a fraction: the learning rate of every step against values worked out by hand, on the
factor itself and in tiny training runs (where the Trainer logs the rate it used)."""

from __future__ import annotations

import math

import pytest

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.train.lr_schedule import CosineFactor, own_lr_factor, scheduler_arguments
from hellbender.train.run import train
from hellbender.train.schedule import plan_schedule
from tests.helpers import base_config, trainer_state

COS_45 = math.cos(math.pi / 4)  # 0.7071...


def logged_rates(output_dir: str) -> dict[int, float]:
    """step -> the learning rate the Trainer logged at that step."""
    return {e["step"]: e["learning_rate"] for e in trainer_state(output_dir)["log_history"] if "learning_rate" in e}


def test_quadratic_warmup_cosine_to_a_floor_then_held():
    # 2 warm-up steps, a floor of 0.1 reached at step 6, then held.
    factor = CosineFactor(warmup_steps=2, floor_from=6, floor=0.1, quadratic_warmup=True)
    expected = [
        0.0,  # step 0
        0.25,  # (1/2)^2
        1.0,  # the peak: progress 0
        0.1 + 0.9 * 0.5 * (1 + COS_45),  # progress 1/4
        0.1 + 0.9 * 0.5,  # progress 1/2
        0.1 + 0.9 * 0.5 * (1 - COS_45),  # progress 3/4
        0.1,  # the floor
        0.1,
        0.1,
    ]
    assert [factor(step) for step in range(9)] == pytest.approx(expected, abs=1e-12)


def test_linear_warmup_and_no_floor_is_the_plain_cosine():
    factor = CosineFactor(warmup_steps=4, floor_from=8)
    assert [factor(step) for step in range(5)] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert factor(6) == pytest.approx(0.5) and factor(8) == pytest.approx(0.0) and factor(20) == pytest.approx(0.0)


def test_a_floor_alone_is_transformers_cosine_with_min_lr(tmp_path):
    cfg = validate_config(base_config(tmp_path, lr_scheduler="cosine", cosine_min_lr_ratio=0.2))
    assert scheduler_arguments(cfg) == {
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": 0.2},
    }
    assert own_lr_factor(cfg, plan_schedule(cfg, 100)) is None


def test_the_hold_starts_at_the_rounded_down_fraction_of_the_steps(tmp_path):
    cfg = validate_config(
        base_config(
            tmp_path, lr_scheduler="cosine", max_steps=10, cosine_min_lr_ratio=0.5, cosine_constant_lr_ratio=0.65
        )
    )
    assert own_lr_factor(cfg, plan_schedule(cfg, None)).floor_from == 6


def test_a_hold_that_starts_within_the_warmup_is_refused(tmp_path):
    cfg = validate_config(
        base_config(
            tmp_path,
            lr_scheduler="cosine",
            max_steps=10,
            warmup_steps=3,
            cosine_min_lr_ratio=0.5,
            cosine_constant_lr_ratio=0.2,
        )
    )
    with pytest.raises(ConfigError, match=r"`cosine_constant_lr_ratio: 0.2` holds the learning rate from step 2 of 10"):
        plan_schedule(cfg, None)


PEAK = 1e-3


def test_training_follows_the_held_quadratic_cosine_step_by_step(tmp_path):
    cfg = validate_config(
        base_config(
            tmp_path,
            learning_rate=PEAK,
            lr_scheduler="cosine",
            max_steps=8,
            warmup_steps=2,
            lr_quadratic_warmup=True,
            cosine_min_lr_ratio=0.1,
            cosine_constant_lr_ratio=0.75,  # the floor from step 6
        )
    )
    train(cfg)
    # Step s is trained with the rate after s - 1 scheduler steps, and logs it.
    hand = {
        1: 0.0,
        2: 0.25,
        3: 1.0,
        4: 0.1 + 0.45 * (1 + COS_45),
        5: 0.55,
        6: 0.1 + 0.45 * (1 - COS_45),
        7: 0.1,
        8: 0.1,
    }
    rates = logged_rates(cfg.output_dir)
    for step, fraction in hand.items():
        assert rates[step] == pytest.approx(PEAK * fraction, rel=1e-6, abs=1e-12), (step, rates)


def test_training_with_a_floor_decays_to_it(tmp_path):
    cfg = validate_config(
        base_config(
            tmp_path, learning_rate=PEAK, lr_scheduler="cosine", max_steps=6, warmup_steps=2, cosine_min_lr_ratio=0.2
        )
    )
    train(cfg)
    rates = logged_rates(cfg.output_dir)
    # step s uses the rate after s - 1 scheduler steps: warm-up n / 2, then 0.2 + 0.8 * (1 + cos(pi * (n - 2) / 4)) / 2
    hand = {1: 0.0, 2: 0.5, 3: 1.0, 4: 0.2 + 0.4 * (1 + COS_45), 5: 0.6, 6: 0.2 + 0.4 * (1 - COS_45)}
    for step, fraction in hand.items():
        assert rates[step] == pytest.approx(PEAK * fraction, rel=1e-6, abs=1e-12), (step, rates)


def test_warmup_steps_below_one_is_a_ratio(tmp_path, caplog):
    cfg = validate_config(base_config(tmp_path, warmup_steps=0.25, max_steps=10))
    assert cfg.warmup_ratio == 0.25 and cfg.warmup_steps is None
    assert plan_schedule(cfg, None).warmup_steps == 3  # ceil(10 x 0.25), as transformers counts it
    assert "`warmup_steps: 0.25` is below 1, which transformers 5 reads as a fraction of all steps" in caplog.text


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"warmup_steps": 0.1, "warmup_ratio": 0.2}, "`warmup_steps: 0.1` is a fraction of all steps"),
        ({"warmup_steps": 2.5}, "`warmup_steps`: Input should be a valid integer"),
        (
            {"lr_scheduler": "linear", "cosine_min_lr_ratio": 0.0, "lr_quadratic_warmup": True},
            "`cosine_min_lr_ratio`, `lr_quadratic_warmup` shape the cosine schedule, and `lr_scheduler` is `linear`",
        ),
        ({"lr_scheduler": "cosine", "cosine_constant_lr_ratio": 0.8}, "which is not set: add it"),
        ({"cosine_min_lr_ratio": 1.5}, "`cosine_min_lr_ratio`: Input should be less than or equal to 1"),
    ],
)
def test_schedule_keys_that_cannot_work_are_refused(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(base_config(tmp_path, **keys))


def test_a_zero_hold_ratio_is_read_as_unset_as_in_axolotl(tmp_path, caplog):
    cfg = validate_config(
        base_config(tmp_path, lr_scheduler="cosine", cosine_min_lr_ratio=1.0, cosine_constant_lr_ratio=0)
    )
    assert cfg.cosine_constant_lr_ratio is None
    assert "`cosine_constant_lr_ratio: 0` is read as unset" in caplog.text


def test_eta_min_is_refused_naming_cosine_min_lr_ratio(tmp_path):
    with pytest.raises(ConfigError) as error:
        validate_config(base_config(tmp_path, lr_scheduler="cosine", learning_rate="5e-6", eta_min="7e-7"))
    message = str(error.value)
    assert "`eta_min` is not a key of hellbender, nor of Axolotl" in message and "Axolotl ignores it" in message
    assert "`cosine_min_lr_ratio: 0.14`" in message
