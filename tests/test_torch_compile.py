"""`torch_compile` with activation checkpointing: each layer's checkpoint call is compiled (regional compilation), and
the compiled model computes what the uncompiled checkpointed one does. On CPU with the `aot_eager` backend: dynamo
and AOT autograd, which choose what the compiled layers save for backward, without inductor's slow C++ builds (the
inductor run on CUDA is in tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

from hellbender.config import validate_config
from hellbender.models.activation_checkpointing import enable_activation_checkpointing, offloader_of
from hellbender.train.arguments import trainer_compile_arguments
from hellbender.train.run import train
from tests.helpers import base_config, logged_losses

LAYERS = 4
# The second batch is shorter: dynamo compiles the layers again with a dynamic length, as the Trainer's batches do.
BATCHES = [torch.randint(10, 200, (2, n), generator=torch.Generator().manual_seed(i)) for i, n in enumerate((40, 33))]


def tiny_llama(adapter: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).train()
    if adapter:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # non-zero, so every LoRA matrix has a gradient from the first step
                torch.nn.init.normal_(parameter, std=0.02)
    return model


def steps(model: torch.nn.Module) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Loss and gradients of a forward and backward on each batch."""
    results = []
    for ids in BATCHES:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        model.zero_grad()
    return results


def checkpointed(adapter: bool, mode: str, backend: CompileCounterWithBackend | None) -> torch.nn.Module:
    model = tiny_llama(adapter)
    enable_activation_checkpointing(
        model,
        offload=mode == "offload",
        layers=2 if mode == "partial" else None,
        compile_options=None if backend is None else {"backend": backend},
        offload_layers=2 if mode == "offload-layers" else 0,
    )
    if (offloader := offloader_of(model)) is not None:
        offloader.offload_host_tensors, offloader.min_bytes = True, 0  # park every saved tensor, even on CPU
    return model


# Each case compiles twice (several seconds on CPU), so not every pairing is run.
@pytest.mark.parametrize(
    ("mode", "adapter"),
    [("checkpoint", True), ("checkpoint", False), ("offload", True), ("partial", False), ("offload-layers", True)],
    ids=["lora", "full", "offload-lora", "partial-full", "offload-layers-lora"],
)
def test_compiled_checkpointed_layers_give_the_uncompiled_losses_and_gradients(adapter, mode):
    """Every layer shares one compiled checkpoint call (compiled twice: a static length, then a dynamic one), traced
    whole (no graph break), and losses and gradients equal the uncompiled checkpointed model's. With an adapter the
    first layer's input needs no gradient (the embeddings are frozen) while the others' do, so that call is compiled
    for both (two more compilations). With `gradient_checkpointing_layers: 2` the two unchecked layers are compiled as
    modules (two more). With `activation_offload_layers: 2` layers 0 and 2 run a compiled plain call instead (layer 0
    without, layer 2 with an input gradient: four compilations beside the checkpointed layers' two), and what they
    save for backward goes through the offloader."""
    expected = steps(checkpointed(adapter, mode, None))
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    model = checkpointed(adapter, mode, backend)
    got = steps(model)
    assert backend.frame_count == {"offload-layers": 6}.get(mode, 4 if mode == "partial" or adapter else 2)
    assert not counters["graph_break"], dict(counters["graph_break"])
    if mode in ("offload", "offload-layers"):
        groups = offloader_of(model)._groups
        assert any(g.entries for g in groups), "the compiled layers' saved tensors did not go through the offloader"
    for (loss, grads), (expected_loss, expected_grads) in zip(got, expected, strict=True):
        assert loss == pytest.approx(expected_loss, rel=1e-6)
        assert grads.keys() == expected_grads.keys()
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_the_trainer_compiles_the_whole_model_only_without_checkpointing(tmp_path):
    compiled = dict(torch_compile=True, torch_compile_backend="aot_eager")
    assert trainer_compile_arguments(validate_config(base_config(tmp_path, **compiled))) == {
        "torch_compile": True,
        "torch_compile_backend": "aot_eager",
        "torch_compile_mode": "default",
    }
    for checkpointing in (True, "offload"):
        cfg = validate_config(base_config(tmp_path, gradient_checkpointing=checkpointing, **compiled))
        assert cfg.compiles_layers
        assert trainer_compile_arguments(cfg) == {"torch_compile": False}
    # A backend alone would turn the Trainer's compilation on.
    assert trainer_compile_arguments(validate_config(base_config(tmp_path, torch_compile_backend="aot_eager"))) == {
        "torch_compile": False
    }


def test_torch_compile_with_checkpointing_trains_to_the_uncompiled_losses(tmp_path):
    """The whole path: the layers are compiled as the model is built, the Trainer leaves the model uncompiled, and
    the logged losses equal the uncompiled checkpointed run's."""
    common = dict(adapter="lora", lora_target_linear=True, lora_dropout=0.0, max_steps=3, gradient_checkpointing=True)
    eager = validate_config(base_config(tmp_path / "eager", **common))
    compiled = validate_config(
        base_config(tmp_path / "compiled", torch_compile=True, torch_compile_backend="aot_eager", **common)
    )
    seen = {}

    class Inspect(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["whole_model_compiled"] = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)

    train(eager)
    torch._dynamo.reset()
    counters.clear()
    train(compiled, callbacks=[Inspect()])
    assert seen == {"whole_model_compiled": False}
    assert counters["frames"]["ok"] > 0 and not counters["graph_break"]
    expected, got = logged_losses(eager.output_dir), logged_losses(compiled.output_dir)
    assert expected.keys() == got.keys() == {1, 2, 3}
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (step, got, expected)


def test_liger_fused_cross_entropy_combines_with_compiled_layers_only(tmp_path):
    """Compiled layers leave the model's loss uncompiled, so Liger's fused linear cross-entropy (in the model's
    forward after the layers) is accepted with them; compiling the whole model (no checkpointing) with it, or any of
    Liger's layer kernels with compiled layers, stays refused."""
    from hellbender.errors import ConfigError

    fused = dict(torch_compile=True, liger_fused_linear_cross_entropy=True)
    cfg = validate_config(base_config(tmp_path, gradient_checkpointing=True, **fused))
    assert cfg.compiles_layers and cfg.liger_fused_linear_cross_entropy
    with pytest.raises(ConfigError, match=r"`torch_compile: true` with Liger's kernels \(`liger_fused_linear_cross"):
        validate_config(base_config(tmp_path, gradient_checkpointing=False, **fused))
    with pytest.raises(ConfigError, match=r"Liger's kernels \(`liger_rms_norm`\)"):
        validate_config(base_config(tmp_path, gradient_checkpointing=True, **fused, liger_rms_norm=True))
