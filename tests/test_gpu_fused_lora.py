"""The fused LoRA layers (`lora_*_kernel`) in bf16 on a GPU: the tiny model trains to PEFT's losses (LoRA and
QLoRA), and one layer of the Llama-3-8B shape gives PEFT's gradients within bf16 rounding; the same layer compiled as
the 8B recipe compiles it gives the eager layer's (run through the device machine; skipped without CUDA)."""

from __future__ import annotations

import pytest

from hellbender.config import validate_config
from hellbender.models.fused_lora import KERNEL_PROJECTIONS, FusedLora
from hellbender.train.run import train
from tests.helpers import base_config, logged_losses

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("adapter", "checkpointing"), [("lora", False), ("lora", True), ("qlora", True)], ids=["lora", "lora-ckpt", "qlora"]
)
def test_fused_lora_layers_train_the_tiny_model_to_pefts_losses_in_bf16(tmp_path, adapter, checkpointing):
    from transformers import TrainerCallback

    if adapter == "qlora":
        pytest.importorskip("bitsandbytes")
    common = dict(
        adapter=adapter, lora_target_linear=True, lora_dropout=0.0, bf16=True, max_steps=8, learning_rate=1e-2,
        gradient_checkpointing=checkpointing,
    )  # fmt: skip
    seen = {}

    class Inspect(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["fused"] = sum(isinstance(m, FusedLora) and m.fused for m in model.modules())

    plain = validate_config(base_config(tmp_path / "plain", **common))
    fused = validate_config(base_config(tmp_path / "fused", **common, **dict.fromkeys(KERNEL_PROJECTIONS, True)))
    train(plain)
    train(fused, callbacks=[Inspect()])
    assert seen["fused"] == 14  # the tiny Llama's two layers, seven projections each
    expected, got = logged_losses(plain.output_dir), logged_losses(fused.output_dir)
    assert expected.keys() == got.keys() and len(expected) == 8
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=3e-2), (step, got, expected)
    assert expected[8] < expected[1]


def bench_lora_kernels():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import lora_kernels

    return lora_kernels


def test_one_8b_shape_layer_gives_pefts_gradients_within_bf16_rounding():
    lora_kernels = bench_lora_kernels()
    results = {fused: lora_kernels.measure(fused, "eager", tokens=2048, iters=1) for fused in (False, True)}
    for kind in ("lora_A", "lora_B", "input"):
        difference = lora_kernels.relative_difference(results[True]["grads"], results[False]["grads"], kind)
        assert 0 < difference < 3e-2, kind  # rounded differently, and only by bf16's rounding
    assert results[True]["saved_gib"] <= results[False]["saved_gib"]


@pytest.mark.parametrize(
    ("mode", "budget", "compile_mode"),
    [("compiled checkpointed", 1.0, None), ("compiled", 0.8, "max-autotune-no-cudagraphs")],
    ids=["checkpointed", "budget-0.8-autotuned"],
)
def test_one_8b_shape_compiled_layer_gives_the_eager_gradients_within_bf16_rounding(mode, budget, compile_mode):
    """The 8B LoRA recipe's compiled layer on one layer of the Llama-3-8B shape (PEFT's LoRA r16 on the seven
    projections, 2,048 tokens): inductor's code, checkpointed, or under `activation_memory_budget: 0.8` with
    `torch_compile_mode: max-autotune-no-cudagraphs` (Triton matmuls where they win), gives the eager layer's LoRA and
    input gradients within bf16 rounding."""
    import torch
    import torch._functorch.config as functorch_config

    lora_kernels = bench_lora_kernels()
    eager = lora_kernels.measure(False, "eager", tokens=2048, iters=1)
    torch._dynamo.reset()
    with functorch_config.patch(activation_memory_budget=budget):
        compiled = lora_kernels.measure(False, mode, tokens=2048, iters=1, compile_mode=compile_mode)
    for kind in ("lora_A", "lora_B", "input"):
        difference = lora_kernels.relative_difference(compiled["grads"], eager["grads"], kind)
        assert difference < 3e-2, (kind, difference)
    if budget < 1:
        assert compiled["saved_gib"] < eager["saved_gib"]
