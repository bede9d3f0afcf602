"""Compiled layers in the planner: what one traced layer keeps for backward (the compiler's partitioner on the meta
device) against what an H200 measured for the same layer, and the plan built on it."""

from __future__ import annotations

import pytest
import torch

from hellbender.config import validate_config
from hellbender.plan.budget import plan_for
from hellbender.plan.compiled_layers import trace_compiled_layer
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
    traced = trace_compiled_layer(cfg, model, _decoder_layers(model)[0], 4096).saved_bytes_per_token * 4096 / GIB
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


def test_graph_work_counts_a_fused_stretch_between_matmuls_once():
    """`graph_work` on a small traced graph: the matmuls with their operands' and outputs' bytes, the elementwise ops
    between them as one fused stretch (reading the matmul's output once, writing what the next matmul reads), and a
    kernel for each matmul and each tensor a fused stretch writes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hellbender.plan.graph_work import graph_work

    tokens, width, rank = 40, 16, 4

    def f(x, w, a):
        h = torch.mm(x, w.t())  # tokens x width
        g = (h * 2 + 1).relu()  # fused: reads h, writes g (read by the next matmul)
        return torch.mm(g, a.t()).sum()  # tokens x rank, then a reduction the graph outputs

    meta = dict(device="meta", dtype=torch.bfloat16)
    graph = make_fx(f)(torch.empty(tokens, width, **meta), torch.empty(width, width, **meta),
                       torch.empty(rank, width, **meta)).graph  # fmt: skip
    work = graph_work(graph, tokens, opaque=set())
    assert [m.flops_per_token for m in work.matmuls] == [2 * width * width, 2 * width * rank]
    activation, weight, skinny = tokens * width * 2, width * width * 2, tokens * rank * 2
    assert work.matmuls[0].traffic.at(tokens) == activation + weight + activation
    assert work.matmuls[1].traffic.at(tokens) == activation + rank * width * 2 + skinny
    # h read once, g written; the sum reads the second matmul's output and writes one value (no token dimension).
    assert work.fused.at(tokens) == activation + activation + skinny + 2
    assert work.kernels == 2 + 2


@pytest.mark.parametrize(
    ("settings", "measured_step_s"),
    # Per-step timing of the 8B LoRA benchmark on an H200 (torch 2.11; bench/plan_accuracy.py --cases compiled,
    # 2026-11-29): compiled layers, fused cross-entropy, 2 rows of 2,048 tokens.
    [({"gradient_checkpointing_layers": 22}, 0.330),
     ({"activation_memory_budget": 0.4, "gradient_checkpointing_layers": 8}, 0.321)],
)  # fmt: skip
def test_compiled_8b_steps_are_planned_within_a_fifth_of_the_gpu(tmp_path, settings, measured_step_s):
    raw = base_config(tmp_path, adapter="lora", lora_r=16, lora_alpha=32, lora_dropout=0.0, lora_target_linear=True,
                      bf16=True, torch_compile=True, gradient_checkpointing=True, sequence_len=2048,
                      micro_batch_size=2, liger_fused_linear_cross_entropy=True,
                      overrides_of_model_config={**W1_LAYER, "num_hidden_layers": 32, "vocab_size": 128256},
                      **settings)  # fmt: skip
    plan = plan_for(validate_config(raw), gpu="H200")
    assert plan.settings.tokens == 4096
    assert plan.time.seconds == pytest.approx(measured_step_s, rel=0.2)
