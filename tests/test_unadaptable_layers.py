"""Layers LoRA cannot adapt (PEFT's refusal on Mamba families; linear subclasses that are no plain linear map:
tuple-returning routers, DeepSeek-V4's grouped projection) are left out of `lora_target_linear` with one notice line,
and refused by name when `lora_target_modules` asks for them."""

from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace

import pytest
import torch
import transformers

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.models.adapters import apply_adapter
from hellbender.models.fixes.unadaptable_layers import (
    MAMBA_MODEL_TYPES,
    MAMBA_REFUSED_LEAVES,
    WEIGHTS_READ_DIRECTLY,
    unadaptable_layers,
)
from hellbender.models.tiny import build_tiny_tokenizer
from tests.helpers import base_config, model_survey

survey = model_survey()


def _tiny(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(survey.tiny_config(model_type, build_tiny_tokenizer()))


def _lora(tmp_path, **keys):
    return validate_config(base_config(tmp_path, adapter="lora", lora_r=4, lora_alpha=8, **keys))


def _trains(model, every_adapter: bool = True) -> None:
    """A forward and backward run through the adapted model and reach every adapter matrix (`every_adapter`), or
    at least one (DeepSeek-V4's indexer only picks positions by top-k, which passes no gradient back)."""
    ids = torch.arange(10, 22).unsqueeze(0)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    reached = [p.grad is not None for n, p in model.named_parameters() if "lora_" in n]
    assert reached and (all(reached) if every_adapter else any(reached))


@pytest.mark.parametrize("model_type", sorted(MAMBA_MODEL_TYPES))
def test_peft_refuses_exactly_these_mamba_layers(model_type):
    """The list hellbender leaves out is PEFT's: each named layer is refused for each family, and allowed elsewhere."""
    from peft import LoraConfig, get_peft_model

    for leaf in sorted(MAMBA_REFUSED_LEAVES):
        for family, refused in ((model_type, True), ("llama", False)):
            model = torch.nn.Module()
            model.config = SimpleNamespace(model_type=family)
            setattr(model, leaf, torch.nn.Linear(4, 4))
            if refused:
                with pytest.raises(ValueError, match="incompatible with Mamba"):
                    get_peft_model(model, LoraConfig(r=2, target_modules=[leaf]))
            else:
                get_peft_model(model, LoraConfig(r=2, target_modules=[leaf]))


def test_lora_target_linear_on_a_mamba_model_leaves_out_what_peft_refuses_and_what_the_mixer_bypasses(tmp_path, caplog):
    """Without the rule, PEFT refuses `out_proj`, and `dt_proj`'s adapter gets no gradient (the mixer multiplies by
    its weight directly); `x_proj` is bypassed the same way by the fused CUDA kernel."""
    model = _tiny("falcon_mamba")
    with caplog.at_level("WARNING", logger="hellbender"):
        adapted = apply_adapter(_lora(tmp_path, lora_target_linear=True), model)
    wrapped = {name.rsplit(".", 1)[-1] for name, m in adapted.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"in_proj"}
    notices = [r.message for r in caplog.records if "leaves out" in r.message]
    assert len(notices) == 1
    assert "`out_proj`: PEFT refuses LoRA on `out_proj` and `conv1d`" in notices[0]
    assert "`dt_proj`, `x_proj`: the Mamba mixer multiplies by this layer's weight directly" in notices[0]
    _trains(adapted)


def test_jamba_leaves_out_only_dt_proj_of_its_mamba_mixer(tmp_path):
    adapted = apply_adapter(_lora(tmp_path, lora_target_linear=True), _tiny("jamba"))
    wrapped = {name.rsplit(".", 1)[-1] for name, m in adapted.named_modules() if hasattr(m, "lora_A")}
    assert "dt_proj" not in wrapped and {"in_proj", "x_proj", "out_proj"} <= wrapped
    _trains(adapted)


@pytest.mark.parametrize(("model_type", "leaves"), sorted(WEIGHTS_READ_DIRECTLY.items()))
def test_each_listed_mixer_reads_those_weights_directly(model_type, leaves):
    """The table stays true for the installed transformers: the family's modeling code multiplies by (or passes to a
    kernel) `self.<layer>.weight` outside weight initialisation."""
    import inspect

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    module = importlib.import_module(
        inspect.getmodule(getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])).__name__
    )
    lines = [line for line in inspect.getsource(module).splitlines() if "init." not in line and "= module." not in line]
    for leaf in leaves:
        assert any(f"self.{leaf}.weight" in line for line in lines), (model_type, leaf)


def test_naming_out_proj_on_a_mamba_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`lora_target_modules` names layers LoRA cannot adapt.*`out_proj`: PEFT"):
        apply_adapter(_lora(tmp_path, lora_target_modules=["in_proj", "out_proj"]), _tiny("falcon_mamba"))


@pytest.mark.parametrize(("model_type", "leaf"), [("phimoe", "router"), ("deepseek_v4", "o_a_proj")])
def test_lora_target_linear_leaves_out_linear_subclasses_that_are_no_linear_map(tmp_path, caplog, model_type, leaf):
    """Plain PEFT `all-linear` fails on these (a tuple has no dtype; a size mismatch); hellbender leaves them out."""
    model = _tiny(model_type)
    with caplog.at_level("WARNING", logger="hellbender"):
        adapted = apply_adapter(_lora(tmp_path, lora_target_linear=True), model)
    wrapped = {name.rsplit(".", 1)[-1] for name, m in adapted.named_modules() if hasattr(m, "lora_A")}
    assert leaf not in wrapped and len(wrapped) >= 3
    assert any(f"`{leaf}`:" in r.message for r in caplog.records if "leaves out" in r.message)
    _trains(adapted, every_adapter=model_type != "deepseek_v4")


def test_naming_a_router_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`router`: PhiMoE's router returns"):
        apply_adapter(_lora(tmp_path, lora_target_modules=["q_proj", "router"]), _tiny("phimoe"))


def test_a_regex_reaching_a_router_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`router`: PhiMoE's router returns"):
        apply_adapter(_lora(tmp_path, lora_target_modules=r".*\.(q_proj|router)"), _tiny("phimoe"))


def test_a_vision_language_model_with_a_mamba_language_model_leaves_out_what_the_mixer_bypasses():
    """Nemotron-H Omni's language model is a Nemotron-H: its mixers' `out_proj` is left out as in the text model
    (by the text config's type; PEFT, which goes by the top-level type, refuses nothing there)."""
    from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

    tokenizer = build_tiny_tokenizer()
    text = survey.shrunk_kwargs(CONFIG_MAPPING["nemotron_h"](), len(tokenizer))
    vision = {"image_size": 32, "patch_size": 4, "max_img_size": 32, "num_cls_tokens": 1, "num_registers": 1}
    vision |= {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "video_temporal_patch_size": 2}
    config = CONFIG_MAPPING["nemotron_h_omni"](
        text_config=text, vision_config=vision, audio_config=None, vision_hidden_size=32, projector_hidden_size=32
    )
    model = AutoModelForImageTextToText.from_config(config)
    left_out = unadaptable_layers(model)
    mixers = {name for name, m in model.named_modules() if hasattr(m, "conv1d")}
    assert mixers and set(left_out) == {f"{name}.out_proj" for name in mixers}
    assert all("multiplies by this layer's weight directly" in reason for reason in left_out.values())
