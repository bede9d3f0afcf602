"""A trained weight the first backward never reached is named once, before the first optimizer step."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from hellbender.config import validate_config
from hellbender.train.run import train
from hellbender.train.unused_weights import UnusedWeightsNotice, unused_modules, weights_without_gradient
from tests.helpers import base_config, model_survey


class TwoBranches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_only_weights_without_gradient_are_named_once(caplog):
    model = TwoBranches()
    model(torch.ones(2, 4)).sum().backward()
    assert weights_without_gradient(model) == ["unused.weight", "unused.bias"]
    assert unused_modules(weights_without_gradient(model)) == ["unused"]
    notice = UnusedWeightsNotice()
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        for _ in range(2):  # the second optimizer step says nothing more
            notice.on_pre_optimizer_step(SimpleNamespace(deepspeed=None), None, None, model=model)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "1 trained module(s) got no gradient" in warnings[0] and "`unused`" in warnings[0]


def test_lora_names_the_cross_attention_a_decoder_alone_never_uses(tmp_path, caplog):
    """BART's causal-LM class is its decoder, whose layers keep cross-attention that only an encoder's states feed."""
    model_dir = tmp_path / "bart"
    model_survey().build("bart", model_dir)
    cfg = validate_config(
        base_config(tmp_path, base_model=str(model_dir), adapter="lora", lora_target_linear=True, max_steps=1)
    )
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        train(cfg)
    notice = next(r.getMessage() for r in caplog.records if "got no gradient" in r.getMessage())
    assert "`model.decoder.layers.0.encoder_attn.k_proj`" in notice
    assert "self_attn" not in notice and "fc1" not in notice
