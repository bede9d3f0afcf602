"""LoRA on mixture-of-experts models whose experts are fused 3-D parameters (transformers 5): the expert weights get
adapters (never silently attention only), train, save as a plain PEFT adapter and merge to the same logits."""

from __future__ import annotations

import logging
from pathlib import Path

import datasets  # noqa: F401 - imported before any CliRunner call (see tests/test_cli_errors.py)
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, TrainerCallback

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from tests.helpers import base_config, invoke

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def moe_config(family: str, tokenizer):
    import transformers

    common = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        **TINY,
    )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, **common
        )
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, **common)
    if family == "gpt_oss":  # experts stored transposed (experts x in x out)
        return transformers.GptOssConfig(
            intermediate_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
    if family == "deepseek_v3":  # layer 0 dense, layer 1 routed experts beside a shared expert (all SwiGLU)
        common.update(num_key_value_heads=4)
        common.pop("head_dim")
        return transformers.DeepseekV3Config(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_group=1,
            topk_group=1,
            **common,
        )
    assert family == "qwen3"  # dense
    return transformers.Qwen3Config(intermediate_size=64, **common)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """family -> a saved tiny model directory (built once per module)."""
    from hellbender.models.tiny import build_tiny_tokenizer

    built: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in built:
            tokenizer = build_tiny_tokenizer()
            torch.manual_seed(0)
            target = tmp_path_factory.mktemp(family)
            AutoModelForCausalLM.from_config(moe_config(family, tokenizer)).save_pretrained(target)
            tokenizer.save_pretrained(target)
            built[family] = target
        return built[family]

    return build


def lora_config(tmp_path: Path, model_dir: Path, **overrides) -> dict:
    return base_config(
        tmp_path,
        base_model=str(model_dir),
        adapter="lora",
        attn_implementation="eager",  # gpt-oss has no SDPA path
        max_steps=2,
        micro_batch_size=2,
        learning_rate=1e-2,
        **overrides,
    )


def adapted(tmp_path: Path, model_dir: Path, **overrides):
    from hellbender.models.adapters import apply_adapter
    from hellbender.models.loading import load_model, load_tokenizer_and_processor

    cfg = validate_config(lora_config(tmp_path, model_dir, **overrides))
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    return apply_adapter(cfg, load_model(cfg, tokenizer))


def expert_names(model) -> set[str]:
    """The 3-D weights' names in the base model (PEFT nests them under `base_layer`)."""
    return {
        n.removeprefix("base_model.model.").replace(".base_layer", "")
        for n, p in model.named_parameters()
        if p.dim() == 3
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_every_linear_layer_reaches_every_expert_weight(family, tiny_dir, tmp_path, caplog):
    from hellbender.models.expert_targets import adapted_names

    with caplog.at_level(logging.INFO, logger="hellbender"):
        model = adapted(tmp_path, tiny_dir(family), lora_target_linear=True)
    layers, params = adapted_names(model)
    experts = expert_names(model)
    assert experts and experts <= params  # each 3-D expert weight (gate_up_proj and down_proj per MoE layer)
    assert any(n.endswith("self_attn.o_proj") for n in layers)
    if family == "deepseek_v3":  # the dense MLP and the shared expert keep their adapters
        assert {"model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.shared_experts.gate_proj.weight"} <= params
    assert f"LoRA on {len(experts)} of the model's {len(experts)} expert weights" in caplog.text


def test_named_projections_and_target_parameters_choose_expert_weights(tiny_dir, tmp_path):
    from hellbender.models.expert_targets import adapted_names

    model_dir = tiny_dir("qwen3_moe")
    _, params = adapted_names(adapted(tmp_path, model_dir, lora_target_modules=["q_proj", "down_proj"]))
    assert params == {f"model.layers.{i}.mlp.experts.down_proj" for i in range(2)}
    only = adapted(tmp_path, model_dir, lora_target_modules=["q_proj"], lora_target_parameters=["experts.gate_up_proj"])
    assert adapted_names(only)[1] == {f"model.layers.{i}.mlp.experts.gate_up_proj" for i in range(2)}


def test_attention_only_says_the_experts_stay_unadapted(tiny_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hellbender"):
        adapted(tmp_path, tiny_dir("mixtral"), lora_target_modules=["q_proj", "v_proj"])
    assert "none of the model's 4 expert weights" in caplog.text and "lora_target_parameters" in caplog.text


@pytest.mark.parametrize(
    ("family", "overrides", "needles"),
    [
        ("qwen3", {"lora_target_parameters": ["mlp.experts.gate_up_proj"]}, ["no fused expert weights"]),
        ("qwen3_moe", {"lora_target_parameters": ["experts.w1"]}, ["`mlp.experts.down_proj`", "gate_up_proj"]),
        ("mixtral", {"lora_target_modules": ["gate_proj", "down_proj"]}, ["`up_proj`", "`mlp.experts.gate_up_proj`"]),
        ("gpt_oss", {"lora_target_linear": True, "lora_dropout": 0.1}, ["`lora_dropout: 0.1`", "`lora_dropout: 0`"]),
    ],
    ids=["experts-on-dense", "unknown-expert-weight", "half-fused", "dropout"],
)
def test_expert_targets_that_cannot_be_honoured_are_refused_by_name(family, overrides, needles, tiny_dir, tmp_path):
    with pytest.raises(ConfigError) as refused:
        adapted(tmp_path, tiny_dir(family), **overrides)
    assert all(n in str(refused.value) for n in needles), str(refused.value)


def test_target_parameters_with_dropout_is_refused_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="`lora_target_parameters` adapts weights directly"):
        validate_config(lora_config(tmp_path, tmp_path, lora_target_parameters=["x"], lora_dropout=0.05))


def test_adapted_expert_weights_change_the_output_and_receive_gradients(tiny_dir, tmp_path):
    from peft.tuners.lora import ParamWrapper

    model = adapted(tmp_path, tiny_dir("gpt_oss"), lora_target_modules=["q_proj"], lora_target_parameters=["down_proj"])
    ids = torch.randint(0, 100, (2, 12))
    before = model(input_ids=ids).logits.detach()
    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    assert len(wrappers) == 2
    with torch.no_grad():
        for w in wrappers:  # B starts at zero (the adapter starts as a no-op): give it a value
            w.lora_B["default"].weight.normal_(std=0.5)
    logits = model(input_ids=ids).logits
    assert (logits - before).abs().max() > 1e-3
    logits.float().pow(2).mean().backward()
    for w in wrappers:
        assert w.lora_A["default"].weight.grad.abs().sum() > 0
        assert w.lora_B["default"].weight.grad.abs().sum() > 0
        assert w.get_base_layer().down_proj.grad is None  # the base expert weight stays frozen


class FinalLogits(TrainerCallback):
    """The trained model's logits on `ids` at the end of training, as it is in memory."""

    def __init__(self, ids: torch.Tensor):
        self.ids, self.logits, self.expert_lora = ids, None, {}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        model.eval()
        with torch.no_grad():
            self.logits = model(input_ids=self.ids).logits.float()
        self.expert_lora = {
            n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n and "lora" in n
        }


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_trained_expert_adapter_loads_in_peft_and_merges_to_the_same_logits(family, tiny_dir, tmp_path):
    from peft import PeftModel

    from hellbender.train.run import train

    model_dir = tiny_dir(family)
    raw = lora_config(tmp_path, model_dir, lora_target_linear=True)
    (tmp_path / "config.yml").write_text(yaml.safe_dump(raw))
    torch.manual_seed(1)
    ids = torch.randint(0, 300, (2, 16))
    final = FinalLogits(ids)
    train(validate_config(dict(raw)), callbacks=[final])

    initial = adapted(tmp_path / "fresh", model_dir, lora_target_linear=True)
    start = {n: p for n, p in initial.named_parameters() if "experts" in n and "lora" in n}
    assert final.expert_lora and set(final.expert_lora) == set(start)
    assert any(not torch.equal(final.expert_lora[n], start[n]) for n in start if "lora_B" in n)  # B left zero

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base, raw["output_dir"]).eval()(input_ids=ids).logits
    assert (peft_logits - base_logits).abs().max() > 1e-4  # the adapter does something
    torch.testing.assert_close(peft_logits, final.logits, atol=1e-5, rtol=1e-5)  # fp32 throughout

    result = invoke("merge-lora", tmp_path / "config.yml")
    assert result.exit_code == 0, result.output
    merged = AutoModelForCausalLM.from_pretrained(Path(raw["output_dir"]) / "merged", dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, final.logits, atol=1e-4, rtol=1e-4)


def test_only_the_parameters_of_experts_modules_count_as_expert_weights():
    """A hybrid linear-attention layer's convolution also has a 3-D weight; it is not an expert and is never adapted
    as one."""
    import torch

    from hellbender.models.expert_targets import expert_weights

    class TinyExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 8, 16))

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1d = torch.nn.Conv1d(8, 8, kernel_size=4, groups=8)  # weight: 8 x 1 x 4
            self.experts = TinyExperts()

    layer = Layer()
    assert layer.conv1d.weight.dim() == 3
    assert expert_weights(layer) == {"experts.gate_up_proj": (4, 8, 16)}
