"""An adapter that PEFT loads only in part is refused where hellbender loads saved adapters (merge, inference,
evaluation), instead of running some layers with their initial weights.

PEFT 0.21 drops, when loading, the LoRA weights of linear layers whose names contain a module adapted through
`target_parameters`: Laguna's `mlp.shared_experts.*_proj` beside its fused `mlp.experts` (it renames their keys to
`shared_experts..gate_proj` and finds no such module). A PEFT release that loads them must give the trained logits."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.models.stack import build_trainable_model, with_saved_adapter
from hellbender.models.tiny import build_tiny_tokenizer
from tests.helpers import base_config, model_survey


def test_a_partly_loaded_adapter_is_refused_and_a_whole_one_gives_the_trained_logits(tmp_path):
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
        expected = trained.eval()(input_ids=ids, use_cache=False).logits
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "adapter").eval()
    shared = "base_model.model.model.layers.1.mlp.shared_experts.gate_proj.lora_B.default.weight"
    if torch.equal(plain.state_dict()[shared], trained.state_dict()[shared]):  # a PEFT release that loads it whole
        loaded = with_saved_adapter(cfg, AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "adapter")
        with torch.no_grad():
            torch.testing.assert_close(loaded.eval()(input_ids=ids, use_cache=False).logits, expected)
        return
    with pytest.raises(ConfigError, match=r"loaded the adapter in .* only in part: 6 saved tensor\(s\)") as refusal:
        with_saved_adapter(cfg, AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "adapter")
    assert "shared_experts" in str(refusal.value)


def test_a_whole_adapter_loads_without_complaint(tmp_path):
    cfg = validate_config(base_config(tmp_path, adapter="lora", lora_target_linear=True))
    trained = build_trainable_model(cfg, build_tiny_tokenizer())
    trained.save_pretrained(tmp_path / "adapter")
    base = build_trainable_model(validate_config(base_config(tmp_path)), build_tiny_tokenizer())
    assert isinstance(with_saved_adapter(cfg, base, tmp_path / "adapter"), PeftModel)
