"""Compiled layers in the planner: what one traced layer keeps for backward (the compiler's partitioner on the meta
device) against what an H200 measured for the same layer, and the plan built on it."""

from __future__ import annotations

import pytest

from hellbender.config import validate_config
from hellbender.plan.budget import plan_for
from hellbender.plan.compiled_layers import compiled_layer_bytes_per_token
from hellbender.plan.model_facts import _decoder_layers, meta_model
from tests.helpers import base_config

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")

# One decoder layer of the Llama-3-8B shape, as bench/activation_memory_budget.py measured it.
W1_LAYER = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=1024,
)  # fmt: skip
GIB = 2**30


@pytest.mark.parametrize(
    ("budget", "measured_gib", "within"),
    # GiB the compiled layer (LoRA r16 on its seven projections, 4,096 tokens) left allocated for backward on an
    # H200, torch 2.11 (docs/benchmarks.md, "A memory budget for the compiled layers").
    [(None, 0.535, 0.02), (0.8, 0.329, 0.10), (0.5, 0.259, 0.05), (0.4, 0.188, 0.02)],
)
def test_a_traced_8b_layer_keeps_what_the_gpu_measured(tmp_path, budget, measured_gib, within):
    raw = base_config(tmp_path, adapter="lora", lora_r=16, lora_alpha=32, lora_dropout=0.0, lora_target_linear=True,
                      bf16=True, torch_compile=True, gradient_checkpointing=True, overrides_of_model_config=W1_LAYER,
                      **({"activation_memory_budget": budget} if budget is not None else {}))  # fmt: skip
    cfg = validate_config(raw)
    model = meta_model(cfg)
    traced = compiled_layer_bytes_per_token(cfg, model, _decoder_layers(model)[0], 4096) * 4096 / GIB
    assert traced == pytest.approx(measured_gib, rel=within)


def test_the_plan_keeps_the_traced_bytes_in_each_unchecked_layer(tmp_path):
    cfg = validate_config(
        base_config(tmp_path, torch_compile=True, gradient_checkpointing=True, gradient_checkpointing_layers=1)
    )
    plan = plan_for(cfg)
    per_token = plan.facts.compiled_layer_bytes_per_token
    tokens = plan.settings.tokens
    assert plan.memory.per_layer[1:] == [int(per_token * tokens)] * (plan.facts.layers - 1)
    assert plan.memory.recompute == int(per_token * tokens)  # the checkpointed layer, recomputed in backward
    uncompiled = plan_for(validate_config(base_config(tmp_path, gradient_checkpointing=True,
                                                      gradient_checkpointing_layers=1)))  # fmt: skip
    assert uncompiled.memory.per_layer[1:] != plan.memory.per_layer[1:]
