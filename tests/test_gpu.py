"""GPU-only paths (run through the device machine; skipped without CUDA)."""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.train.run import train
from tests.helpers import base_config, logged_losses

pytestmark = pytest.mark.gpu


def test_qlora_trains_a_4bit_base_and_saves_a_loadable_adapter(tmp_path, tiny_model_path):
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = validate_config(
        base_config(
            tmp_path,
            adapter="qlora",
            lora_target_linear=True,
            lora_r=16,
            bf16=True,
            sample_packing=True,
            max_steps=30,
            learning_rate=1e-2,
            gradient_checkpointing=True,
        )
    )
    assert cfg.load_in_4bit
    seen = {}

    from transformers import TrainerCallback

    class Inspect(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            import bitsandbytes as bnb

            seen["4bit_layers"] = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
            seen["frozen_dtypes"] = {
                p.dtype for p in model.parameters() if not p.requires_grad and p.__class__.__name__ != "Params4bit"
            }

    train(cfg, callbacks=[Inspect()])
    assert seen["4bit_layers"] > 0
    # Embeddings, head and norms stay in the run's dtype (no float32 upcast of the unquantized weights).
    assert seen["frozen_dtypes"] == {torch.bfloat16}
    losses = list(logged_losses(cfg.output_dir).values())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16, device_map="cuda")
    model = PeftModel.from_pretrained(base, Path(cfg.output_dir))
    ids = torch.tensor([[5, 6, 7, 8]], device="cuda")
    assert torch.isfinite(model(ids).logits).all()


def test_bnb_config_kwargs_choose_the_4bit_data_type_of_the_loaded_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    from hellbender.models.loading import load_model, load_tokenizer

    keys = dict(adapter="qlora", bf16=True, bnb_config_kwargs={"bnb_4bit_quant_type": "fp4"})
    cfg = validate_config(base_config(tmp_path, **keys))
    model = load_model(cfg, load_tokenizer(cfg))
    states = {
        m.weight.quant_state.quant_type for m in model.modules() if hasattr(getattr(m, "weight", None), "quant_state")
    }
    assert states == {"fp4"}


def test_8bit_lora_trains_an_int8_base_and_saves_a_loadable_adapter(tmp_path, tiny_model_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, TrainerCallback

    cfg = validate_config(
        base_config(
            tmp_path,
            adapter="lora",
            load_in_8bit=True,
            lora_target_linear=True,
            lora_r=16,
            bf16=True,
            max_steps=30,
            learning_rate=1e-2,
            gradient_checkpointing=True,
        )
    )
    seen = {}

    class Inspect(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["8bit_layers"] = sum(isinstance(m, bnb.nn.Linear8bitLt) for m in model.modules())

    train(cfg, callbacks=[Inspect()])
    assert seen["8bit_layers"] > 0
    losses = list(logged_losses(cfg.output_dir).values())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16, device_map="cuda")
    model = PeftModel.from_pretrained(base, Path(cfg.output_dir))
    assert torch.isfinite(model(torch.tensor([[5, 6, 7, 8]], device="cuda")).logits).all()


def test_bf16_lora_with_packing_on_gpu_matches_the_cpu_loss_scale(tmp_path):
    cfg = validate_config(
        base_config(tmp_path, adapter="lora", lora_target_linear=True, bf16="auto", sample_packing=True, max_steps=10)
    )
    train(cfg)
    losses = logged_losses(cfg.output_dir)
    assert sorted(losses) == list(range(1, 11))
    # The tiny model starts near ln(vocab) = ln(512) ~ 6.2 whatever the device.
    assert 5.0 < losses[1] < 7.5


@pytest.mark.parametrize("model", ["hellbender/tiny-gemma4-vlm", "hellbender/tiny-qwen2.5-vl"])
def test_vlm_lora_trains_in_bf16_with_activation_checkpointing_on_gpu(tmp_path, model):
    from tests.conftest import EXAMPLES

    cfg = validate_config(
        base_config(
            tmp_path,
            base_model=model,
            processor_type="AutoProcessor",
            datasets=[{"path": str(EXAMPLES / "data" / "shapes.jsonl"), "type": "chat_template"}],
            adapter="lora",
            lora_target_linear=True,
            bf16=True,
            gradient_checkpointing=True,
            sequence_len=512,
            max_steps=12,
            learning_rate=1e-2,
        )
    )
    train(cfg)
    losses = list(logged_losses(cfg.output_dir).values())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


def test_memory_watchdog_flags_a_gpu_leak_from_allocated_memory(tmp_path):
    from transformers import TrainerCallback

    from hellbender.train.memory_watchdog import MemoryLeak

    class KeepGpuTensors(TrainerCallback):
        kept: list = []

        def on_step_end(self, args, state, control, **kwargs):
            self.kept.append(torch.ones(8 * 1024 * 1024 // 4, device="cuda"))  # 8 MiB per step

    cfg = validate_config(base_config(tmp_path, max_steps=30, memory_watchdog="error", save_steps=1000))
    with pytest.raises(MemoryLeak, match=r"grows by (7\.\d|8\.\d) MiB per step \(allocated GPU memory") as caught:
        train(cfg, callbacks=[KeepGpuTensors()])
    assert re.search(r"held by the allocator: \d+ MiB, \+\d+\.\d MiB per step", str(caught.value))


def _attention_peak_mib(function, enable_gqa_baseline: bool = False) -> tuple[float, torch.Tensor]:
    """Peak memory above the inputs of one causal attention call, forward and backward, at Gemma 4's full-layer
    shape (8 query heads, 1 K/V head, head_dim 512) and 8k tokens, bf16."""
    from types import SimpleNamespace

    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 8, 8192, 512)
    query = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
    key, value = (
        torch.randn(1, 1, 8192, 512, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
        for _ in range(2)
    )
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    if enable_gqa_baseline:
        output = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        output = output.transpose(1, 2)
    else:
        module = SimpleNamespace(num_key_value_groups=8, is_causal=True, training=True)
        output, _ = function(module, query, key, value, None, scaling=None)
    output.float().sum().backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20, output.detach()


def test_head_dim_512_attention_at_8k_tokens_avoids_the_math_kernel():
    from hellbender.models.attention import large_head_sdpa

    ours, output = _attention_peak_mib(large_head_sdpa)
    baseline, expected = _attention_peak_mib(None, enable_gqa_baseline=True)
    # The math kernel holds the 8 x 8k x 8k scores (1 GiB in bf16, more for softmax and its gradient).
    assert baseline > 1024, baseline
    assert ours < 512, ours
    torch.testing.assert_close(output, expected, atol=2e-2, rtol=2e-2)


def test_offloaded_checkpointing_gives_the_same_gradients_on_gpu():
    """Through pinned slabs and the side stream, over two steps (the second reuses the first's slabs), with hidden
    states spanning several slabs; and with half the layers offloaded whole (`activation_offload_layers`) instead of
    checkpointed, Gemma 4's shared K/V among what they park."""
    from transformers import AutoModelForCausalLM

    from hellbender.models.activation_checkpointing import enable_activation_checkpointing, offloader_of
    from hellbender.models.tiny import tiny_model_dir

    batches = [torch.randint(10, 200, (2, 40), generator=torch.Generator().manual_seed(s)).cuda() for s in (0, 1)]

    def grads(mode: str | None) -> tuple[list[dict[str, torch.Tensor]], int]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("hellbender/tiny-gemma4"), dtype=torch.float32)
        model.cuda().train()
        if mode is not None:
            layers = model.config.get_text_config().num_hidden_layers
            offload_layers = layers // 2 if mode == "offload-layers" else 0
            enable_activation_checkpointing(model, offload=mode == "offload", offload_layers=offload_layers)
        offloader = offloader_of(model)
        if offloader is not None:
            offloader.slab_bytes, offloader.min_bytes = 4096, 0
        steps = []
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
            steps.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad()
        return steps, offloader.host_bytes if offloader is not None else 0

    (plain, _), (checkpointed, _), (offloaded, host_bytes) = grads(None), grads("checkpoint"), grads("offload")
    (offloaded_layers, layer_bytes) = grads("offload-layers")
    assert host_bytes > 0 and layer_bytes > host_bytes  # an offloaded layer parks all it saves, not only its inputs
    for step, expected in enumerate(plain):
        for name, grad in expected.items():
            torch.testing.assert_close(checkpointed[step][name], grad, atol=1e-6, rtol=1e-5, msg=name)
            torch.testing.assert_close(offloaded[step][name], grad, atol=1e-6, rtol=1e-5, msg=name)
            torch.testing.assert_close(offloaded_layers[step][name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family", ["hellbender/tiny-llama", "hellbender/tiny-gemma4"])
def test_each_liger_kernel_matches_the_unfused_loss_and_gradients_in_bf16(family):
    """Each kernel alone and all together against the unfused model; and a model built after them is unfused.
    In a subprocess, which keeps Triton's compiled kernels and CUDA state out of the test process."""
    import json
    import os
    import subprocess
    import sys

    from hellbender.models.tiny import tiny_model_dir

    pytest.importorskip("liger_kernel")
    script = Path(__file__).with_name("liger_numerics.py")
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir(family))], capture_output=True, text=True, env=os.environ
    )
    assert done.returncode == 0, done.stderr[-3000:]
    output = json.loads(done.stdout.strip().splitlines()[-1])
    results = output["runs"]
    assert "liger_fused_linear_cross_entropy" in results and "liger_rms_norm" in results
    # Liger 0.8.5 applies `rope` to Gemma 4 as a no-op (it only logs a warning), which hellbender refuses.
    assert set(output["refused"]) <= ({"liger_rope"} if family.endswith("gemma4") else set()), output["refused"]
    # A model built after the fused ones is stock (the script checks its modules) and computes the same loss.
    stock = results["unfused, built after the fused models"]
    assert stock["loss"] == pytest.approx(stock["reference_loss"], rel=1e-3), stock
    for keys, result in results.items():
        assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-2), keys
        assert result["worst_relative_grad_error"] < 3e-2, (keys, result)


def test_fused_cross_entropy_keeps_gradient_accumulation_exact(tmp_path):
    """Micro-batch 4 equals 2 x 2 accumulation with Liger's fused loss (which sees the accumulated token count)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("liger_kernel")
    script = Path(__file__).with_name("liger_numerics.py")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(script), "--accumulation", str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["max_weight_difference"] < 1e-5, result
    assert result["losses"][0] == pytest.approx(result["losses"][1], rel=1e-4), result


def test_torch_compile_trains_to_the_same_losses(tmp_path):
    """`torch_compile: true` (the Trainer compiles the model) gives the uncompiled run's losses within bf16
    tolerance."""
    common = dict(adapter="lora", lora_target_linear=True, lora_dropout=0.0, bf16=True, max_steps=6)
    eager = validate_config(base_config(tmp_path / "eager", **common))
    compiled = validate_config(base_config(tmp_path / "compiled", torch_compile=True, **common))
    train(eager)
    train(compiled)
    expected, got = logged_losses(eager.output_dir), logged_losses(compiled.output_dir)
    assert expected.keys() == got.keys()
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=3e-2), (step, got, expected)


def assert_compiled_layers_train_to_the_uncompiled_losses(
    tmp_path: Path, compiled_only: dict | None = None, **common
) -> None:
    """Train `common` uncompiled, then with `torch_compile: true` and `compiled_only` (each checkpointed layer
    compiled, not the whole model, no graph break); the losses agree within bf16 tolerance."""
    from torch._dynamo.utils import counters
    from transformers import TrainerCallback

    eager = validate_config(base_config(tmp_path / "eager", **common))
    compiled = validate_config(
        base_config(tmp_path / "compiled", torch_compile=True, **(compiled_only or {}), **common)
    )
    seen = {}

    class Inspect(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["trainer_compiles"] = args.torch_compile
            seen["whole_model_compiled"] = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)

    train(eager)
    torch._dynamo.reset()
    counters.clear()
    train(compiled, callbacks=[Inspect()])
    assert seen == {"trainer_compiles": False, "whole_model_compiled": False}
    assert counters["frames"]["ok"] > 0  # the layers did run compiled
    assert not counters["graph_break"], dict(counters["graph_break"])
    expected, got = logged_losses(eager.output_dir), logged_losses(compiled.output_dir)
    assert expected.keys() == got.keys()
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=3e-2), (step, got, expected)


@pytest.mark.parametrize("checkpointing", [True, "offload"])
@pytest.mark.parametrize("adapter", ["lora", None])
def test_torch_compile_with_activation_checkpointing_trains_to_the_uncompiled_losses(tmp_path, adapter, checkpointing):
    """`torch_compile: true` with checkpointing compiles each layer's checkpoint call with inductor (regional
    compilation): ten steps, over batches of several lengths (a dynamic-shape recompile included), give the
    uncompiled checkpointed run's losses within bf16 tolerance, with LoRA and full fine-tuning."""
    extra = dict(adapter="lora", lora_target_linear=True, lora_dropout=0.0) if adapter else dict(learning_rate=1e-3)
    assert_compiled_layers_train_to_the_uncompiled_losses(
        tmp_path, bf16=True, max_steps=10, gradient_checkpointing=checkpointing, **extra
    )


def test_compiled_layers_with_liger_fused_cross_entropy_train_to_the_uncompiled_losses(tmp_path):
    """Liger's fused linear cross-entropy runs in the model's forward after the layers, outside the compiled layer
    calls: with it, compiled checkpointed layers still give the uncompiled run's losses."""
    pytest.importorskip("liger_kernel")
    assert_compiled_layers_train_to_the_uncompiled_losses(
        tmp_path, bf16=True, max_steps=10, gradient_checkpointing=True, learning_rate=1e-3,
        liger_fused_linear_cross_entropy=True,
    )  # fmt: skip


def test_a_larger_fused_loss_chunk_gives_the_same_loss_and_gradients():
    """`fused_cross_entropy_chunk_scale`: the tiny Llama's 192 positions in one chunk instead of six of 32 (Liger's
    kernel, float32 on the GPU) give the same loss and gradients, the head's included."""
    pytest.importorskip("liger_kernel")
    from transformers import AutoModelForCausalLM

    from hellbender.models.kernels import fuse, size_loss_chunks
    from hellbender.models.tiny import tiny_model_dir
    from hellbender.plan.fused_loss_time import chunk_positions

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("hellbender/tiny-llama")).cuda().train()
    fuse(model, ["liger_fused_linear_cross_entropy"])
    ids = torch.randint(3, 500, (2, 96), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    config = model.config
    assert chunk_positions(ids.numel(), config.vocab_size, config.hidden_size) == 32
    assert chunk_positions(ids.numel(), config.vocab_size, config.hidden_size, 8) == ids.numel()

    def loss_and_gradients() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with tf32_off():
        expected_loss, expected = loss_and_gradients()
        size_loss_chunks(model, 8)
        loss, got = loss_and_gradients()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == expected.keys() and "lm_head.weight" in got
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("adapter", ["lora", None])
def test_compiled_layers_under_a_memory_budget_train_to_the_uncompiled_losses(tmp_path, adapter):
    """`activation_memory_budget` with inductor: the unchecked compiled layers recompute part of what they would
    keep, and the run's losses stay the uncompiled run's."""
    extra = dict(adapter="lora", lora_target_linear=True, lora_dropout=0.0) if adapter else dict(learning_rate=1e-3)
    assert_compiled_layers_train_to_the_uncompiled_losses(
        tmp_path, compiled_only={"activation_memory_budget": 0.5}, bf16=True, max_steps=10,
        gradient_checkpointing=True, gradient_checkpointing_layers=1, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("adapter", ["lora", None])
def test_compiled_offloaded_layers_train_to_the_uncompiled_losses(tmp_path, monkeypatch, adapter):
    """`activation_offload_layers` with inductor: the offloaded layer's compiled code gets back from host memory
    tensors of the strides it saved (attention's transposed outputs among them), and the losses are the uncompiled
    checkpointed run's. Every saved tensor is parked, however small (the tiny model's are all under 1 MiB)."""
    from hellbender.models import activation_checkpointing
    from hellbender.models.activation_offload import ActivationOffloader

    made = []

    class ParkEverything(ActivationOffloader):
        def __init__(self) -> None:
            super().__init__(min_bytes=0)
            made.append(self)

    monkeypatch.setattr(activation_checkpointing, "ActivationOffloader", ParkEverything)
    extra = dict(adapter="lora", lora_target_linear=True, lora_dropout=0.0) if adapter else dict(learning_rate=1e-3)
    assert_compiled_layers_train_to_the_uncompiled_losses(
        tmp_path, compiled_only={"activation_offload_layers": 1}, bf16=True, max_steps=10,
        gradient_checkpointing=True, **extra,
    )  # fmt: skip
    assert len(made) == 1 and made[0].host_bytes > 0


def test_autotuned_compiled_layers_train_to_the_uncompiled_losses(tmp_path):
    """The fast 8B recipe's levers on the tiny model, with `torch_compile_mode: max-autotune-no-cudagraphs` (inductor
    may swap cuBLAS matmuls for Triton templates): memory budget, offloaded layers and the fused cross-entropy train
    to the uncompiled checkpointed run's losses."""
    pytest.importorskip("liger_kernel")
    assert_compiled_layers_train_to_the_uncompiled_losses(
        tmp_path,
        compiled_only={"torch_compile_mode": "max-autotune-no-cudagraphs", "activation_memory_budget": 0.8,
                       "activation_offload_layers": 1},
        bf16=True, max_steps=10, gradient_checkpointing=True, gradient_checkpointing_layers=2,
        liger_fused_linear_cross_entropy=True, adapter="lora", lora_target_linear=True, lora_dropout=0.0,
    )  # fmt: skip


# Run in a fresh interpreter: TF32 is process-wide state, and once an earlier test's Trainer has set it (a whole-model
# compile in bf16 does, through torch's per-backend API) it cannot be put back to torch's start-up state.
AUTOTUNED_AFTER_ARGUMENTS = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from hellbender.config import validate_config
    from hellbender.train.arguments import training_arguments
    from hellbender.train.schedule import plan_schedule
    from tests.helpers import base_config

    tf32 = sys.argv[1] == "true"
    cfg = validate_config(base_config(Path(sys.argv[2]), bf16=True, torch_compile=True, tf32=tf32))
    training_arguments(cfg, plan_schedule(cfg, 8), has_eval=False)
    precision = torch.get_float32_matmul_precision()
    layer = torch.nn.Linear(256, 256, device="cuda")
    compiled = torch.compile(layer, mode="max-autotune-no-cudagraphs")
    inputs = torch.randn(512, 256, device="cuda", requires_grad=True)
    compiled(inputs).sum().backward()
    expected = torch.ones(512, 256, device="cuda") @ layer.weight
    print(json.dumps({"precision": precision, "gradients": torch.allclose(inputs.grad, expected, rtol=1e-2, atol=1e-2)}))
    """
)


@pytest.mark.parametrize("tf32", [True, False])
def test_an_autotuned_compile_runs_after_the_trainers_arguments_set_tf32(tmp_path, tf32):
    """transformers sets TF32 through torch's per-backend API while the Trainer's arguments are built (for `tf32`, and
    on its own for a whole-model compile in bf16, which `tf32: false` overrides), after which torch's legacy precision
    readers raise, and inductor's max-autotune reads one for its cache keys: with the arguments hellbender builds, an
    autotuned matmul compiles and runs, at the precision the key asked for."""
    proc = subprocess.run(
        [sys.executable, "-c", AUTOTUNED_AFTER_ARGUMENTS, str(tf32).lower(), str(tmp_path)],
        capture_output=True, text=True, timeout=540, check=False, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"precision": "high" if tf32 else "highest", "gradients": True}, result


def test_tiled_mlp_matches_the_untiled_loss_and_gradients_in_bf16_autocast(tmp_path):
    """On the GPU the shards' backward runs under the forward's autocast and CUDA random state."""
    import copy

    from hellbender.models.adapters import apply_adapter
    from hellbender.models.loading import load_model, load_tokenizer_and_processor
    from hellbender.models.tiled_mlp import tile_mlps

    cfg = validate_config(base_config(tmp_path, adapter="lora", lora_target_linear=True, lora_dropout=0.0))
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    plain = apply_adapter(cfg, load_model(cfg, tokenizer)).cuda().train()
    tiled = copy.deepcopy(plain)
    tile_mlps(tiled, shards=4)
    ids = torch.randint(3, 250, (1, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = []
    for model in (plain, tiled):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (expected_loss, expected), (loss, got) = results
    torch.testing.assert_close(loss, expected_loss, rtol=1e-2, atol=1e-3)
    for name, grad in expected.items():
        rel = (got[name].float() - grad.float()).norm() / grad.float().norm().clamp_min(1e-12)
        assert rel < 3e-2, (name, float(rel))


def test_loftq_starts_the_adapter_closer_to_the_original_weights_than_plain_quantization(tmp_path, tiny_model_path):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("scipy")
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    from hellbender.models.adapters import apply_adapter

    # alpha = r: the adapter's scale is 1, so base + B @ A is what the layer computes
    cfg = validate_config(
        base_config(
            tmp_path,
            adapter="lora",
            lora_r=8,
            lora_alpha=8,
            lora_target_modules=["q_proj"],
            peft={"loftq_config": {"loftq_bits": 4}},
        )
    )
    original = AutoModelForCausalLM.from_pretrained(tiny_model_path).model.layers[0].self_attn.q_proj.weight
    original = original.detach().clone().cuda().float()
    model = apply_adapter(cfg, AutoModelForCausalLM.from_pretrained(tiny_model_path).cuda())
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    lora_a, lora_b = layer.lora_A["default"].weight.float(), layer.lora_B["default"].weight.float()
    assert lora_b.abs().sum() > 0  # PEFT's default start has B = 0

    packed = bnb.nn.Params4bit(original.cpu(), requires_grad=False, compress_statistics=False, quant_type="nf4").cuda()
    plain = bnb.functional.dequantize_4bit(packed.data, packed.quant_state).float()
    with_adapter = layer.base_layer.weight.float() + lora_b @ lora_a
    assert torch.allclose(layer.base_layer.weight.float(), plain)  # the base holds the quantized weights
    assert (original - with_adapter).norm() < 0.8 * (original - plain).norm()


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_fused_gated_norm_matches_the_modules_in_bf16(weight_dtype):
    """`liger_rms_norm_gated`'s Triton kernel against Qwen3.5's, Qwen3.5-MoE's and Nemotron-H's gated-norm modules on
    bf16 inputs (weights in bf16, or float32 as with mixed precision): same output dtype, outputs within a few bf16
    ulps, and outputs and gradients about as close to the exact (float64) answer as the module's own."""
    from tests.gated_norm_checks import compare_norms

    for family, result in compare_norms(torch.bfloat16, "cuda", weight_dtype=weight_dtype).items():
        assert result["dtypes_match"] == [True] * 4, family
        # a few bf16 ulps of the largest output (roundings of intermediate values may land one ulp apart)
        assert result["fused_vs_module"]["output"] <= result["output_scale"] * 2**-6, (family, result)
        for name, error in result["fused_error"].items():
            assert error < 1.5 * result["module_error"][name] + 1e-3, (family, name, result)


@contextlib.contextmanager
def tf32_off() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_fused_gated_norm_keeps_tiny_models_logits_and_gradients():
    """The key on a tiny Qwen3.5 and a tiny Nemotron-H on CUDA in float32: only the gated norms change, and the
    logits, loss and gradients are the unfused model's."""
    from tests.gated_norm_checks import compare_models

    # A float32 comparison: TensorFloat-32 matmuls, which an earlier training test in the process may have switched
    # on (`tf32`), would differ by ~1e-3 whatever the norms do.
    with tf32_off():
        results = compare_models(device="cuda")
    for family, result in results.items():
        assert result["fused"] == result["gated_norms"] and result["fused"], (family, result)
        assert result["changed"] == [f"{name}.forward" for name in result["gated_norms"]], (family, result)
        assert result["logits_difference"] < 1e-4 * max(1.0, result["logits_scale"]), (family, result)
        assert result["worst_grad_difference"] < 1e-4, (family, result)


@pytest.mark.parametrize(
    "flex_settings",
    [
        pytest.param({}, id="transformers-compile"),
        pytest.param(
            {
                "flex_attn_compile_kwargs": {"dynamic": False, "mode": "max-autotune-no-cudagraphs"},
                "pad_to_sequence_len": True,
            },
            id="compile-kwargs",
        ),
        pytest.param({"gradient_checkpointing": True}, id="activation-checkpointing"),
        pytest.param(
            {"torch_compile": True, "gradient_checkpointing": True, "pad_to_sequence_len": True},
            id="compiled-layers",
        ),
    ],
)
def test_packing_with_flex_attention_trains_to_the_sdpa_losses(tmp_path, flex_settings):
    """Packed rows with flex attention (documents kept apart by the block mask transformers builds from the
    restarting position ids) train to the losses of packed rows with SDPA (dense masks built from the same position
    ids), in float32."""
    common = dict(adapter="lora", lora_target_linear=True, lora_dropout=0.0, sample_packing=True, max_steps=6)
    sdpa = validate_config(base_config(tmp_path / "sdpa", attn_implementation="sdpa", **common))
    flex = validate_config(
        base_config(tmp_path / "flex", attn_implementation="flex_attention", **common, **flex_settings)
    )
    train(sdpa)
    try:
        train(flex)
    except ConfigError as error:  # the start-up probe: this torch / Triton cannot build the tiny model's GQA layout
        assert "cannot compile for this model on this GPU" in str(error)
        pytest.skip(f"flex attention does not compile here, refused at start as it should be: {error}")
    expected, got = logged_losses(sdpa.output_dir), logged_losses(flex.output_dir)
    assert expected.keys() == got.keys() == set(range(1, 7))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=2e-3), (step, got, expected)


def test_the_flex_probe_passes_a_layout_the_compiler_builds(tiny_model_path):
    """Without grouped-query attention (as many key-value heads as query heads) flex attention compiles on the GPU
    machines' torch, so the start-up probe lets it through: it refuses only what fails."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hellbender.models.flex_attention import check_flex_compiles

    config = AutoConfig.from_pretrained(tiny_model_path)
    config.num_key_value_heads = config.num_attention_heads
    model = AutoModelForCausalLM.from_config(config)
    check_flex_compiles(model, None, torch.bfloat16)
    check_flex_compiles(model, {"dynamic": False}, torch.bfloat16)


def test_the_chunked_distillation_loss_matches_whole_logits_in_bf16_without_their_memory():
    """`kd_fused_loss` on CUDA in bfloat16, a 128,256-token vocabulary and 4,096 positions: the loss and every
    weight's gradient match the loss on the model's whole logits (bf16 tolerance), and the peak memory of forward and
    backward is lower by at least the float32 logits' 2 GiB."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hellbender.models.output_head import chunked_head
    from hellbender.train.distillation_loss import DistillationLoss, distillation_loss
    from hellbender.train.fused_distillation_loss import fused_distillation_loss

    vocab, positions = 128256, 4096
    torch.manual_seed(0)
    shape = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=1, num_attention_heads=8)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **shape)).bfloat16()
        ids = torch.randint(0, vocab, (1, positions))
        labels = ids.clone()
        labels[:, :512] = -100
        target_ids = torch.randint(0, vocab, (1, positions, 64))
        targets = [target_ids, torch.log_softmax(torch.randn(1, positions, 64), -1), torch.ones_like(target_ids).bool()]
    settings = DistillationLoss(alpha=0.9, ce_alpha=0.1)
    head = chunked_head(model, "the student", "kd_fused_loss", required=True)
    results = {}
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        if fused:
            with head.capturing():
                last = model(input_ids=ids).logits
            assert last.shape[1] == 1  # the model projected its last position only
            parts = fused_distillation_loss(head, head.hidden_states(), labels, *targets, settings, 4000)
        else:
            parts = distillation_loss(model(input_ids=ids).logits, labels, *targets, settings, 4000)
        parts.loss.backward()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - start) / 2**30
        grads = {name: p.grad.float() for name, p in model.named_parameters()}
        results[fused] = (parts, grads, peak)
    (whole, whole_grads, whole_peak), (split, split_grads, split_peak) = results[False], results[True]
    for name in ("loss", "kd", "ce"):
        torch.testing.assert_close(getattr(split, name), getattr(whole, name), rtol=1e-2, atol=1e-3)
    for name, grad in whole_grads.items():  # the output layer's weight and every weight below it
        cosine = torch.nn.functional.cosine_similarity(split_grads[name].flatten(), grad.flatten(), dim=0)
        assert cosine > 0.999, (name, cosine)
    assert split_peak < whole_peak - 2.0, (split_peak, whole_peak)


def test_online_distillation_trains_a_lora_student_in_bf16(tmp_path, tiny_model_path):
    """`kd_teacher_model` on CUDA in bfloat16 with packed rows: the teacher follows the batch to the GPU, both loss
    parts are logged and finite, and the student's loss falls."""
    from tests.helpers import trainer_state

    cfg = validate_config(
        base_config(
            tmp_path, kd_trainer=True, kd_teacher_model=str(tiny_model_path), kd_online_topk=8, kd_ce_alpha=0.5,
            sample_packing=True, sequence_len=256, max_steps=10, bf16=True, adapter="lora", lora_target_linear=True,
            learning_rate=2e-3,
        )
    )  # fmt: skip
    train(cfg)
    logs = [e for e in trainer_state(cfg.output_dir)["log_history"] if "loss" in e]
    assert all(math.isfinite(e["kd_loss"]) and math.isfinite(e["ce_loss"]) for e in logs), logs
    assert logs[-1]["loss"] < logs[0]["loss"], logs
