"""Quantization-aware training on a CUDA GPU (marked `gpu`; skipped without CUDA, and without torchao): the
`float8` + `float8` scheme (compute capability 8.9+) end to end in bfloat16, for full fine-tuning and LoRA: training
learns, `hellbender quantize` stores a model that plain transformers loads with torchao, and its logits are close to
the fake-quantized model's; the schemes this GPU cannot run are refused by name before any work.

Tolerance of "close", in bfloat16: the stored model multiplies float8 codes in one kernel (float32 accumulation,
bf16 out), the fake-quantized model dequantizes the same codes to bf16 first and runs a bf16 matmul. Both round to
bf16 between layers, and a bf16-sized change of an activation can move it to the next float8 code (a step of up
to 1/8 of its size), so the two cannot agree closer than bf16 arithmetic itself moves the fake-quantized forward. That is
measured in each test on the same GPU: the fake-quantized model in float32 vs in bfloat16 (the "floor"); the stored
model must be within twice the floor of the bf16 fake-quantized one (max and mean absolute logit difference), plus
1e-2 / 1e-3. Measured on the CPU (the tiny Llama trained 30 steps, weights in bf16, logits up to 5.5): the floor is
0.125 max / 0.0142 mean, about as large as what float8 rounding moves these logits (0.164 / 0.0175), and torchao's
stored float8 model, run on the CPU with its GPU check switched off in a scratch script, differs from the bf16
fake-quantized one by 0.109 / 0.0115, within one floor. At bf16 precision the float8 rounding of this tiny model is
barely visible, so the check shows that the stored model computes what training saw up to bf16 arithmetic, no
closer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml

from hellbender.config import validate_config
from tests.helpers import assert_user_error, base_config, invoke, logged_losses

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("libraries_log_to_the_session_stderr")]
FP8 = {"weight_dtype": "float8", "activation_dtype": "float8"}
LORA = {"adapter": "lora", "lora_target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}
IDS = torch.arange(5, 53).reshape(2, 24)


def _capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


needs_fp8 = pytest.mark.skipif(
    _capability() is None or _capability() < (8, 9), reason="float8 needs compute capability 8.9+"
)
below_blackwell = pytest.mark.skipif(
    _capability() is None or _capability() >= (10, 0), reason="checks the refusal on a GPU older than Blackwell"
)


@pytest.fixture(scope="module")
def torchao():
    return pytest.importorskip("torchao")


def _train(root: Path, **overrides) -> tuple[Path, object]:
    from hellbender.train.run import train

    raw = base_config(root, bf16=True, **overrides)
    config = root / "config.yml"
    config.write_text(yaml.safe_dump(raw))
    cfg = validate_config(raw)
    train(cfg)
    return config, cfg


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS.to(model.device)).logits.float()


def _difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    return (a - b).abs().max().item(), (a - b).abs().mean().item()


def _assert_close_to_fake(quantized: torch.Tensor, fake_bf16: torch.Tensor, fake_fp32: torch.Tensor) -> None:
    floor = _difference(fake_bf16, fake_fp32)
    found = _difference(quantized, fake_bf16)
    detail = f"stored vs fake-quantized (max, mean) {found}; bf16 floor {floor}"
    assert torch.isfinite(quantized).all(), detail
    assert found[0] <= 2 * floor[0] + 1e-2 and found[1] <= 2 * floor[1] + 1e-3, detail


def _load_quantized(target: Path):
    from transformers import AutoModelForCausalLM

    config = json.loads((target / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "torchao"
    return AutoModelForCausalLM.from_pretrained(target, device_map="cuda").eval()  # plain transformers


@needs_fp8
def test_float8_qat_trains_in_bf16_and_the_stored_model_computes_what_training_saw(tmp_path, torchao):
    from torchao.quantization import Float8Tensor
    from transformers import AutoModelForCausalLM

    from hellbender.models.qat import prepare_for_qat

    config, cfg = _train(tmp_path, qat=FP8, max_steps=12)
    losses = list(logged_losses(cfg.output_dir).values())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses
    result = invoke("quantize", config)
    assert result.exit_code == 0, result.output
    quantized = _load_quantized(Path(cfg.output_dir) / "quantized")
    assert isinstance(quantized.model.layers[0].self_attn.q_proj.weight, Float8Tensor)
    fake = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(cfg.output_dir, dtype=dtype, device_map="cuda").eval()
        prepare_for_qat(model, cfg.qat)
        fake[dtype] = _logits(model)
    _assert_close_to_fake(_logits(quantized), fake[torch.bfloat16], fake[torch.float32])


@needs_fp8
def test_float8_lora_qat_trains_and_the_merged_stored_model_computes_what_training_saw(
    tmp_path, tiny_model_path, torchao
):
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hellbender.models.adapters import apply_adapter
    from hellbender.models.qat import prepare_for_qat

    config, cfg = _train(tmp_path, qat=FP8, max_steps=12, learning_rate=3e-2, lora_r=16, **LORA)
    losses = list(logged_losses(cfg.output_dir).values())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    assert json.loads((Path(cfg.output_dir) / "hellbender_qat.json").read_text())["weight_dtype"] == "float8"
    result = invoke("quantize", config)
    assert result.exit_code == 0, result.output
    quantized = _load_quantized(Path(cfg.output_dir) / "quantized")
    adapter = load_file(Path(cfg.output_dir) / "adapter_model.safetensors")
    fake = {}
    for dtype in (torch.bfloat16, torch.float32):
        # The base as training loaded it (bf16), in float32 for the floor: the same weights, upcast exactly.
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16, device_map="cuda")
        model = model.to(dtype)
        prepare_for_qat(model, cfg.qat)
        model = apply_adapter(cfg, model)
        assert not set_peft_model_state_dict(model, adapter).unexpected_keys
        fake[dtype] = _logits(model.eval())
    _assert_close_to_fake(_logits(quantized), fake[torch.bfloat16], fake[torch.float32])


@below_blackwell
@pytest.mark.parametrize(
    ("scheme", "name"),
    [
        ({"weight_dtype": "nvfp4", "activation_dtype": "nvfp4"}, "NVFP4 weights and activations"),
        ({"weight_dtype": "nvfp4"}, "NVFP4 weight-only"),
        ({"weight_dtype": "mxfp4", "activation_dtype": "mxfp4"}, "MXFP4 weights and activations"),
    ],
)
def test_blackwell_schemes_are_refused_by_name_on_an_older_gpu(tmp_path, torchao, scheme, name):
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(base_config(tmp_path, bf16=True, qat=scheme)))
    major, minor = _capability()
    assert_user_error(
        invoke("train", config),
        f"`qat:` asks for {name}",
        "compute capability 10.0 or newer",
        f"a CUDA GPU of compute capability {major}.{minor}",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(importlib.util.find_spec("mslk") is not None, reason="mslk is installed here")
def test_int4_weight_only_is_refused_by_name_without_mslk(tmp_path, torchao):
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(base_config(tmp_path, bf16=True, qat={"weight_dtype": "int4"})))
    assert_user_error(
        invoke("train", config), "`qat:` asks for int4 weight-only (Int4WeightOnlyConfig)", "`mslk` package"
    )
    assert not (tmp_path / "out").exists()
