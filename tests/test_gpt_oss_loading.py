"""What gpt-oss configs need from model loading: `model_quantization_config: Mxfp4Config` with `dequantize: true`
(a checkpoint stored in MXFP4 loads in the run's precision and trains as usual) and hub attention kernels
(`attn_implementation: owner/repo`). Offline: a tiny MXFP4 checkpoint is written here; no kernel is downloaded."""

from __future__ import annotations

import pytest
import torch

from hellbender.config import validate_config
from hellbender.errors import ConfigError, EnvironmentProblem
from hellbender.models import hub_kernels
from hellbender.models.loading import load_model
from hellbender.models.tiny import build_tiny_tokenizer

FP4_VALUES = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
DEQUANTIZE = {"model_quantization_config": "Mxfp4Config", "model_quantization_config_kwargs": {"dequantize": True}}
EAGER = {"attn_implementation": "eager"}  # gpt-oss has no SDPA path (its attention sinks)


def config(base_model: str = "hellbender/tiny-llama", **keys):
    return validate_config(
        {"base_model": base_model, "datasets": [{"path": "x.jsonl", "type": "chat_template"}], "bf16": False, **keys}
    )


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A tiny gpt-oss whose experts are stored as gpt-oss ships them: MXFP4 blocks (two 4-bit values a byte) and
    one power-of-two scale per 32 values, with `quant_method: mxfp4` in its config.json."""
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    torch.manual_seed(0)
    cfg = GptOssConfig(
        vocab_size=640,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=32,
    )
    weights = {k: v.contiguous() for k, v in GptOssForCausalLM(cfg).state_dict().items()}
    generator = torch.Generator().manual_seed(1)
    for name in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows, columns = weights.pop(name).shape
        blocks = (experts, columns, rows // 32, 16)
        weights[f"{name}_blocks"] = torch.randint(0, 256, blocks, dtype=torch.uint8, generator=generator)
        weights[f"{name}_scales"] = torch.full(blocks[:3], 127, dtype=torch.uint8)  # 2**0
    cfg.quantization_config = {"quant_method": "mxfp4"}
    cfg.save_pretrained(path)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    build_tiny_tokenizer().save_pretrained(path)  # a model directory as a run reads it: model and tokenizer
    return path


def test_an_mxfp4_checkpoint_loads_dequantized_and_trains(mxfp4_checkpoint):
    tokenizer = build_tiny_tokenizer()
    model = load_model(config(str(mxfp4_checkpoint), **DEQUANTIZE, **EAGER), tokenizer)
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "GptOssExperts"  # transformers' own experts, not its MXFP4 inference module
    assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.shape == (4, 64, 128)
    assert set(experts.gate_up_proj.detach().abs().unique().tolist()) <= FP4_VALUES
    assert experts.gate_up_proj.detach().abs().max() > 0
    assert not getattr(model, "is_quantized", False) and not hasattr(model.config, "quantization_config")
    ids = torch.randint(0, len(tokenizer), (1, 12))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().sum() > 0


def test_from_pretrained_receives_transformers_mxfp4_config_with_the_kwargs(mxfp4_checkpoint, monkeypatch):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    received = {}
    original = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        received.update(kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    load_model(config(str(mxfp4_checkpoint), **DEQUANTIZE, **EAGER), build_tiny_tokenizer())
    assert isinstance(received["quantization_config"], Mxfp4Config)
    assert received["quantization_config"].dequantize is True


@pytest.mark.parametrize("asked", [{"attn_implementation": "sdpa"}, {"sdp_attention": True}])
def test_gpt_oss_with_sdpa_asked_for_is_refused_naming_the_key(mxfp4_checkpoint, asked):
    with pytest.raises(ConfigError, match=r"`attn_implementation: sdpa` cannot be used with this model: GptOss"):
        load_model(config(str(mxfp4_checkpoint), **DEQUANTIZE, **asked), build_tiny_tokenizer())


def test_gpt_oss_without_a_chosen_attention_loads_with_eager_and_says_so(mxfp4_checkpoint, caplog):
    cfg = config(str(mxfp4_checkpoint), **DEQUANTIZE)
    assert cfg.attn_implementation == "sdpa"  # hellbender's default, not the user's choice
    with caplog.at_level("WARNING", logger="hellbender"):
        model = load_model(cfg, build_tiny_tokenizer())
    assert model.config._attn_implementation == "eager"
    assert [r.message for r in caplog.records if "has no SDPA attention" in r.message] == [
        "GptOssForCausalLM has no SDPA attention in transformers, so hellbender loads it with `attn_implementation: "
        "eager` (the default `sdpa` was not chosen in the config); eager attention holds the [batch, heads, seq, seq] "
        "scores in memory."
    ]


def test_mxfp4_on_a_checkpoint_that_is_not_stored_in_mxfp4_is_refused(tiny_model_path):
    with pytest.raises(ConfigError, match=r"has no `quantization_config` in its config.json"):
        load_model(config(str(tiny_model_path), **DEQUANTIZE), build_tiny_tokenizer())


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"model_quantization_config": "Mxfp4Config"},
            r"without `model_quantization_config_kwargs: \{dequantize: true\}`",
        ),
        (
            {"model_quantization_config": "Mxfp4Config", "model_quantization_config_kwargs": {"dequantize": False}},
            "neither transformers nor hellbender can train them",
        ),
        ({"model_quantization_config": "HqqConfig"}, "`HqqConfig` is a transformers quantization config hellbender"),
        ({"model_quantization_config": "Mxfp5Config"}, "`Mxfp5Config` is not a quantization config"),
        (
            {**DEQUANTIZE, "model_quantization_config_kwargs": {"dequantize": True, "group_size": 4}},
            "`group_size`, which transformers' `Mxfp4Config` does not take",
        ),
        ({"model_quantization_config_kwargs": {"dequantize": True}}, "without `model_quantization_config`"),
        ({**DEQUANTIZE, "load_in_8bit": True, "adapter": "lora"}, "both say how to load the base"),
    ],
)
def test_quantization_configs_that_cannot_train_are_refused_by_name(keys, message):
    with pytest.raises(ConfigError, match=message):
        config(**keys)


def test_the_resolved_config_keeps_the_quantization_config():
    cfg = config(**DEQUANTIZE)
    assert (cfg.model_quantization_config, cfg.model_quantization_config_kwargs) == (
        "Mxfp4Config",
        {"dequantize": True},
    )


# --- hub attention kernels ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["kernels-community/vllm-flash-attn3", "kernels-community/flash-attn3@v1", "me/attention:my_forward"]
)
def test_hub_kernels_are_accepted_with_packing(name):
    assert config(attn_implementation=name, sample_packing=True).attn_implementation == name


@pytest.mark.parametrize("name", ["vllm-flash-attn3", "a/b/c", "flash_attention_4"])
def test_other_attention_values_are_refused(name):
    with pytest.raises(ConfigError, match=rf"`{name}` is neither an attention backend"):
        config(attn_implementation=name)


def test_a_hub_kernel_without_the_kernels_package_is_refused_at_load(monkeypatch):
    monkeypatch.setattr(hub_kernels, "kernels_installed", lambda: False)
    cfg = config(attn_implementation="kernels-community/vllm-flash-attn3")
    with pytest.raises(EnvironmentProblem, match="needs the `kernels` package, which is not installed"):
        load_model(cfg, build_tiny_tokenizer())


def test_from_pretrained_receives_the_hub_kernel(monkeypatch):
    from transformers import AutoModelForCausalLM

    received = {}

    def spy(cls, *args, **kwargs):
        received.update(kwargs)
        raise OSError("stopped after recording")

    monkeypatch.setattr(hub_kernels, "kernels_installed", lambda: True)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    with pytest.raises(ConfigError, match="stopped after recording"):
        load_model(config(attn_implementation="kernels-community/vllm-flash-attn3"), build_tiny_tokenizer())
    assert received["attn_implementation"] == "kernels-community/vllm-flash-attn3"


def test_packing_is_refused_once_a_kernel_turns_out_not_to_be_flash_attention():
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward

    AttentionInterface.register("test-owner/flash-like", flash_attention_forward)
    AttentionInterface.register("test-owner/other", lambda *args, **kwargs: None)
    hub_kernels.check_hub_kernel_packing(config(attn_implementation="test-owner/flash-like", sample_packing=True), None)
    hub_kernels.check_hub_kernel_packing(config(attn_implementation="test-owner/other"), None)  # not packed
    with pytest.raises(ConfigError, match="packed documents could attend to each other"):
        hub_kernels.check_hub_kernel_packing(config(attn_implementation="test-owner/other", sample_packing=True), None)
