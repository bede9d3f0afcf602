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


def _trains(model) -> None:
    """A forward and backward run through the adapted model and reach every adapter matrix."""
    # 160 tokens: past the compression rates of the tiny DeepSeek-V4's layers (4 and 128), so every compressor runs.
    ids = torch.arange(10, 170).unsqueeze(0)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    unreached = [n for n, p in model.named_parameters() if "lora_" in n and p.grad is None]
    assert not unreached and any("lora_" in n for n, _ in model.named_parameters()), unreached


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
    _trains(adapted)


def test_naming_a_router_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`router`: PhiMoE's router returns"):
        apply_adapter(_lora(tmp_path, lora_target_modules=["q_proj", "router"]), _tiny("phimoe"))


def test_a_regex_reaching_a_router_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`router`: PhiMoE's router returns"):
        apply_adapter(_lora(tmp_path, lora_target_modules=r".*\.(q_proj|router)"), _tiny("phimoe"))


# Causal-LM families of the installed transformers with a sparse-attention indexer (a module named `*Indexer`).
INDEXER_FAMILIES = ("axk2", "deepseek_v32", "deepseek_v4", "dots3_note", "glm_moe_dsa", "hy_v4", "qwen4_exp")


@pytest.mark.parametrize("model_type", INDEXER_FAMILIES)
def test_no_gradient_reaches_a_sparse_attention_indexer_so_its_layers_are_left_out(model_type):
    """The contract behind leaving indexer layers out: trained in full, the language-model loss gives none of the
    indexer's weights a gradient (it only picks positions by top-k). Every linear layer inside it is listed as
    unadaptable, and nothing outside it is."""
    from hellbender.models.fixes.unadaptable_layers import INDEXER_REASON, unadaptable_layers

    model = _tiny(model_type)
    ids = torch.arange(10, 170).unsqueeze(0)  # past every compression rate of the tiny DeepSeek-V4
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    indexers = [n for n, m in model.named_modules() if type(m).__name__.endswith("Indexer")]
    assert indexers, model_type
    inside = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(indexers[0])]
    weights = {n: p for n, p in model.named_parameters() if any(n.startswith(f"{i}.") for i in indexers)}
    assert inside and weights
    assert all(p.grad is None or not p.grad.any() for p in weights.values()), model_type
    assert any(p.grad is not None and p.grad.any() for n, p in model.named_parameters() if n not in weights)
    left_out = {n for n, why in unadaptable_layers(model).items() if why == INDEXER_REASON}
    expected = {
        n for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and any(n.startswith(f"{i}.") for i in indexers)
    }  # fmt: skip
    assert left_out == expected


def test_a_named_layer_the_indexer_shares_is_adapted_outside_it_and_one_only_it_has_is_refused(tmp_path, caplog):
    """DeepSeek-V4's indexer has its own `q_b_proj` and `gate_proj`: naming them adapts the others (with the notice)
    and every adapter trains; naming `weights_proj`, which only the indexer has, is refused by name."""
    model = _tiny("deepseek_v4")
    with caplog.at_level("WARNING", logger="hellbender"):
        adapted = apply_adapter(_lora(tmp_path, lora_target_modules=["q_b_proj", "gate_proj", "up_proj"]), model)
    wrapped = [name for name, m in adapted.named_modules() if hasattr(m, "lora_A")]
    assert wrapped and not any(".indexer." in name for name in wrapped), wrapped
    assert {"q_b_proj", "gate_proj"} <= {name.rsplit(".", 1)[-1] for name in wrapped}
    assert any("sparse-attention indexer" in r.message for r in caplog.records if "leaves out" in r.message)
    _trains(adapted)
    with pytest.raises(ConfigError, match=r"`weights_proj`: the sparse-attention indexer only chooses"):
        apply_adapter(_lora(tmp_path, lora_target_modules=["q_b_proj", "weights_proj"]), _tiny("deepseek_v4"))


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
