"""Saved adapters load whole where hellbender loads them (merge, inference, evaluation): the LoRA tensors PEFT leaves
out are placed by hellbender, and an adapter with a tensor that has no place is refused, instead of running some
layers with their initial weights (models/adapter_loading.py).

PEFT 0.21 drops, when loading, the LoRA weights of linear layers whose names share a part with a module adapted
through `target_parameters`: Laguna's `mlp.shared_experts.*_proj` beside its fused `mlp.experts` (it rewrites their
keys to `shared_experts..gate_proj` and finds no such module)."""

from __future__ import annotations

import logging

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.models.stack import build_trainable_model, with_saved_adapter
from hellbender.models.tiny import build_tiny_tokenizer
from tests.helpers import base_config, model_survey

SHARED = "base_model.model.model.layers.1.mlp.shared_experts.gate_proj.lora_B.default.weight"


@pytest.fixture
def trained_laguna(tmp_path):
    """A Laguna LoRA adapter with random (nonzero) weights, saved; its config, directories and logits on `ids`."""
    model_dir = tmp_path / "laguna"
    model_survey().build("laguna", model_dir)
    cfg = validate_config(base_config(tmp_path, base_model=str(model_dir), adapter="lora", lora_target_linear=True))
    trained = build_trainable_model(cfg, build_tiny_tokenizer())
    torch.manual_seed(0)
    for name, parameter in trained.named_parameters():
        if "lora_" in name:
            parameter.data.normal_(0, 0.05)
    trained.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(5, 250, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = trained.eval()(input_ids=ids, use_cache=False).logits
    return cfg, model_dir, tmp_path / "adapter", ids, logits, trained.state_dict()[SHARED]


def test_what_peft_leaves_out_is_placed_and_the_trained_logits_come_back(trained_laguna, caplog):
    cfg, model_dir, adapter, ids, expected, shared = trained_laguna
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    peft_drops = not torch.equal(plain.state_dict()[SHARED], shared)
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        loaded = with_saved_adapter(cfg, AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids, use_cache=False).logits, expected)
    notices = [r.getMessage() for r in caplog.records if "hellbender placed them itself" in r.getMessage()]
    assert notices == (
        [
            "PEFT left 6 saved LoRA tensor(s) of " + f"{adapter} out while loading; hellbender placed them "
            "itself (checked equal to the file)."
        ]
        if peft_drops
        else []
    )


def test_a_saved_tensor_with_no_place_in_the_model_is_refused(trained_laguna):
    cfg, model_dir, adapter, *_ = trained_laguna
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.1.mlp.no_such_layer.lora_A.weight"] = torch.zeros(4, 32)
    save_file(tensors, adapter / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match=r"only in part: 1 saved tensor\(s\) .* `.*no_such_layer.lora_A.weight`"):
        with_saved_adapter(cfg, AutoModelForCausalLM.from_pretrained(model_dir), adapter)
