"""`liger_rms_norm_gated`: hellbender's fused gated RMSNorm computes what transformers' gated-norm modules compute,
forward and backward, is bound on the gated norms of the one model it is applied to and nothing else, and is refused
by name where it cannot work.

The kernel runs here under Triton's interpreter (in a subprocess: `TRITON_INTERPRET=1` must be set before Triton is
imported), in float32 only: the interpreter truncates float32 to bfloat16 instead of rounding it, so bf16 numerics
are checked on a GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers.models.nemotron_h import modeling_nemotron_h
from transformers.models.qwen3_5 import modeling_qwen3_5

from hellbender.config import validate_config
from hellbender.errors import ConfigError, EnvironmentProblem
from hellbender.models import gated_norms
from hellbender.models.gated_norms import KEY, KINDS, apply_gated_norm_kernel, fuse_gated_norms, installed_class
from tests.gated_norm_checks import tiny_models
from tests.helpers import base_config

REPO = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """tests/gated_norm_checks.py run once under Triton's interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    script = REPO / "tests" / "gated_norm_checks.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "nemotron_h"])
def test_the_kernel_computes_the_modules_output_and_gradients_in_float32(interpreted, family):
    """Against the module's own forward and autograd backward on random inputs (sizes that are no powers of two;
    Nemotron-H's normalises three groups per row, gate first): output, input, gate and weight gradients."""
    result = interpreted["norms"][family]
    assert result["dtypes_match"] == [True] * 4
    for name, difference in result["fused_vs_module"].items():
        assert difference < 1e-5, (name, result)  # values and gradients are of order 1-10
        # and as close to the exact (float64) answer as the module itself
        assert result["fused_error"][name] < 3 * result["module_error"][name] + 1e-7, (name, result)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_the_key_swaps_exactly_the_gated_norms_and_keeps_logits_and_gradients(interpreted, family):
    """A tiny Qwen3.5 (GatedDeltaNet) and a tiny Nemotron-H (Mamba2): only each gated norm gets a forward of its
    own, and the model's logits, loss and parameter gradients are the unfused model's."""
    result = interpreted["models"][family]
    assert result["fused"] == result["gated_norms"] and len(result["fused"]) == 1
    assert result["changed"] == [f"{name}.forward" for name in result["gated_norms"]]
    assert result["forwards_are_bound_methods"]
    assert result["bystander_forwards"] == []  # a model of the same class built beside it keeps the stock norms
    assert result["logits_difference"] < 1e-5 * max(1.0, result["logits_scale"])
    assert result["loss_difference"] < 1e-5
    assert result["worst_grad_difference"] < 1e-5
    assert result["same_gradient_names"]


def test_fusing_changes_no_class_nor_modeling_module_and_no_other_model():
    qwen_norm = vars(modeling_qwen3_5.Qwen3_5RMSNormGated).copy()
    nemotron_class = installed_class(KINDS[2])  # its name differs between transformers releases
    nemotron_norm = vars(nemotron_class).copy()
    qwen_globals, nemotron_globals = dict(vars(modeling_qwen3_5)), dict(vars(modeling_nemotron_h))
    models = tiny_models()
    for model in models.values():
        fuse_gated_norms(model)
    assert dict(vars(modeling_qwen3_5.Qwen3_5RMSNormGated)) == qwen_norm
    assert dict(vars(nemotron_class)) == nemotron_norm
    assert all(vars(modeling_qwen3_5)[k] is v for k, v in qwen_globals.items())
    assert all(vars(modeling_nemotron_h)[k] is v for k, v in nemotron_globals.items())
    for model in tiny_models().values():  # built after the fused ones
        assert not [n for n, m in model.named_modules() if "forward" in vars(m)]


def test_a_family_without_gated_norms_is_refused_by_name():
    from transformers import AutoModelForCausalLM

    from hellbender.models.tiny import tiny_model_dir

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("hellbender/tiny-llama"))
    with pytest.raises(ConfigError, match=r"`liger_rms_norm_gated: true`, but this LlamaForCausalLM \(`model_type: "):
        fuse_gated_norms(model)
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]


def test_nemotron_h_with_mamba_ssm_is_refused_because_its_fused_scan_skips_the_norm(monkeypatch):
    """With mamba-ssm, Nemotron-H's mixers compute the gated norm inside the fused scan in training: the key would do
    nothing there."""
    real = gated_norms.importlib.util.find_spec
    monkeypatch.setattr(
        gated_norms.importlib.util, "find_spec", lambda name, *a: object() if name == "mamba_ssm" else real(name, *a)
    )
    models = tiny_models()
    with pytest.raises(ConfigError, match=r"`liger_rms_norm_gated: true`, but `mamba-ssm` is installed"):
        fuse_gated_norms(models["nemotron_h"])
    assert fuse_gated_norms(models["qwen3_5"]) == ["model.layers.0.linear_attn.norm"]  # Qwen3.5 does not use it


def test_a_module_that_breaks_the_kernels_contract_is_refused():
    model = tiny_models()["nemotron_h"]
    model.model.layers[0].mixer.norm.group_size = 7  # does not divide the 64 channels
    with pytest.raises(EnvironmentProblem, match=r"`liger_rms_norm_gated`: `model.layers.0.mixer.norm` .*`group_size`"):
        fuse_gated_norms(model)
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]


def test_without_cuda_the_key_is_refused_before_training(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EnvironmentProblem, match=r"`liger_rms_norm_gated` is a Triton kernel and needs a CUDA GPU"):
        apply_gated_norm_kernel(SimpleNamespace(liger_rms_norm_gated=True), tiny_models()["qwen3_5"])
    assert apply_gated_norm_kernel(SimpleNamespace(liger_rms_norm_gated=False), object()) == []


def test_the_key_is_off_by_default_and_read_from_axolotl_configs(tmp_path):
    assert validate_config(base_config(tmp_path)).liger_rms_norm_gated is False
    cfg = validate_config(base_config(tmp_path, **{KEY: True}))
    assert cfg.liger_rms_norm_gated is True
    with pytest.raises(ConfigError, match="liger_rms_norm_gated"):  # a Triton kernel: not compiled yet either
        validate_config(base_config(tmp_path, liger_rms_norm_gated=True, torch_compile=True))


def test_training_applies_the_key_through_the_model_stack(tmp_path, monkeypatch):
    """`build_trainable_model` calls the kernel's entry point with the run's config; on this CPU machine that ends in
    the CUDA refusal, for a family with gated norms or not."""
    from hellbender.models.loading import load_tokenizer_and_processor
    from hellbender.models.stack import build_trainable_model

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = validate_config(base_config(tmp_path, liger_rms_norm_gated=True))
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    with pytest.raises(EnvironmentProblem, match=r"`liger_rms_norm_gated` is a Triton kernel"):
        build_trainable_model(cfg, tokenizer)
