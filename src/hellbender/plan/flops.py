"""FLOPs of one optimizer step as the GPU executes them (recomputation included), and the step time they predict
on a card.

Per micro-batch of T tokens, with N the base linear weights (decoder and output head), N_a the adapter's and N_t the
trained ones: forward 2 T (N + N_a); backward 2 T (N + N_a) for the activation gradients plus 2 T N_t for the weight
gradients; each checkpointed layer runs its forward again. Attention adds 4 T c d per layer forward (c the average
causal context, half the sequence or the window; d = heads x head_dim) and twice that backward. Frozen linear
layers outside the decoder (a vision tower) run forward only. The optimizer step is bound by memory bandwidth:
it reads and writes weights, gradients and states about once each."""

from __future__ import annotations

from dataclasses import dataclass

from hellbender.plan.cards import Card
from hellbender.plan.memory import MemoryPlan
from hellbender.plan.model_facts import ModelFacts
from hellbender.plan.settings import PlanSettings

# Measured on W1 (docs/benchmarks.md, H100): Liger's fused kernels made the step 1.20x faster; 4-bit weights,
# dequantized before every matmul, 0.87x; LoRA's step reaches 0.80 of full fine-tuning's share of the peak (W1 against
# W2, cards.py).
LIGER_SPEEDUP = 1.20
ADAPTER_EFFICIENCY = 0.80
FOUR_BIT_SLOWDOWN = 0.87


@dataclass(frozen=True)
class StepTime:
    flops: float  # per optimizer step, per GPU
    seconds: float
    tokens_per_second: float  # per GPU
    transfer_seconds: float  # offloaded layer inputs over the host link (overlapped with compute)


def step_flops(facts: ModelFacts, s: PlanSettings, gradient_accumulation: int = 1) -> float:
    tokens = s.micro_batch_size * s.sequence_len
    decoder = facts.decoder_linear_numel
    head = facts.head_numel
    lora = facts.lora_numel
    trained_linear = sum(p.numel for p in facts.trainable if p.rows or ".lora_" in p.name)
    forward_linear = 2 * tokens * (decoder + head + lora)
    backward_linear = 2 * tokens * (decoder + head + lora) + 2 * tokens * trained_linear
    d = facts.q_dim
    attention_forward = 0.0
    for index in range(facts.layers):
        window = facts.sliding_windows[index] if index < len(facts.sliding_windows) else None
        context = min(s.sequence_len, window) if window else s.sequence_len / 2
        attention_forward += 4 * tokens * context * d
    checkpointed = s.checkpointed(facts.layers)
    share = checkpointed / facts.layers if facts.layers else 0.0
    recompute = share * (2 * tokens * (decoder + lora) + attention_forward)
    vision = 2 * tokens * facts.other_linear_numel if facts.other_linear_numel else 0.0
    per_micro_batch = forward_linear + backward_linear + 3 * attention_forward + recompute + vision
    return per_micro_batch * gradient_accumulation


def step_time(facts: ModelFacts, s: PlanSettings, memory: MemoryPlan, card: Card,
              gradient_accumulation: int = 1) -> StepTime:  # fmt: skip
    flops = step_flops(facts, s, gradient_accumulation)
    efficiency = card.efficiency * (ADAPTER_EFFICIENCY if facts.lora_numel else 1.0)
    if s.liger_rms_norm or s.liger_glu or s.fused_loss:
        efficiency *= LIGER_SPEEDUP
    if s.quantized_bits == 4:
        efficiency *= FOUR_BIT_SLOWDOWN
    compute = flops / (card.bf16_tflops * 1e12 * efficiency)
    offloaded = memory.host_parts.get("offloaded layer inputs (pinned slabs)", 0)
    transfer = 2 * offloaded * gradient_accumulation / (card.host_link_gb_s * 1e9)
    # trained weights, their gradients and the states, each read and written about once
    optimizer = 3 * (2 * memory.gradients + memory.optimizer_states) / (card.hbm_tb_s * 1e12)
    seconds = max(compute, transfer) + optimizer
    tokens = s.micro_batch_size * s.sequence_len * gradient_accumulation
    return StepTime(flops, seconds, tokens / seconds, transfer)
