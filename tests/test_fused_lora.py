"""The fused LoRA computation (`lora_qkv_kernel`, `lora_o_kernel`, `lora_mlp_kernel`; models/fused_lora.py): the same
outputs, gradients and adapter files as PEFT's layers, PEFT's forward wherever the layer is not plain LoRA, and the
keys refused where the fused path could not run."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.models.fused_lora import (
    KERNEL_PROJECTIONS,
    FusedLora,
    FusedLoraLinear,
    LoraLinearFunction,
    enable_lora_kernels,
    register_fused_lora,
)
from tests.helpers import base_config, logged_losses

EVERY_PROJECTION = [p for projections in KERNEL_PROJECTIONS.values() for p in projections]


def tiny_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype)


def adapted(base: LlamaForCausalLM, keys: list[str], **lora: object) -> torch.nn.Module:
    """`base` with LoRA on every projection (B not zero, so the update shows), fused for `keys`."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=EVERY_PROJECTION, init_lora_weights=False, **lora)
    if keys:
        register_fused_lora(config)
    torch.manual_seed(1)
    model = get_peft_model(copy.deepcopy(base), config)
    if keys:
        enable_lora_kernels(model, keys)
    return model


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))


def test_fused_layers_compute_peft_loras_loss_and_gradients_in_float64():
    base = tiny_llama(torch.float64)
    plain_loss, plain_grads = loss_and_grads(adapted(base, []), IDS)
    fused = adapted(base, list(KERNEL_PROJECTIONS))
    assert sum(isinstance(m, FusedLoraLinear) and m.fused for m in fused.modules()) == 14
    fused_loss, fused_grads = loss_and_grads(fused, IDS)
    assert fused_loss.item() == pytest.approx(plain_loss.item(), abs=1e-12)
    assert plain_grads.keys() == fused_grads.keys() and len(plain_grads) == 28
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)
    # The comparison can fail: without the adapter's update the loss is another one.
    with fused.disable_adapter():
        assert abs(fused(input_ids=IDS, labels=IDS).loss.item() - plain_loss.item()) > 1e-3


def test_the_function_with_a_bias_and_float32_adapter_under_bfloat16_matches_the_unfused_sum():
    torch.manual_seed(3)
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16, requires_grad=True)
    weight, bias = torch.randn(48, 32, dtype=torch.bfloat16), torch.randn(48, dtype=torch.bfloat16)
    a = torch.randn(4, 32, requires_grad=True)  # PEFT keeps the adapter in float32 over a bf16 base
    b = torch.randn(48, 4, requires_grad=True)
    out = LoraLinearFunction.apply(x, weight, bias, a, b, 2.0, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5, 48)
    out.float().square().sum().backward()
    fused = (out.detach().float(), x.grad.float(), a.grad, b.grad)
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    x.grad = a.grad = b.grad = None
    x64, a64, b64 = (t.detach().double().requires_grad_() for t in (x, a, b))
    reference = x64 @ weight.double().t() + bias.double() + 2.0 * (x64 @ a64.t()) @ b64.t()
    reference.square().sum().backward()
    for got, want in zip(fused, (reference.detach(), x64.grad, a64.grad, b64.grad), strict=True):
        scale = want.abs().max().item()
        assert (got.double() - want).abs().max().item() < 0.02 * scale  # bf16 rounding, relative to the size


def quantized_to_4bit(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """`model` with every projection a bitsandbytes NF4 layer (QLoRA's base), quantized on the CPU."""
    bnb = pytest.importorskip("bitsandbytes")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in EVERY_PROJECTION:
                four_bit = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, quant_type="nf4")
                four_bit.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4")
                setattr(module, name, four_bit.to("cpu"))  # moving the weight quantizes it
    return model


def test_fused_layers_over_a_4bit_base_compute_pefts_qlora_loss_and_gradients():
    """QLoRA: the fused function dequantizes the NF4 weight for its matmuls (forward and backward) as bitsandbytes'
    own matmul does; float32 on the CPU, so the two agree to float32's rounding."""
    base = quantized_to_4bit(tiny_llama(torch.float32))
    plain = adapted(base, [])
    fused = adapted(base, list(KERNEL_PROJECTIONS))
    layers = [m for m in fused.modules() if isinstance(m, FusedLora)]
    assert len(layers) == 14 and all(m.fused and type(m).__name__ == "FusedLoraLinear4bit" for m in layers)
    plain_loss, plain_grads = loss_and_grads(plain, IDS)
    fused_loss, fused_grads = loss_and_grads(fused, IDS)
    assert fused_loss.item() == pytest.approx(plain_loss.item(), rel=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # The 4-bit rounding is in both: the unquantized model's loss is another one.
    assert abs(loss_and_grads(adapted(tiny_llama(torch.float32), []), IDS)[0].item() - plain_loss.item()) > 1e-4


def test_layers_that_are_not_plain_lora_run_pefts_forward():
    base = tiny_llama(torch.float32)
    plain, fused = adapted(base, []), adapted(base, list(KERNEL_PROJECTIONS))
    with torch.no_grad():
        with plain.disable_adapter(), fused.disable_adapter():  # adapters off
            assert torch.equal(plain(input_ids=IDS).logits, fused(input_ids=IDS).logits)
        plain.merge_adapter()
        fused.merge_adapter()  # merged: the base layer alone
        assert torch.equal(plain(input_ids=IDS).logits, fused(input_ids=IDS).logits)
    layer = next(m for m in fused.modules() if isinstance(m, FusedLoraLinear))
    assert layer._fused_adapter((), {"adapter_names": ["default"]}) is None  # mixed-adapter batches: PEFT's path
    dropped = adapted(base, ["lora_o_kernel"], lora_dropout=0.5)
    o_proj = next(m for n, m in dropped.named_modules() if n.endswith("o_proj") and isinstance(m, FusedLoraLinear))
    assert o_proj.fused and o_proj._fused_adapter((), {}) is None  # dropout: PEFT's path


def test_an_adapter_trained_fused_saves_as_plain_peft_and_loads_there(tmp_path):
    base = tiny_llama(torch.float32)
    fused = adapted(base, ["lora_qkv_kernel", "lora_mlp_kernel"])
    fused.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter")
    assert not any(isinstance(m, FusedLoraLinear) for m in loaded.modules())
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, fused(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)


def test_a_compiled_checkpointed_layer_runs_pefts_ops_in_one_graph():
    """Under `torch.compile` the layer runs PEFT's plain ops, which the compiler fuses and, inside a checkpoint,
    recomputes (the autograd function's saved tensors would be kept instead); dynamo traces it whole (`fullgraph`)
    and the compiled gradients are the eager fused ones."""
    from torch.utils.checkpoint import checkpoint

    model = adapted(tiny_llama(torch.float32), list(KERNEL_PROJECTIONS))
    layer = model.base_model.model.model.layers[0]
    rotary = model.base_model.model.model.rotary_emb
    hidden = torch.randn(2, 16, 64, requires_grad=True)
    positions = rotary(hidden, torch.arange(16)[None])
    graphs = []

    def recording(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        bodies = [m.graph for m in graph_module.modules() if isinstance(m, torch.fx.GraphModule)]  # + checkpoint's
        graphs.append("\n".join(map(str, bodies)))
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda gm, _: gm)(graph_module, example_inputs)

    def run(h: torch.Tensor) -> torch.Tensor:
        return checkpoint(layer, h, position_embeddings=positions, use_reentrant=False)

    grads = []
    for call in (run, torch.compile(run, backend=recording, fullgraph=True)):
        layer.zero_grad()
        call(hidden).square().sum().backward()
        grads.append(layer.self_attn.q_proj.lora_A["default"].weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0])
    assert len(graphs) == 1 and "checkpoint" in graphs[0]
    assert "autograd_function_apply" not in graphs[0] and "LoraLinearFunction" not in graphs[0]


def test_a_run_with_every_kernel_key_logs_the_losses_of_one_without(tmp_path, caplog):
    from hellbender.train.run import train

    runs = {}
    for name, keys in (("plain", {}), ("fused", dict.fromkeys(KERNEL_PROJECTIONS, True))):
        cfg = base_config(tmp_path / name, adapter="lora", lora_target_linear=True, lora_r=4, max_steps=3, **keys)
        with caplog.at_level(logging.INFO, logger="hellbender"):
            train(validate_config(cfg))
        runs[name] = logged_losses(cfg["output_dir"])
    assert "LoRA kernels: lora_qkv_kernel on 6 layers, lora_o_kernel on 2 layers, lora_mlp_kernel on 6" in caplog.text
    assert len(runs["plain"]) == 3
    assert runs["fused"] == pytest.approx(runs["plain"], rel=1e-4)


LORA = dict(adapter="lora", lora_target_linear=True)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"lora_mlp_kernel": True}, r"`lora_mlp_kernel` set but `adapter` is not"),
        ({**LORA, "lora_qkv_kernel": True, "lora_dropout": 0.05}, r"`lora_dropout: 0.05`: the fused LoRA"),
        ({**LORA, "lora_o_kernel": True, "peft_use_dora": True}, r"`peft_use_dora: true`: the fused computation"),
        ({**LORA, "load_in_8bit": True, "lora_mlp_kernel": True}, r"with `load_in_8bit: true`: the fused LoRA"),
        ({**LORA, "lora_mlp_kernel": True, "deepspeed": "deepspeed_configs/zero3.json"}, r"with DeepSpeed is not"),
        (
            {
                "adapter": "qlora",
                "load_in_4bit": True,
                "lora_target_linear": True,
                "lora_mlp_kernel": True,
                "fsdp_version": 2,
            },
            r"with FSDP2 over a 4-bit base is not supported yet",
        ),
    ],
)
def test_the_kernel_keys_are_refused_where_the_fused_path_cannot_run(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, **keys))


def test_kernel_keys_set_false_ask_for_nothing_even_without_an_adapter(tmp_path):
    cfg = validate_config(base_config(tmp_path, **dict.fromkeys(KERNEL_PROJECTIONS, False)))
    assert cfg.lora_kernels == []


def test_a_kernel_key_whose_projections_are_not_adapted_is_refused():
    model = adapted(tiny_llama(torch.float32), [])
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    register_fused_lora(config)
    only_attention = get_peft_model(tiny_llama(torch.float32), config)
    with pytest.raises(ConfigError, match=r"`lora_mlp_kernel: true` fuses LoRA on `gate_proj`.*q_proj, v_proj"):
        enable_lora_kernels(only_attention, ["lora_mlp_kernel"])
    assert not any(isinstance(m, FusedLoraLinear) for m in model.modules())  # no key, PEFT's own layers
