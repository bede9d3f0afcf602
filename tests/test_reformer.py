"""Reformer's family rules (models/fixes/reformer.py): one training length, refused otherwise when the config is
read; adapters inside its reversible layers learn; `gradient_checkpointing` is refused (see
tests/test_layer_list_checkpointing.py)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.models.fixes.reformer import let_reversible_layers_train
from hellbender.models.loading import model_config
from hellbender.models.tiny import build_tiny_tokenizer
from tests.helpers import base_config, model_survey

survey = model_survey()


@pytest.fixture(scope="module")
def reformer_dir(tmp_path_factory):
    tokenizer = build_tiny_tokenizer()
    target = tmp_path_factory.mktemp("reformer")
    AutoModelForCausalLM.from_config(survey.tiny_config("reformer", tokenizer)).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


@pytest.mark.parametrize(
    "settings, problem",
    [
        ({"sequence_len": 64, "pad_to_sequence_len": True}, "`sequence_len: 64`"),
        ({"sequence_len": 128}, "without `pad_to_sequence_len: true`"),
    ],
)
def test_a_length_reformer_cannot_train_on_is_refused_with_the_keys_to_set(tmp_path, reformer_dir, settings, problem):
    cfg = validate_config(base_config(tmp_path, base_model=str(reformer_dir), **settings))
    with pytest.raises(ConfigError, match=r"exactly 128 tokens \(the product of its `axial_pos_shape`\)") as error:
        model_config(cfg, str(reformer_dir))
    assert problem in str(error.value)
    fixed = validate_config(
        base_config(tmp_path, base_model=str(reformer_dir), sequence_len=128, pad_to_sequence_len=True)
    )
    assert model_config(fixed, str(reformer_dir)).model_type == "reformer"


@pytest.mark.parametrize("fixed", [False, True])
def test_adapters_inside_the_reversible_layers_get_gradients_only_with_the_fix(reformer_dir, fixed):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(reformer_dir).train()
    if fixed:
        let_reversible_layers_train(model)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    ids = torch.randint(3, 60, (2, 128), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    if not fixed:  # transformers' reversible function: nothing requires a gradient, nothing trains
        assert not loss.requires_grad
        return
    loss.backward()
    lora_b = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(g is not None and g.abs().sum() > 0 for g in lora_b)
