"""`peft.loftq_config` (LoftQ's start of a LoRA adapter): the config, its refusals, and the wiring into PEFT. PEFT's
LoftQ quantizes with bitsandbytes on CUDA, so the numbers are checked in tests/test_gpu.py; here PEFT's own LoftQ
step is replaced by a recorder to see what the real path asks of it."""

from __future__ import annotations

import importlib.machinery
import importlib.util

import pytest
import torch

from hellbender.config import validate_config
from hellbender.errors import ConfigError, EnvironmentProblem
from tests.helpers import base_config

LOFTQ = {"adapter": "lora", "lora_target_modules": ["q_proj", "v_proj"], "peft": {"loftq_config": {"loftq_bits": 4}}}


def test_loftq_config_is_read_with_peft_defaults(tmp_path):
    cfg = validate_config(base_config(tmp_path, **LOFTQ))
    assert cfg.loftq is not None
    assert (cfg.loftq.loftq_bits, cfg.loftq.loftq_iter) == (4, 1)
    assert cfg.model_dump()["peft"] == {"loftq_config": {"loftq_bits": 4, "loftq_iter": 1}}
    assert validate_config(base_config(tmp_path, adapter="lora")).loftq is None


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"adapter": None}, r"needs `adapter: lora` on an unquantized base, not full fine-tuning"),
        ({"adapter": "qlora"}, r"not a base quantized by bitsandbytes"),
        ({"load_in_8bit": True}, r"not a base quantized by bitsandbytes"),
        ({"peft": {"loftq_config": {"loftq_bits": 2}}}, r"loftq_bits"),
        ({"peft": {"loftq_config": {"loftq_iter": 0}}}, r"loftq_iter"),
        ({"peft": {"loftq_config": {"loftq_bits": 4, "bits": 4}}}, r"bits"),
    ],
)
def test_loftq_combinations_that_cannot_work_are_refused(tmp_path, keys, message):
    keys = {**LOFTQ, **keys}
    if keys["adapter"] is None:
        keys.pop("lora_target_modules")
    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, **keys))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_loftq_without_a_gpu_is_refused_before_loading(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from hellbender.models.adapters import apply_adapter

    cfg = validate_config(base_config(tmp_path, **LOFTQ))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with pytest.raises(EnvironmentProblem, match=r"`peft.loftq_config` quantizes the base weights .* CUDA GPU"):
        apply_adapter(cfg, model)


def test_loftq_reaches_peft_with_the_rank_bits_and_iterations(tmp_path, tiny_model_path, monkeypatch):
    import peft.tuners.lora.layer as lora_layer
    from transformers import AutoModelForCausalLM

    from hellbender.models.adapters import apply_adapter

    calls = []

    def recorded_loftq(weight, num_bits, reduced_rank, num_iter=1):
        calls.append((tuple(weight.shape), num_bits, reduced_rank, num_iter))
        out_features, in_features = weight.shape
        return (
            weight.half().to(weight.dtype),
            torch.ones(reduced_rank, in_features),
            torch.ones(out_features, reduced_rank),
        )

    real_find_spec = importlib.util.find_spec
    # bitsandbytes and scipy are asked for by name only; the recorder stands in for what they would compute
    present = {name: importlib.machinery.ModuleSpec(name, None) for name in ("bitsandbytes", "scipy")}
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: present.get(n) or real_find_spec(n, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(lora_layer, "loftq_init", recorded_loftq)

    cfg = validate_config(base_config(tmp_path, **{**LOFTQ, "lora_r": 4, "peft": {"loftq_config": {"loftq_iter": 3}}}))
    model = apply_adapter(cfg, AutoModelForCausalLM.from_pretrained(tiny_model_path))
    adapted = [name for name, _ in model.named_modules() if name.endswith(("q_proj", "v_proj"))]
    assert len(calls) == len(adapted) > 0
    assert {call[1:] for call in calls} == {(4, 4, 3)}
    # the LoRA matrices are LoftQ's, not PEFT's default start (B zero)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.equal(q_proj.lora_B["default"].weight, torch.ones_like(q_proj.lora_B["default"].weight))
    assert model.peft_config["default"].init_lora_weights == "loftq"
    assert model.peft_config["default"].loftq_config == {"loftq_bits": 4, "loftq_iter": 3}
