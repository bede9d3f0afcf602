"""Fused kernels are refused clearly where they cannot run, and change the model they are applied to and nothing
else (CPU checks; Liger's kernels are Triton kernels, so their numerics are GPU tests).

Liger patches transformers' modeling modules for the whole process on the way; the tests here build a model after
a fused one and check that it is stock: its classes, its forwards, transformers' module globals and class
attributes, and its logits (equal to those of a model built before anything was patched).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.gemma4 import modeling_gemma4
from transformers.models.llama import modeling_llama

from hellbender.config import validate_config
from hellbender.errors import ConfigError, EnvironmentProblem
from hellbender.models.kernels import LIGER_ARGUMENTS, fuse, requested_liger_keys
from hellbender.models.one_model_patch import CannotScope, patch_one_model
from hellbender.models.tiny import tiny_model_dir
from hellbender.train.run import train
from tests.helpers import base_config

needs_liger = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is missing")
IDS = torch.randint(10, 200, (2, 24), generator=torch.Generator().manual_seed(0))


def load(name: str = "hellbender/tiny-llama") -> Any:
    auto = AutoModelForImageTextToText if name.endswith("-vlm") or "llava" in name else AutoModelForCausalLM
    return auto.from_pretrained(tiny_model_dir(name)).eval()


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def namespaces(module: Any) -> dict[Any, dict[str, Any]]:
    """A modeling module's globals and the attributes of every class it defines (shallow: compared by identity)."""
    state = {module: dict(vars(module))}
    for value in vars(module).values():
        if isinstance(value, type) and value.__module__ == module.__name__:
            state[value] = dict(vars(value))
    return state


def assert_unchanged(before: dict[Any, dict[str, Any]]) -> None:
    for owner, attributes in before.items():
        now = dict(vars(owner))
        changed = {k for k in set(attributes) | set(now) if attributes.get(k) is not now.get(k)}
        assert not changed, (owner, changed)


def assert_stock(model: Any) -> None:
    """Every module is transformers' or torch's own class with the class's own methods."""
    for name, module in model.named_modules():
        assert type(module).__module__.startswith(("transformers.", "torch.")), (name, type(module))
        overridden = {k for k, v in vars(module).items() if callable(v) and not isinstance(v, torch.nn.Module)}
        assert not overridden - {"act"}, (name, overridden)  # (`act`: transformers' activations keep a function)


def test_every_liger_key_is_a_config_key_and_off_by_default(tmp_path):
    cfg = validate_config(base_config(tmp_path))
    assert requested_liger_keys(cfg) == []
    assert all(getattr(cfg, key) is False for key in LIGER_ARGUMENTS)
    assert cfg.fuses_the_loss is False


def test_liger_keys_without_the_package_are_a_clear_error_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # as if not installed
    cfg = validate_config(base_config(tmp_path, liger_rms_norm=True, liger_fused_linear_cross_entropy=True))
    with pytest.raises(
        EnvironmentProblem,
        match=r"`liger_rms_norm`, `liger_fused_linear_cross_entropy` need the `liger-kernel` package",
    ):
        train(cfg)
    assert not list((tmp_path / "out").glob("checkpoint-*"))


@needs_liger
@pytest.mark.parametrize(
    "family, module, keys",
    [
        ("hellbender/tiny-llama", modeling_llama, [k for k in LIGER_ARGUMENTS if k != "liger_layer_norm"]),
        (
            "hellbender/tiny-gemma4",
            modeling_gemma4,
            ["liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy"],
        ),
        (
            "hellbender/tiny-gemma4-vlm",
            modeling_gemma4,
            ["liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy"],
        ),
    ],
)
def test_a_model_built_after_a_fused_one_is_stock(family, module, keys):
    reference = logits(load(family))  # before anything was patched
    before = namespaces(module)
    fused = load(family)
    assert fuse(fused, keys) == keys
    assert_unchanged(before)
    later = load(family)
    assert_stock(later)
    assert torch.equal(logits(later), reference)
    assert sum("forward" in vars(m) for m in fused.modules()) > 1  # the fused model keeps its kernels


@needs_liger
def test_the_fused_model_has_every_kernel_on_its_own_modules():
    from liger_kernel.transformers.model.llama import lce_forward
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    model = load()
    fuse(model, ["liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy"])
    assert model.forward.__func__ is lce_forward
    norms = [m for m in model.modules() if isinstance(m, modeling_llama.LlamaRMSNorm)]
    assert norms and all(m.forward.__func__ is LigerRMSNorm.forward for m in norms)
    mlps = [m for m in model.modules() if isinstance(m, modeling_llama.LlamaMLP)]
    assert mlps and all(m.forward.__func__ is LigerSwiGLUMLP.forward for m in mlps)
    attentions = [m for m in model.modules() if isinstance(m, modeling_llama.LlamaAttention)]
    for attention in attentions:
        # The attention forward reads the RoPE function by global name; this model's copy reads Liger's.
        forward = attention.forward.__func__
        while forward.__globals__.get("apply_rotary_pos_emb") is None:
            forward = forward.__wrapped__
        assert forward.__globals__["apply_rotary_pos_emb"] is liger_rotary_pos_emb
    assert modeling_llama.apply_rotary_pos_emb is not liger_rotary_pos_emb
    assert modeling_llama.LlamaAttention.forward is not attentions[0].forward.__func__


@needs_liger
def test_a_key_liger_applies_as_a_no_op_is_refused_by_name():
    """Liger 0.8.5 only logs a warning for `rope=True` on Gemma 4."""
    with pytest.raises(ConfigError, match=r"`liger_rope: true`, but Liger's kernels for gemma4_text change nothing"):
        fuse(load("hellbender/tiny-gemma4"), ["liger_rope"])


@needs_liger
def test_a_key_the_familys_entry_point_does_not_take_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"`liger_rms_norm: true`, but Liger's kernels for llava do not include it"):
        fuse(load("hellbender/tiny-llava"), ["liger_rms_norm"])


@needs_liger
def test_every_switch_not_requested_is_passed_off_and_a_failing_entry_point_is_refused(monkeypatch):
    from liger_kernel.transformers import monkey_patch

    calls = []

    def entry_point(rope=True, rms_norm=True, relu_squared=True, cross_entropy=True, model=None):
        calls.append(dict(rope=rope, rms_norm=rms_norm, relu_squared=relu_squared, cross_entropy=cross_entropy))
        raise ImportError("cannot import name 'SomethingRenamed'")

    monkeypatch.setitem(monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN, "llama", entry_point)
    with pytest.raises(EnvironmentProblem, match=r"failed to apply `liger_rms_norm` \(ImportError: .*SomethingRenamed"):
        fuse(load(), ["liger_rms_norm"])
    assert calls == [dict(rope=False, rms_norm=True, relu_squared=False, cross_entropy=False)]


# The mechanism, with stand-in patches that run on CPU: what a patch does to transformers reaches this model only.


def test_a_replaced_module_function_reaches_the_patched_model_only():
    stock = modeling_llama.rotate_half
    calls = []

    def counted(x):
        calls.append(1)
        return stock(x)

    reference = logits(load())
    model = load()
    # `rotate_half` is read by `apply_rotary_pos_emb` (a module function), which the attention's forward reads.
    changed = patch_one_model(model, lambda: setattr(modeling_llama, "rotate_half", counted), library="tests")
    assert modeling_llama.rotate_half is stock
    attentions = [n for n, m in model.named_modules() if isinstance(m, modeling_llama.LlamaAttention)]
    assert changed == [f"{name}.forward" for name in attentions]
    assert torch.equal(logits(model), reference)
    assert len(calls) == 2 * len(attentions)  # queries and keys, in every layer
    model.train()
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert len(calls) == 4 * len(attentions)
    later = load()
    assert_stock(later)
    assert torch.equal(logits(later), reference)
    assert len(calls) == 4 * len(attentions)


def test_a_replaced_class_method_is_moved_onto_the_patched_model():
    stock = modeling_llama.LlamaForCausalLM.forward
    calls = []

    def counted(self, *args, **kwargs):
        calls.append(self)
        return stock(self, *args, **kwargs)

    model = load()
    changed = patch_one_model(
        model, lambda: setattr(modeling_llama.LlamaForCausalLM, "forward", counted), library="tests"
    )
    assert modeling_llama.LlamaForCausalLM.forward is stock and changed == ["<model>.forward"]
    logits(model)
    later = load()
    logits(later)
    assert calls == [model]


def test_a_change_that_cannot_be_moved_onto_the_model_is_refused_and_undone():
    stock = modeling_llama.logger

    def patch():
        modeling_llama.logger = "not a logger"  # a module-level value, read by every model of the family

    with pytest.raises(CannotScope, match=r"`transformers\.models\.llama\.modeling_llama\.logger`"):
        patch_one_model(load(), patch, library="tests")
    assert modeling_llama.logger is stock


def test_a_failing_patch_is_undone():
    stock = modeling_llama.LlamaRMSNorm

    def patch():
        modeling_llama.LlamaRMSNorm = torch.nn.Identity
        raise RuntimeError("half-way")

    with pytest.raises(RuntimeError, match="half-way"):
        patch_one_model(load(), patch, library="tests")
    assert modeling_llama.LlamaRMSNorm is stock


def test_a_replaced_torch_function_is_refused_and_undone():
    """Read as an attribute (`nn.functional.cross_entropy`) from everywhere: it cannot be limited to one model."""
    stock = torch.nn.functional.cross_entropy

    def patch():
        torch.nn.functional.cross_entropy = lambda *args, **kwargs: stock(*args, **kwargs)

    with pytest.raises(CannotScope, match=r"`torch\.nn\.functional\.cross_entropy` \(a torch function\)"):
        patch_one_model(load(), patch, library="tests")
    assert torch.nn.functional.cross_entropy is stock


class RecordingLoss:
    """Stands in for Liger's autograd function (a Triton kernel): the loss in torch, and the chunk setting it got."""

    supports_inner_impl_dispatch = True
    chunk_mem_const: list[int] = []

    @staticmethod
    def apply(hidden, weight, target, *rest):
        RecordingLoss.chunk_mem_const.append(rest[-1])
        loss = torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), target, ignore_index=-100)
        return loss, None, None, None


@needs_liger
@pytest.mark.parametrize("name", ["hellbender/tiny-llama", "hellbender/tiny-gemma4"])
def test_the_chunk_scale_reaches_ligers_fused_loss_through_the_model_call(monkeypatch, name):
    """`fused_cross_entropy_chunk_scale`: the model's call hands `chunk_mem_const` to Liger's loss (through Liger's own
    forward and loss function, with the kernel replaced by a torch stand-in); without the key Liger's default."""
    from liger_kernel.transformers import functional

    from hellbender.models.kernels import size_loss_chunks

    monkeypatch.setattr(functional, "LigerFusedLinearCrossEntropyFunction", RecordingLoss)
    monkeypatch.setattr(RecordingLoss, "chunk_mem_const", [])
    model = load(name)
    fuse(model, ["liger_fused_linear_cross_entropy"])
    model.train()
    model(input_ids=IDS, labels=IDS)
    size_loss_chunks(model, 4)
    loss = model(input_ids=IDS, labels=IDS).loss
    assert RecordingLoss.chunk_mem_const == [1, 4] and torch.isfinite(loss)


@needs_liger
def test_the_chunk_scale_is_refused_where_it_would_do_nothing(tmp_path):
    from hellbender.models.kernels import size_loss_chunks

    with pytest.raises(ConfigError, match="fused_cross_entropy_chunk_scale` sizes the chunks"):
        validate_config(base_config(tmp_path, fused_cross_entropy_chunk_scale=4))
    model = load("hellbender/tiny-llava")
    with pytest.raises(ConfigError, match="not checked for `model_type: llava`"):
        size_loss_chunks(model, 4)
