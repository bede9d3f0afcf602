"""QLoRA with FSDP2: the 4-bit weights are sharded as float tensors of the run's dtype, two sharded processes
compute the losses and gradients of one process on the same batch, and the adapter saved from the sharded model
(whole, or as a sharded checkpoint joined by `hellbender consolidate`) loads in plain PEFT on the 4-bit base.

The two-process parts run on CPU (gloo) with tests/fsdp_qlora_worker.py, on bitsandbytes' CPU backend; the whole
path through the Trainer runs on two GPUs in tests/test_gpu_multi.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hellbender.cli import app
from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.models.loading import bitsandbytes_config, quant_storage_dtype
from hellbender.train.fsdp import prepare_quantized_for_fsdp, quantized_weights
from tests import fsdp_qlora_worker
from tests.helpers import base_config
from tests.test_distributed import run_torchrun

WORKER = Path(fsdp_qlora_worker.__file__)


def qlora_fsdp_config(tmp_path: Path, **overrides) -> dict:
    return base_config(
        tmp_path,
        adapter="qlora",
        lora_target_linear=True,
        lora_dropout=0.0,
        fsdp_version=2,
        fsdp_config={"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
        **overrides,
    )


@pytest.mark.parametrize(
    ("precision", "expected"),
    [({"bf16": True}, torch.bfloat16), ({"bf16": False, "fp16": True}, torch.float16), ({}, torch.float32)],
)
def test_under_fsdp2_the_4bit_weights_are_stored_in_the_run_dtype(tmp_path, precision, expected):
    cfg = validate_config(qlora_fsdp_config(tmp_path, **precision))
    assert quant_storage_dtype(cfg) == expected
    assert bitsandbytes_config(cfg).bnb_4bit_quant_storage == expected
    single = validate_config(base_config(tmp_path, adapter="qlora", **precision))
    assert bitsandbytes_config(single).bnb_4bit_quant_storage == torch.bfloat16  # unchanged without FSDP2


def test_cpu_ram_efficient_loading_with_a_4bit_base_says_it_does_nothing(tmp_path, capsys):
    from hellbender.config.checks import find_notices

    raw = qlora_fsdp_config(tmp_path)
    raw["fsdp_config"]["cpu_ram_efficient_loading"] = True
    notices = find_notices(validate_config(raw))
    assert any("`fsdp_config.cpu_ram_efficient_loading` does nothing for a 4-bit base" in n for n in notices)
    lora = {**raw, "adapter": "lora"}
    assert not any("cpu_ram_efficient_loading" in n for n in find_notices(validate_config(lora)))


def test_4bit_weights_stored_in_another_dtype_than_fsdp2_gathers_are_refused(tmp_path):
    # Stored as bfloat16 (as a pre-quantized checkpoint may be), gathered as float16: the bytes would be rewritten.
    stored_bf16 = validate_config(qlora_fsdp_config(tmp_path, bf16=True))
    model = fsdp_qlora_worker.build_model(stored_bf16)
    assert quantized_weights(model)
    fp16_run = validate_config(qlora_fsdp_config(tmp_path, bf16=False, fp16=True))
    with pytest.raises(ConfigError, match=r"stored as bfloat16, but FSDP2 gathers this run's weights as float16"):
        prepare_quantized_for_fsdp(fp16_run, model)


def test_trained_weights_become_float32_and_the_4bit_weights_stay_packed(tmp_path):
    cfg = validate_config(qlora_fsdp_config(tmp_path, bf16=True, lora_modules_to_save=["lm_head"]))
    model = fsdp_qlora_worker.build_model(cfg)
    packed = {name: p.detach().view(torch.int16).clone() for name, p in quantized_weights(model).items()}
    assert any(p.requires_grad and p.dtype == torch.bfloat16 for p in model.parameters())  # the lm_head copy
    assert prepare_quantized_for_fsdp(cfg, model) == len(packed) == 7 * 2  # 7 projections x 2 layers
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    for name, p in quantized_weights(model).items():
        assert p.dtype == torch.bfloat16 and torch.equal(p.view(torch.int16), packed[name])  # bits (some are NaN)
    assert any(not p.requires_grad and p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "norm" in n)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, tiny_model_path):
    """Float32 throughout (storage, compute, reduction), so that sharding is the only difference from one process,
    with activation checkpointing, which recomputes the 4-bit layers inside the backward. (`tiny_model_path` builds
    the tiny model first, so that the two processes do not both build it at once.)"""
    tmp = tmp_path_factory.mktemp("fsdp-qlora")
    raw = qlora_fsdp_config(tmp, gradient_checkpointing=True)
    config = tmp / "config.json"
    config.write_text(json.dumps(raw))
    run_torchrun(WORKER, str(config), str(tmp), OMP_NUM_THREADS="1")
    return tmp, raw, json.loads((tmp / "report.json").read_text())


@pytest.fixture(scope="module")
def one_process_run(two_process_run):
    _, raw, _ = two_process_run
    model = fsdp_qlora_worker.build_model(validate_config(raw))
    result = fsdp_qlora_worker.train_steps(model, fsdp_qlora_worker.batch())
    return model, result


def test_the_4bit_weights_are_sharded_in_the_run_dtype(two_process_run):
    _, _, report = two_process_run
    assert report["sharded_4bit_weights"] == 14
    assert report["storage"] == ["torch.float32"]
    assert report["local_share"] == pytest.approx(0.5)  # each of the two processes holds half the packed bytes


def test_two_sharded_processes_compute_what_one_process_computes(two_process_run, one_process_run):
    tmp, _, report = two_process_run
    _, single = one_process_run
    # Tolerance: float32 summation order (measured: 1e-7 relative in the losses, 2e-8 at most in gradients up to 0.05).
    assert report["losses"] == pytest.approx(single["losses"], rel=1e-5)
    assert report["losses"][-1] < report["losses"][0]
    sharded = torch.load(tmp / "grads.pt", weights_only=True)
    assert set(sharded) == set(single["grads"]) and any("lora_B" in name for name in sharded)
    for name, grad in single["grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(sharded[name], grad, rtol=1e-4, atol=1e-7)


def test_a_sharded_qlora_checkpoint_resumes_the_trained_adapter(two_process_run):
    _, _, report = two_process_run
    # Loaded into a freshly sharded model as accelerate resumes: the trained model's loss, not the untrained one's.
    assert report["loss_after_resuming"] == pytest.approx(report["loss_after_training"], rel=1e-6)
    assert report["loss_after_training"] < report["losses"][0] - 0.05


def test_the_adapter_saved_from_the_sharded_model_loads_in_peft_on_the_4bit_base(two_process_run, one_process_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hellbender.models.loading import resolve_model_path

    tmp, raw, _ = two_process_run
    trained, _ = one_process_run
    cfg = validate_config(raw)
    base = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(cfg.base_model), dtype=torch.float32, quantization_config=fsdp_qlora_worker.quantization(cfg)
    )
    loaded = PeftModel.from_pretrained(base, str(tmp / "adapter")).train()  # train(): see build_model
    expected = {name: p for name, p in trained.named_parameters() if p.requires_grad}
    got = dict(loaded.named_parameters())
    for name, param in expected.items():
        torch.testing.assert_close(got[name], param, rtol=1e-4, atol=1e-6)
    ids = fsdp_qlora_worker.batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_a_sharded_qlora_checkpoint_consolidates_without_a_gpu(two_process_run):
    from safetensors.torch import load_file

    tmp, raw, _ = two_process_run
    raw = {**raw, "output_dir": str(tmp / "run")}
    config = tmp / "config.yml"
    config.write_text(json.dumps(raw))
    result = CliRunner().invoke(app, ["consolidate", str(config)])
    assert result.exit_code == 0, result.output
    joined = load_file(tmp / "run" / "consolidated" / "adapter_model.safetensors")
    final = load_file(tmp / "adapter" / "adapter_model.safetensors")
    assert set(joined) == set(final) and any("lora_B" in k for k in final)
    for name, tensor in final.items():
        torch.testing.assert_close(joined[name], tensor, rtol=0, atol=0)


def test_offloaded_fsdp2_asks_accelerate_for_a_cpu_backend_beside_nccl(tmp_path, monkeypatch):
    from hellbender.train.fsdp import announce_host_offload

    for name in ("ACCELERATE_USE_FSDP", "FSDP_OFFLOAD_PARAMS"):
        monkeypatch.delenv(name, raising=False)
    announce_host_offload(validate_config(qlora_fsdp_config(tmp_path)))
    assert "FSDP_OFFLOAD_PARAMS" not in os.environ
    raw = qlora_fsdp_config(tmp_path)
    raw["fsdp_config"]["offload_params"] = True
    announce_host_offload(validate_config(raw))
    assert os.environ["ACCELERATE_USE_FSDP"] == "true" and os.environ["FSDP_OFFLOAD_PARAMS"] == "true"
