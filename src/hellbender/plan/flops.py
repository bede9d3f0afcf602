"""FLOPs of one optimizer step as the GPU executes them (recomputation included), and the step time they predict
on a card.

Per micro-batch of T tokens, with N the base linear weights (decoder and output head), N_a the adapter's and N_t the
trained ones: forward 2 T (N + N_a); backward 2 T (N + N_a) for the activation gradients plus 2 T N_t for the weight
gradients; each checkpointed layer runs its forward again. Attention adds 4 T c d per layer forward (c the keys
whose scores the kernel computes per query: half the row or the window for causal kernels, the whole row for eager
attention and SDPA given a mask, `PlanSettings.context`; d = heads x head_dim) and twice that backward. Frozen linear
layers outside the decoder (a vision tower) run forward only. Preference methods add their forwards without
gradients and score answers with TRL's fused LM head (`step_flops_parts`; the rows are `method.py`'s); online
distillation adds its teacher's forward over every token, 2 T (N_teacher + its head) and its attention, at the card's
share of the peak. `tiled_mlp` runs each MLP's forward once more in backward (2 T N_mlp). The optimizer
step is bound by memory bandwidth: it reads and writes the weights and states and reads the gradients, which the
clipping before it reads twice and writes once (`optimizer_seconds`). Online RL
scores each rollout once per `trl.num_iterations` steps (the reference with `trl.beta` > 0, the policy's old
log-probabilities with several iterations) and adds its generation's time, over the same number of steps
(`generation.py`).

The GPU's time: the linear layers' FLOPs at the card's matmul share of its peak (`cards.py`), plus attention at the
rate of the kernel each layer's head size and mask get, plus the memory-bound work between the matmuls (norms,
rotary embeddings, gated products, residual sums, LoRA's adapters, the unfused loss) from per-element costs measured
one op at a time (`kernel_costs.py`). Under it lies the host's floor: the kernels the step launches (`launches.py`'s
counts) times `cards.LAUNCH_SECONDS`, and each checkpointed layer's own host work beyond its replay's launches
(`CHECKPOINT_HOST_SECONDS`). The host queues kernels ahead of the GPU, so the step takes the longer of the two, not
their sum (docs/plan.md shows the measurements that decide it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from math import ceil

from hellbender.plan import compiled_time, distillation, fused_loss_time, kernel_costs
from hellbender.plan.cards import LAUNCH_SECONDS, MEASURED_HOST_SHARES, Card
from hellbender.plan.generation import RolloutTime, rollout_time
from hellbender.plan.launches import (
    CLIP_OPS,
    FUSED_OPS,
    HEAD_AND_LOSS,
    MULTI_TENSOR,
    PER_EXPERT,
    PER_TENSOR_OPS,
    TENSORS_PER_CHUNK,
    UNFUSED_NORM,
    UNFUSED_ROPE,
    KernelCounts,
)
from hellbender.plan.memory import MemoryPlan
from hellbender.plan.method import FUSED_HEAD, KD_CHUNKED, LOGITS, SCORE_HEAD
from hellbender.plan.model_facts import ModelFacts
from hellbender.plan.offload_timeline import copy_wait_seconds
from hellbender.plan.settings import PlanSettings

TEACHER_FORWARD = "teacher forward (no gradients)"
# The share of the card's bandwidth the optimizer's multi-tensor kernels reach: profiled on the 1B full fine-tuning
# recipe on an H200 (docs/plan.md, "Full fine-tuning's optimizer and the fused loss"), torch's fused AdamW moved
# 17.3 GB in 6.35 ms and the gradient clipping 7.4 GB in 2.72 ms, both 2.7 TB/s of 4.8.
OPTIMIZER_BANDWIDTH_SHARE = 0.57
# The share of the host link an uncompiled offloaded layer's copies reach. It parks each of its saved tensors as a copy
# of its own (about 25 of 28 MB per layer of the 8B shape at 4,096 tokens); profiled with 8 such layers on an H200,
# they moved at 34 GB/s each way, where the compiled layers' fewer, larger copies reached the planned 50 (docs/plan.md).
UNCOMPILED_PARKED_COPY_SHARE = 34 / 50
# The host's time a checkpointed (uncompiled) layer adds to a step beyond its recomputed forward's launches (which the
# kernel count holds): its saved tensors' packing and unpacking and the autograd graph it builds again. On an H200
# machine's host `bench/checkpoint_host_time.py` measured 1.46 ms a layer for the Llama layout and 1.51 for
# Gemma-4-E2B's, whose forward takes 1.7x the Llama's: about the same per layer, not in proportion to its launches.
CHECKPOINT_HOST_SECONDS = 1.5e-3


@dataclass(frozen=True)
class StepTime:
    flops: float  # per optimizer step, per GPU
    seconds: float
    tokens_per_second: float  # per GPU: tokens through the policy with gradients
    transfer_seconds: float  # offloaded layer inputs and activations over the host link (overlapped with compute)
    examples_per_second: float = 0.0  # per GPU: rows, or pairs for pair methods
    parts: dict[str, float] = field(default_factory=dict)  # FLOPs per step by what runs them
    compute_seconds: float = 0.0  # the GPU's work: matmuls, attention and the memory-bound ops between them
    kernels: float = 0.0  # GPU kernels launched per step
    launch_seconds: float = 0.0  # the host's time to launch them (the floor under the step)
    rollout: RolloutTime | None = None  # online RL: one generation, which `seconds` counts per optimizer step
    attention_seconds: float = 0.0  # of `compute_seconds`: attention's kernels
    memory_bound_seconds: float = 0.0  # of `compute_seconds`: norms, rotary embeddings, LoRA, the loss, ...
    copy_stall_seconds: float = 0.0  # the backward waiting for offloaded layers' fetches (offload_timeline.py)
    checkpoint_host_seconds: float = 0.0  # of `launch_seconds`: checkpointing's host work beyond the replays' launches
    # the step on the fastest and the slowest host measured (cards.MEASURED_HOST_SHARES of the host's time)
    host_range_seconds: tuple[float, float] = (0.0, 0.0)

    @property
    def launch_bound(self) -> bool:
        return self.launch_seconds > max(self.compute_seconds, self.transfer_seconds)


def step_flops_parts(facts: ModelFacts, s: PlanSettings, gradient_accumulation: int = 1) -> dict[str, float]:
    """FLOPs per optimizer step of what runs: the policy's forward and backward (its output head included), the
    recomputation of checkpointed layers, and the method's forwards without gradients (the reference, KTO's KL rows
    on the policy). T tokens per micro-batch go through the decoder; the head projects all T (full logits) or, with
    TRL's fused LM head, the N answer tokens: forward 2 N H, backward 2 N H to recompute each tile, 2 N H for the
    hidden states' gradient and 2 N H more for a trained head's."""
    tokens, scored = s.tokens, s.scored_tokens
    decoder, lora = _decoder_and_lora(facts)
    head = facts.head_numel
    trained_body = _trained_body(facts)
    body_forward = 2 * tokens * (decoder + lora)
    body_backward = 2 * tokens * (decoder + lora) + 2 * tokens * trained_body
    if s.method.head == FUSED_HEAD:
        head_forward = 2 * scored * head
        head_backward = 4 * scored * head + (2 * scored * head if facts.head_trainable else 0)
    else:
        head_forward = 2 * tokens * head
        head_backward = 2 * tokens * head + (2 * tokens * head if facts.head_trainable else 0)
    attention_forward = _attention_forward(facts, s)
    recomputed = _recomputed_share(facts, s)
    vision = 2 * tokens * facts.other_linear_numel if facts.other_linear_numel else 0.0
    # PEFT merges LoRA into stacked experts each forward: (experts, out, r) x (experts, r, in), and twice that back.
    merge = 2 * facts.expert_lora_rank * facts.expert_numel if facts.expert_lora_numel else 0.0
    parts = {
        "policy forward and backward": body_forward + body_backward + head_forward + head_backward
        + 3 * attention_forward + vision + 3 * merge,
        "recomputation": recomputed * (2 * tokens * (decoder + lora) + attention_forward + merge),
    }  # fmt: skip
    if s.tiled_mlp:  # each shard's MLP forward runs once more, with its graph, in backward
        parts["tiled MLP recomputation"] = 2 * tokens * facts.mlp_linear_numel
    # The reference runs the base weights only: the adapter is switched off, or the frozen copy has none.
    reference = 2 * tokens * decoder + head_forward + attention_forward + vision
    # Online RL scores its rollout, the rows of every micro-batch of the step, once per generation.
    per_rollout = 1 / s.method.rollout.iterations if s.method.rollout else 1.0
    if s.method.reference_forwards:
        parts["reference forward"] = s.method.reference_forwards * reference * per_rollout
    if s.method.policy_forwards_without_grad:
        parts["KL rows (policy, no gradients)"] = body_forward + head_forward + attention_forward + vision
    if s.method.rollout and s.method.rollout.iterations > 1:
        parts["old log-probabilities (policy, no gradients)"] = (
            body_forward + head_forward + attention_forward + vision
        ) * per_rollout
    if s.method.distills and facts.teacher is not None:
        parts[TEACHER_FORWARD] = _teacher_linear(facts.teacher, s) + _attention_forward(facts.teacher, s)
    return {name: value * gradient_accumulation for name, value in parts.items()}


def _trained_body(facts: ModelFacts) -> float:
    """Trained weights a token's backward computes gradients for, outside the output head: linear layers and their
    adapters (not those merged into stacked experts), and the experts it was routed to."""
    idle_lora = facts.expert_lora_numel  # merged into the experts' weights, not run per token
    trained_linear = sum(p.numel for p in facts.trainable if p.rows or ".lora_" in p.name) - idle_lora
    trained_experts = sum(p.numel for p in facts.trainable if ".experts." in p.name and ".lora_" not in p.name)
    head = facts.head_numel if facts.head_trainable else 0
    return trained_linear + trained_experts * facts.active_expert_share - head


def _decoder_and_lora(facts: ModelFacts) -> tuple[float, float]:
    """Weights a token runs through in the decoder (the experts it is routed to), and its LoRA weights that run per
    token (not those merged into stacked experts)."""
    decoder = facts.decoder_linear_numel + facts.expert_numel * facts.active_expert_share
    return decoder, facts.lora_numel - facts.expert_lora_numel


def _teacher_linear(teacher: ModelFacts, s: PlanSettings) -> float:
    """The teacher's linear layers over every token of the micro-batch: its decoder (the experts a token runs), its
    head over every position (whole or a chunk at a time alike), and any tower outside the decoder."""
    decoder = teacher.decoder_linear_numel + teacher.expert_numel * teacher.active_expert_share
    return 2 * s.tokens * (decoder + teacher.head_numel + teacher.other_linear_numel)


def _attention_forward(facts: ModelFacts, s: PlanSettings) -> float:
    """The attention scores and their weighted sum in one forward of a micro-batch: 4 T c d per layer."""
    return sum(4 * s.tokens * s.context(facts.window(index)) * facts.q_dim for index in range(facts.layers))


def _recomputed_share(facts: ModelFacts, s: PlanSettings) -> float:
    return sum(s.recomputed(facts.layers)) / facts.layers if facts.layers else 0.0


def _forwards_without_gradients(s: PlanSettings) -> float:
    """Forwards without gradients per micro-batch: the reference's and KTO's KL rows; online RL scores its rollout
    (the reference, and the old log-probabilities with several iterations) once per generation."""
    passes = s.method.reference_forwards + s.method.policy_forwards_without_grad
    rollout = s.method.rollout
    if rollout is None:
        return passes
    return (passes + (1 if rollout.iterations > 1 else 0)) / rollout.iterations


def attention_step_flops(facts: ModelFacts, s: PlanSettings, gradient_accumulation: int = 1) -> float:
    """The part of `step_flops` that SDPA's attention kernels run: forward, backward (twice the forward), the
    recomputation and the forwards without gradients (the policy's, and the teacher's apart)."""
    runs = 3 + _recomputed_share(facts, s) + _forwards_without_gradients(s)
    return _attention_forward(facts, s) * runs * gradient_accumulation


def step_flops(facts: ModelFacts, s: PlanSettings, gradient_accumulation: int = 1) -> float:
    return sum(step_flops_parts(facts, s, gradient_accumulation).values())


def step_time(facts: ModelFacts, s: PlanSettings, memory: MemoryPlan, card: Card,
              gradient_accumulation: int = 1) -> StepTime:  # fmt: skip
    parts = step_flops_parts(facts, s, gradient_accumulation)
    flops = sum(parts.values())
    attention = attention_step_flops(facts, s, gradient_accumulation)
    peak = card.bf16_tflops * 1e12
    # The teacher runs transformers' own layers (no adapter, no Liger kernels, no 4-bit weights): the card's share.
    teacher = parts.get(TEACHER_FORWARD, 0.0)
    teacher_attention = _attention_forward(facts.teacher, s) * gradient_accumulation if teacher else 0.0
    attention_time = attention_seconds(facts, s, card)
    memory_bound = memory_bound_seconds(facts, s, card)
    if teacher:
        plain = s.but(liger_rms_norm=False, liger_rope=False, liger_glu=False, quantized_bits=None)
        attention_time += attention_seconds(facts.teacher, plain, card, passes_only=True)
        memory_bound += memory_bound_seconds(facts.teacher, plain, card, passes_only=True)
        memory_bound += kernel_costs.teacher_targets_seconds(s.tokens * facts.teacher.vocab, card.hbm_tb_s)
    attention_time *= gradient_accumulation
    memory_bound *= gradient_accumulation
    compute = (flops - attention - teacher_attention) / (peak * card.efficiency) + attention_time + memory_bound
    link = card.host_link_gb_s * 1e9
    parked_link = parked_copy_gb_s(facts, card) * 1e9
    inputs = memory.host_parts.get("offloaded layer inputs (pinned slabs)", 0) * gradient_accumulation / link
    parked = (
        memory.host_parts.get("offloaded layer activations (pinned slabs)", 0) * gradient_accumulation / parked_link
    )
    transfer = 2 * (inputs + parked)  # each way once, beside compute
    # Offloaded layers' activations leave while the forward runs and come back during the backward; the step waits
    # where a fetch has not arrived when its layer's backward begins (offload_timeline.py).
    copy_stall = 0.0
    if memory.parked_layers:
        forward, backward = layer_pass_seconds(facts, s, card)
        between = max(0.0, compute / gradient_accumulation - sum(forward) - sum(backward))
        copy_stall = gradient_accumulation * copy_wait_seconds(
            forward, backward, memory.parked_layers, parked_link, between
        )
    optimizer = optimizer_seconds(memory.gradients, memory.optimizer_states, s.clips_gradients, card)
    compiled = facts.compiled_layer
    kernels = micro_batch_kernels(facts.kernels, s, facts.layers, compiled is not None) * gradient_accumulation
    if teacher:
        kernels += teacher_kernels(facts.teacher, s) * gradient_accumulation
    kernels += optimizer_kernels(facts.kernels, s.optimizer, s.clips_gradients)
    launch = kernels * (card.launch_seconds or LAUNCH_SECONDS)
    checkpoint_host = 0.0
    if compiled is None:  # the host's work of checkpointing beyond the recomputed forward's launches
        checkpoint_host = sum(s.recomputed(facts.layers)) * CHECKPOINT_HOST_SECONDS * gradient_accumulation
        launch += checkpoint_host
    else:  # inductor's generated code launches its kernels at its own cost
        compiled_kernels = (
            compiled_time.layers_kernels(compiled, s.recomputed(facts.layers), _forwards_without_gradients(s))
            * gradient_accumulation
        )
        kernels += compiled_kernels
        launch += compiled_kernels * compiled_time.HOST_PER_KERNEL
    rollout, generation = None, 0.0
    if memory.rollout is not None:  # online RL: a generation every `num_iterations` steps, before training
        weight_bytes = memory.weights + memory.adapter
        rollout = rollout_time(facts, s, memory.rollout, weight_bytes, card, forward_kernels(facts.kernels, s))
        generation = rollout.seconds / s.method.rollout.iterations

    def on_host(share: float) -> float:
        """The step where the host takes `share` of its planned time. The host queues kernels ahead of the GPU: the
        step takes the longer of the two, not their sum."""
        return max(compute + copy_stall, transfer, launch * share) + optimizer + generation

    seconds = on_host(1.0)
    fastest, slowest = (on_host(share) for share in MEASURED_HOST_SHARES)
    tokens = s.tokens * gradient_accumulation
    examples = s.micro_batch_size * gradient_accumulation
    return StepTime(
        flops, seconds, tokens / seconds, transfer, examples / seconds, parts, compute, kernels, launch, rollout,
        attention_time, memory_bound, copy_stall, checkpoint_host, (fastest, slowest),
    )  # fmt: skip


def optimizer_seconds(gradients: int, states: int, clips: bool, card: Card) -> float:
    """The optimizer step over `gradients` bytes of gradients (the trained weights' size) and `states` bytes of
    state: the weights read and written, the gradients read, the states read and written; with clipping, the
    gradients' norm (a read) and their scaling (a read and a write) before it."""
    moved = 3 * gradients + 2 * states + (3 * gradients if clips else 0)
    return moved / (card.hbm_tb_s * 1e12 * OPTIMIZER_BANDWIDTH_SHARE)


def attention_seconds(facts: ModelFacts, s: PlanSettings, card: Card, passes_only: bool = False) -> float:
    """One micro-batch's attention at the rate of the kernel each layer's heads and mask get (kernel_costs.py):
    forward and backward, the checkpointed layers' recomputation and the forwards without gradients (`passes_only`:
    one forward, a teacher's)."""
    recomputed = s.recomputed(facts.layers)
    passes = 1.0 if passes_only else _forwards_without_gradients(s)
    total = 0.0
    for index, (forward, both) in enumerate(_layer_attention(facts, s, card)):
        forwards = passes + (1 if recomputed[index] and not passes_only else 0)
        total += forward * forwards + (0.0 if passes_only else both)
    return total


def _layer_attention(facts: ModelFacts, s: PlanSettings, card: Card) -> list[tuple[float, float]]:
    """Per decoder layer, one micro-batch's attention: one forward, and forward + backward (backward twice the
    forward's FLOPs). Eager attention runs two matmuls at the card's matmul share and a float32 softmax over every
    score."""
    peak = card.bf16_tflops * 1e12
    out = []
    for index in range(facts.layers):
        window = facts.window(index)
        flops = 4 * s.tokens * s.context(window) * facts.q_width(index)
        if s.attention == "eager":
            scores = s.tokens * s.context(window) * facts.heads
            matmuls = flops / (peak * card.efficiency)
            forward = matmuls + kernel_costs.eager_scores_seconds(scores, False, card.hbm_tb_s)
            out.append((forward, 3 * matmuls + kernel_costs.eager_scores_seconds(scores, True, card.hbm_tb_s)))
            continue
        head_dim = max(1, facts.q_width(index) // max(1, facts.heads))
        masked = s.attention == "sdpa" and s.context(window) >= s.row_len
        rate = partial(kernel_costs.attention_rate, head_dim, masked, s.row_len, peak_tflops=card.bf16_tflops)
        out.append((flops / rate(backward=False), 3 * flops / rate(backward=True)))
    return out


def parked_copy_gb_s(facts: ModelFacts, card: Card) -> float:
    """How fast, each way, the offloaded layers' activations are planned to move over the host link."""
    return card.host_link_gb_s * (1.0 if facts.compiled_layer is not None else UNCOMPILED_PARKED_COPY_SHARE)


def layer_pass_seconds(facts: ModelFacts, s: PlanSettings, card: Card) -> tuple[list[float], list[float]]:
    """Per decoder layer, one micro-batch's forward and backward on the GPU (the backward with the forward again where
    the layer is recomputed): its share of the decoder's matmuls, its attention and its memory-bound work."""
    layers = max(1, facts.layers)
    rate = card.bf16_tflops * 1e12 * card.efficiency
    decoder, lora = _decoder_and_lora(facts)
    matmul_forward = 2 * s.tokens * (decoder + lora) / layers / rate
    matmul_backward = matmul_forward + 2 * s.tokens * _trained_body(facts) / layers / rate
    compiled, liger = facts.compiled_layer, (s.liger_rms_norm, s.liger_rope, s.liger_glu)
    recomputed = s.recomputed(facts.layers)
    forward, backward = [], []
    for index, (attention, attention_both) in enumerate(_layer_attention(facts, s, card)):
        if compiled is not None:
            own = compiled_time.pass_seconds(compiled.forward, s.tokens, card)
            own_backward = compiled_time.pass_seconds(compiled.backward, s.tokens, card)
        else:
            traffic = facts.layer_traffic[index]
            own = kernel_costs.layer_seconds(traffic, s.tokens, False, liger, card.hbm_tb_s)
            own_backward = kernel_costs.layer_seconds(traffic, s.tokens, True, liger, card.hbm_tb_s) - own
        forward.append(matmul_forward + attention + own)
        backward.append(matmul_backward + attention_both - attention + own_backward
                        + (forward[-1] if recomputed[index] else 0.0))  # fmt: skip
    return forward, backward


def memory_bound_seconds(facts: ModelFacts, s: PlanSettings, card: Card, passes_only: bool = False) -> float:
    """One micro-batch's work outside the matmuls and attention (norms, rotary embeddings, gated products, residual
    sums, LoRA's adapters, the loss: unfused, distillation's, or Liger's fused head beyond its FLOPs,
    fused_loss_time.py), from the per-element costs in kernel_costs.py, or for compiled layers from their traced graphs
    (compiled_time.py)."""
    recomputed = s.recomputed(facts.layers)
    passes = 1.0 if passes_only else _forwards_without_gradients(s)
    liger = (s.liger_rms_norm, s.liger_rope, s.liger_glu)
    total = 0.0
    if facts.compiled_layer is not None and not passes_only:
        total += compiled_time.layers_seconds(facts.compiled_layer, s.tokens, recomputed, passes, card)
    else:
        for index, traffic in enumerate(facts.layer_traffic):
            forward = kernel_costs.layer_seconds(traffic, s.tokens, False, liger, card.hbm_tb_s)
            total += (int(recomputed[index] and not passes_only) + passes) * forward
            if not passes_only:
                total += kernel_costs.layer_seconds(traffic, s.tokens, True, liger, card.hbm_tb_s)
    if passes_only:
        return total
    if s.method.distills:
        total += kernel_costs.distillation_loss_seconds(s.tokens, facts.vocab, s.method.ce_gradient, card.hbm_tb_s)
        if s.method.head == KD_CHUNKED and facts.head_trainable:
            chunks = distillation.chunk_count(facts.vocab, s.tokens)
            total += kernel_costs.head_gradient_accumulation_seconds(facts.head_numel, chunks, card.hbm_tb_s)
    elif s.method.head == LOGITS and s.fused_loss:
        total += fused_loss_time.seconds(
            s.tokens, facts.vocab, facts.hidden, facts.head_bytes, facts.head_trainable, card, s.loss_chunk_scale
        )  # fmt: skip
    elif s.method.head not in (FUSED_HEAD, SCORE_HEAD) and not s.fused_loss:
        total += kernel_costs.loss_seconds(s.tokens, facts.vocab, facts.logit_softcapping, card.hbm_tb_s)
    return total


def _layer_forwards(k: KernelCounts, s: PlanSettings) -> list[int]:
    norm = 1 if s.liger_rms_norm else UNFUSED_NORM
    rope = 1 if s.liger_rope else UNFUSED_ROPE
    glu = -1 if s.liger_glu else 0  # the activation and the product in one kernel
    dequant = 1 if s.quantized_bits else 0
    return [
        layer.fixed + layer.norms * norm + rope + glu + layer.dequantized * dequant + layer.experts * PER_EXPERT
        for layer in k.layers
    ]


def micro_batch_kernels(k: KernelCounts, s: PlanSettings, layers: int, compiled_layers: bool = False) -> float:
    """Kernels one micro-batch launches: forward, the recomputation of checkpointed layers and backward
    (`compiled_layers`: outside the decoder layers only; compiled_time.py counts theirs)."""
    forward = [0] * len(k.layers) if compiled_layers else _layer_forwards(k, s)
    passes = _forwards_without_gradients(s)
    trained = sum(forward) + k.outside_trained + HEAD_AND_LOSS
    return (
        3 * trained  # forward and backward (twice the forward's kernels)
        + (0 if compiled_layers else recomputed_kernels(k, s, layers))
        + (1 + passes) * k.outside_frozen
        + passes * (sum(forward) + HEAD_AND_LOSS)
    )


def recomputed_kernels(k: KernelCounts, s: PlanSettings, layers: int) -> float:
    """Kernels the checkpointed layers launch again in one micro-batch's backward (uncompiled layers)."""
    return sum(f for f, again in zip(_layer_forwards(k, s), s.recomputed(layers), strict=False) if again)


def optimizer_kernels(k: KernelCounts, optimizer: str, clipping: bool) -> float:
    chunks = ceil(k.trainable_tensors / TENSORS_PER_CHUNK)
    clip = CLIP_OPS * chunks if clipping else 0
    if optimizer in MULTI_TENSOR:
        return FUSED_OPS * chunks + clip
    return PER_TENSOR_OPS * k.trainable_tensors + clip


def teacher_kernels(teacher: ModelFacts, s: PlanSettings) -> float:
    """Kernels of the teacher's forward and its top-k: its own layers, unfused (hellbender's kernels are the
    student's), and the head once per chunk of positions (or once, over the whole logits)."""
    plain = s.but(liger_rms_norm=False, liger_rope=False, liger_glu=False, quantized_bits=None)
    chunks = 1
    if s.method.head == KD_CHUNKED:
        chunks = distillation.chunk_count(teacher.vocab, s.tokens)
    return forward_kernels(teacher.kernels, plain) + (chunks - 1) * HEAD_AND_LOSS


def forward_kernels(k: KernelCounts, s: PlanSettings) -> float:
    """Kernels of one forward without gradients (one decoding step: the calibration against W6, docs/plan.md)."""
    return sum(_layer_forwards(k, s)) + k.outside_trained + k.outside_frozen + HEAD_AND_LOSS
