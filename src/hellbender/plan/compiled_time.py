"""The GPU's time in compiled decoder layers beyond their large matmuls' FLOPs and attention, from the traced layer's
graphs (compiled_layers.py, graph_work.py) instead of the uncompiled per-op costs of kernel_costs.py.

Three parts, each per layer pass (forward, backward, the forward again where a checkpointed layer recomputes it):
- inductor's fused kernels, bound by memory: the bytes they move at `FUSED_BANDWIDTH_SHARE` of the card's bandwidth;
- matmuls bound by bandwidth, not FLOPs (LoRA's: tokens x width x rank): the time their bytes take at
  `SKINNY_BANDWIDTH_SHARE` beyond what their FLOPs already count at the card's matmul share;
- the GPU idle between kernels that depend on each other: `IDLE_PER_KERNEL` for each kernel the graph counts.

Calibrated on one profiled step of the 8B LoRA recipe on an H200 (torch 2.11; `bench/throughput.py --profile-steps
8-9 --profile-trace`, read by `bench/trace_gaps.py`; docs/plan.md, "Compiled layers' step time"): its fused kernels
ran 30.1 ms a step where their bytes take 23.0 ms at the full 4.8 TB/s; LoRA's matmuls with cuBLAS's split-K
reductions and memsets 34.4 ms, what their bytes take at 0.40 of it beyond their FLOPs; the compute stream idled
14.6 ms between 5,882 kernels, 2,988 as counted here. Checked against other settings of the 8B and the 1B model in
`bench/plan_accuracy.py --cases compiled`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hellbender.plan.cards import Card

if TYPE_CHECKING:  # torch-importing modules: the planner's time model does not need them at run time
    from hellbender.plan.compiled_layers import CompiledLayer
    from hellbender.plan.graph_work import GraphWork

FUSED_BANDWIDTH_SHARE = 0.76
SKINNY_BANDWIDTH_SHARE = 0.40
IDLE_PER_KERNEL = 4.9e-6
# The host's time per kernel counted in a compiled layer's graphs, profiled (an upper bound: the profiler slows the
# host): forward calls 1.94 ms for 34 counted kernels, backward 3.24 ms for 53.
HOST_PER_KERNEL = 60e-6


def pass_seconds(work: GraphWork, tokens: float, card: Card) -> float:
    """One pass of one layer over `tokens`: fused traffic, bandwidth-bound matmuls' excess, idle between kernels."""
    bandwidth = card.hbm_tb_s * 1e12
    matmul_rate = card.bf16_tflops * 1e12 * card.efficiency
    skinny = sum(
        max(0.0, m.traffic.at(tokens) / (bandwidth * SKINNY_BANDWIDTH_SHARE) - m.flops_per_token * tokens / matmul_rate)
        for m in work.matmuls
    )
    return work.fused.at(tokens) / (bandwidth * FUSED_BANDWIDTH_SHARE) + skinny + work.kernels * IDLE_PER_KERNEL


def layers_seconds(layer: CompiledLayer, tokens: float, recomputed: list[bool], passes: float, card: Card) -> float:
    """One micro-batch through every compiled layer: forward (and `passes` forwards without gradients), the
    recomputation of the layers in `recomputed`, and backward."""
    forward = pass_seconds(layer.forward, tokens, card)
    return _over_layers(forward, pass_seconds(layer.backward, tokens, card), recomputed, passes)


def layers_kernels(layer: CompiledLayer, recomputed: list[bool], passes: float) -> float:
    """Kernels one micro-batch launches in the compiled layers (`passes`: forwards without gradients)."""
    return _over_layers(layer.forward.kernels, layer.backward.kernels, recomputed, passes)


def _over_layers(forward: float, backward: float, recomputed: list[bool], passes: float) -> float:
    """A per-pass amount summed over the layers of one micro-batch: each runs forward once with gradients and
    `passes` times without, again where it is recomputed, and backward once."""
    return sum((1 + passes + again) * forward + backward for again in recomputed)
