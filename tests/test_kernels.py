"""Fused kernels are refused clearly where they cannot run (CPU checks; the numerical checks are GPU tests)."""

from __future__ import annotations

import importlib.util

import pytest

from hellbender.config import validate_config
from hellbender.errors import EnvironmentProblem
from hellbender.models.kernels import LIGER_ARGUMENTS, requested_liger_keys
from hellbender.train.run import train
from tests.helpers import base_config


def test_every_liger_key_is_a_config_key_and_off_by_default(tmp_path):
    cfg = validate_config(base_config(tmp_path))
    assert requested_liger_keys(cfg) == []
    assert all(getattr(cfg, key) is False for key in LIGER_ARGUMENTS)
    assert cfg.fuses_the_loss is False


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed here")
def test_liger_keys_without_the_package_are_a_clear_error_before_training(tmp_path):
    cfg = validate_config(base_config(tmp_path, liger_rms_norm=True, liger_fused_linear_cross_entropy=True))
    with pytest.raises(
        EnvironmentProblem,
        match=r"`liger_rms_norm`, `liger_fused_linear_cross_entropy` need the `liger-kernel` package",
    ):
        train(cfg)
    assert not list((tmp_path / "out").glob("checkpoint-*"))
