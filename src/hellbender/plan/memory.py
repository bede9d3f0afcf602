"""The predicted peak of one training step, per GPU: each part's bytes and the phase at which they add up most.

Three moments compete for the peak: the end of the forward pass (every saved activation and the loss's logits are
alive, the optimizer states from the step before too; a preference method's reference forward runs then), backward
(all gradients, the checkpointed layers' inputs and one recomputed layer), and the optimizer step (gradients, states
and the step's temporaries). Online distillation adds a fourth: its teacher's forward, before the student's, when none
of the student's activations exist yet. Online RL adds two more between optimizer steps, before any training
activations exist: the rollout's generation (its key-value cache, `generation.py`) and the forwards without gradients
that score the rollout (the reference's with `trl.beta` > 0, the policy's with several `trl.num_iterations`), B rows
at a time. Gradients are freed after each step (`zero_grad(set_to_none=True)`), so they
count at the forward passes only when gradients accumulate over micro-batches."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from hellbender.plan.activations import (
    attention_scores_bytes,
    checkpoint_input_bytes_per_token,
    eager_scores,
    layer_bytes_per_token,
    loss_bytes,
    per_layer_inputs_bytes,
    reference_forward_bytes,
    tiled_mlp_backward_bytes,
)
from hellbender.plan.allocator import uses_expandable_segments
from hellbender.plan.distillation import loss_bytes as distillation_loss_bytes
from hellbender.plan.distillation import target_bytes, teacher_forward_bytes
from hellbender.plan.generation import RolloutMemory, rollout_memory
from hellbender.plan.method import FUSED_HEAD, STORED_TARGETS
from hellbender.plan.model_facts import ModelFacts, Parameter
from hellbender.plan.optimizers import optimizer_rule, state_bytes
from hellbender.plan.settings import PlanSettings

GIB = 1024**3
SLAB_BYTES = 256 * 1024**2  # hellbender's pinned host slabs for offloaded layer inputs (activation_offload.py)
FETCH_AHEAD = 2  # offloaded layers fetched before their backward (activation_offload.py)
# The caching allocator reserves more than it hands out (measured reserved / allocated: 1.04-1.10 on W1 and W2,
# docs/benchmarks.md); the CUDA context takes memory torch does not count.
ALLOCATOR_MARGIN = 0.08
# Batches of images vary in shape step to step: with expandable segments (hellbender's default) the Gemma 4 image
# benchmark reserved 1.09-1.11x what it allocated (docs/plan.md, "Letting the planner choose").
IMAGE_ALLOCATOR_MARGIN = 0.12
CUDA_CONTEXT_BYTES = int(0.5 * GIB)
_BNB4_BLOCK, _BNB4_NESTED_BLOCK = 64, 256


def quantized_bytes(parameter: Parameter, bits: int, double_quant: bool) -> int:
    """Bytes bitsandbytes stores for one linear weight: the packed values and their quantization state."""
    n = parameter.numel
    if bits == 8:  # int8 values and one float32 scale per output row
        return n + 4 * parameter.rows
    blocks = -(-n // _BNB4_BLOCK)
    packed = -(-n // 2)
    code = 16 * 4  # the 4-bit data type's 16 values, float32
    if double_quant:  # absmax in uint8, with float32 absmax per 256 blocks, a 256-entry code and an offset
        return packed + blocks + 4 * -(-blocks // _BNB4_NESTED_BLOCK) + 256 * 4 + 4 + code
    return packed + 4 * blocks + code


@dataclass
class MemoryPlan:
    """Bytes per GPU (host where said) of one training step."""

    weights: int
    adapter: int
    gradients: int
    optimizer_states: int
    activations: int  # saved by the layers that are not checkpointed, and the checkpointed layers' inputs on the GPU
    recompute: int  # one checkpointed layer's activations while backward recomputes it
    loss: int
    attention_workspace: int
    step_temporaries: int
    ddp_buckets: int
    reference_copy: int  # a frozen copy of the starting weights (DPO / KTO with full fine-tuning)
    reference_forward: int  # a forward without gradients (after the policy's; online RL: scoring the rollout)
    peak: int
    peak_phase: str
    host: int
    host_parts: dict[str, int] = field(default_factory=dict)
    per_layer: list[int] = field(default_factory=list)  # activation bytes each decoder layer keeps on the GPU
    parked_layers: dict[int, int] = field(default_factory=dict)  # `activation_offload_layers`: bytes each parks
    gathered_weights: int = 0  # of `weights`: the layers and head FSDP2 / ZeRO-3 gather whole beside their shards
    teacher_weights: int = 0  # online distillation's frozen teacher, whole on every GPU
    teacher_forward: int = 0  # its forward without gradients, before the student's
    teacher_targets: int = 0  # distillation's top-k targets of the micro-batch, and the loss's copy of them
    tiled_mlp_backward: int = 0  # `tiled_mlp`: one recomputed shard and the gathered input gradients
    mlp_workspace: int = 0  # the gradient at the MLP's inner width in a layer's backward
    phases: dict[str, int] = field(default_factory=dict)  # what is allocated at each moment
    rollout: RolloutMemory | None = None  # online RL's generation
    notes: list[str] = field(default_factory=list)

    margin_fraction: float = ALLOCATOR_MARGIN  # of the peak: what the allocator reserves beyond it

    @property
    def allocator_margin(self) -> int:
        return int(self.peak * self.margin_fraction)

    @property
    def needed(self) -> int:
        """What the card must hold: the peak, the allocator's margin and the CUDA context."""
        return self.peak + self.allocator_margin + CUDA_CONTEXT_BYTES


def _shards(s: PlanSettings, part: str) -> int:
    """By how many GPUs `part` is split."""
    levels = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}
    needed = {"optimizer": 1, "gradients": 2, "weights": 3}[part]
    return (s.shard_group or s.gpus) if levels[s.sharding] >= needed else 1


def plan_memory(facts: ModelFacts, s: PlanSettings, element: int, gradient_accumulation: int = 1,
                double_quant: bool = True) -> MemoryPlan:  # fmt: skip
    """The memory plan of one step with settings `s`; `element` is the bytes per value of the run's dtype."""
    notes: list[str] = []
    built = [p for p in facts.parameters if ".lora_" not in p.name]  # the base model as built
    parameters = _as_held(facts.parameters, s, element)
    base = [p for p in parameters if ".lora_" not in p.name]
    adapter_params = [p for p in parameters if ".lora_" in p.name]
    weights = _weight_bytes(base, s, double_quant)
    # what the weights as held differ from the model as built by (a reference model copies it as built)
    upcast = weights - _weight_bytes(built, s, double_quant)
    adapter = sum(p.nbytes for p in adapter_params)
    trainable = [p for p in parameters if p.trainable]
    gradients = sum(p.nbytes for p in trainable)
    rule = optimizer_rule(s.optimizer)
    if not rule.known:
        notes.append(f"optimizer `{s.optimizer}` is planned as AdamW with float32 states (its own rule is not known)")
    if s.sharding.startswith("zero"):  # DeepSpeed's optimizer steps float32 master copies (kept beside the weights)
        masters = [replace(p, element_size=4) for p in trainable]
        states = sum(state_bytes(rule, p) for p in masters) + sum(4 * p.numel for p in trainable if p.element_size < 4)
    else:
        states = sum(state_bytes(rule, p) for p in trainable)
    # torch's foreach AdamW allocates a temporary of the states' size in its step; the fused kernel does not
    step_temporaries = gradients if rule.states and rule.bits == 0 and "fused" not in s.optimizer else 0
    host_parts: dict[str, int] = {}

    shards = _shards(s, "weights")
    weights_split, adapter_split, gathered = weights // shards, adapter // shards, 0
    if shards > 1:  # gathered whole, in the run's dtype: the layer computing, the next one prefetched, and the head
        outside = max((p.nbytes for p in built if p.in_layer is None), default=0)
        gathered = 2 * facts.largest_layer_bytes + outside
        if s.live_parameters:  # ZeRO-3 keeps gathered weights resident up to its live parameters (upper bound)
            gathered = max(gathered, s.live_parameters * element)
        gathered = min(gathered, weights - weights_split)
        weights_split += gathered
    gradients //= _shards(s, "gradients")
    states //= _shards(s, "optimizer")
    step_temporaries //= _shards(s, "optimizer")
    if s.offload_optimizer:
        host_parts["offloaded optimizer states"] = states
        states = 0
        if s.sharding == "fsdp2":  # FSDP2's CPU offload keeps the sharded parameters and gradients there too
            host_parts["offloaded parameters and gradients"] = weights_split - gathered + gradients
            weights_split, gradients = gathered, 0
    ddp_buckets = gradients if s.gpus > 1 and s.sharding == "none" else 0

    tokens = s.tokens
    checkpointed = s.checkpointed(facts.layers)
    norm_trains = any(p.trainable and "norm" in p.name for p in facts.parameters)
    if facts.compiled_layer_bytes_per_token is not None:  # what the compiler's partitioner keeps (compiled_layers.py)
        full_layers = [facts.compiled_layer_bytes_per_token * tokens] * facts.layers
    else:
        full_layers = [layer_bytes_per_token(facts, s, element, norm_trains, i) * tokens for i in range(facts.layers)]
    kept_input = checkpoint_input_bytes_per_token(facts, element) * tokens
    scores = attention_scores_bytes(facts, s, element)  # the same in every layer
    offloaded = s.offloaded(facts.layers)
    per_layer = []
    for index in range(facts.layers):
        if index in offloaded:  # everything it saves waits in host memory
            per_layer.append(0)
        elif index < checkpointed:
            per_layer.append(0 if s.offload else kept_input)
        else:
            shared = element * 2 * facts.kv_width(index) * tokens if index in facts.kv_shared_layers else 0
            per_layer.append(int(full_layers[index] - shared + facts.merged_expert_bytes + scores))
    if checkpointed and s.offload:
        on_host = checkpointed * kept_input
        host_parts["offloaded layer inputs (pinned slabs)"] = math.ceil(on_host / SLAB_BYTES) * SLAB_BYTES
        per_layer[0] = 2 * kept_input  # the input being copied out and the one fetched ahead in backward
    # In backward offloaded layers are fetched while the layers above them run theirs: FETCH_AHEAD more layers'
    # activations.
    fetched_ahead = 0
    parked = {i: int(full_layers[i] + facts.merged_expert_bytes + scores) for i in sorted(offloaded)}
    if parked:
        on_host = sum(parked.values())
        host_parts["offloaded layer activations (pinned slabs)"] = math.ceil(on_host / SLAB_BYTES) * SLAB_BYTES
        fetched_ahead = sum(sorted(parked.values())[-FETCH_AHEAD:])
    activations = sum(per_layer) + per_layer_inputs_bytes(facts, tokens, element)
    # Backward recomputes one checkpointed layer at a time: the largest of them.
    recompute = max(
        (int(full_layers[i] + facts.merged_expert_bytes + scores) for i in range(checkpointed)),
        default=0,
    )
    loss = int(distillation_loss_bytes(facts, s, element) if s.method.distills else loss_bytes(facts, s, element))
    q, k = facts.q_dim, facts.kv_dim
    if (
        s.method.shared_prompt and not s.eager_attention
    ):  # the varlen kernel's key-value heads expanded (activations.py)
        k = max(k, q)
    attention_workspace = element * tokens * (q + 2 * k)  # one layer's dq, dk, dv in backward
    attention_workspace += 2 * 4 * eager_scores(facts, s)  # eager: the float32 gradients of probabilities and scores
    residual = element * tokens * facts.hidden * 2  # the gradient flowing down the residual stream, and its sum
    tiled_mlp = int(tiled_mlp_backward_bytes(facts, s, element, norm_trains))
    # The gradient at the MLP's inner width (down_proj's input), beside the layer's saved tensors; a tiled MLP has
    # it for one shard (in `tiled_mlp`). The MLP's backward runs before the attention's, which then finds the MLP's
    # tensors freed: the layer's backward holds the larger of the two workspaces, not both.
    mlp_workspace = 0 if s.tiled_mlp else element * tokens * _widest_inner(facts)
    layer_workspace = max(attention_workspace, mlp_workspace + tiled_mlp)

    # The reference copy is the model as built, the adapter aside (full fine-tuning has none), sharded as the weights.
    reference_copy = weights_split - upcast // shards if s.method.reference_copy else 0
    scores_rollout = s.method.online and (s.method.reference_forwards or s.method.rollout.iterations > 1)
    reference_forward = 0
    if s.method.reference_forwards or scores_rollout:
        reference_forward = int(reference_forward_bytes(facts, s, element))
    saved_by_head = s.scored_tokens * facts.hidden * element if s.method.head == FUSED_HEAD else loss
    # The teacher is loaded whole beside the student on every GPU (no sharding wraps it).
    teacher = facts.teacher if s.method.distills else None
    teacher_weights = sum(p.nbytes for p in teacher.parameters) if teacher else 0
    teacher_forward = teacher_forward_bytes(teacher, s, element, facts.vocab) if teacher else 0
    targets = target_bytes(s) if s.method.distills else 0
    margin_fraction = IMAGE_ALLOCATOR_MARGIN if facts.vision_linear_numel else ALLOCATOR_MARGIN
    if facts.vision_linear_numel and not uses_expandable_segments():
        notes.append(
            f"batches of images vary in shape, and the allocator may keep more than the planned {margin_fraction:.0%} "
            "margin without expandable segments, which this environment's `PYTORCH_CUDA_ALLOC_CONF` leaves off: the "
            "Gemma 4 image benchmark reserved 1.12-1.60x what it allocated, 1.09-1.11x with them (hellbender's default)"
        )
    if not adapter_params and facts.layers and checkpointed == facts.layers:
        notes.append(
            "a full fine-tune with every layer checkpointed may reserve more than the planned "
            f"{margin_fraction:.0%} margin: the 1B benchmark reserved 1.16-1.19x its peak allocated memory with "
            "expandable segments (1.09-1.26x without): leave that room beyond the need"
        )
    if s.method.teacher == STORED_TARGETS:
        notes.append(
            f"the stored targets' count per token is in the rows, not the config: planned as {s.method.top_k} "
            "(`kd_online_topk`'s default)"
        )
    fixed = weights_split + adapter_split + states + ddp_buckets + reference_copy + teacher_weights
    grads_now = gradients if gradient_accumulation > 1 else 0
    # The reference runs after the policy's forward: its activations and the head's saved answer states are alive.
    # Online RL scores its rollout before training instead.
    beside_loss = 0 if s.method.online else reference_forward
    phases = {
        "loss": fixed + grads_now + activations + targets + max(loss, saved_by_head + beside_loss),
        # Backward starts with every saved tensor alive; by the checkpointed layers the others' are freed.
        "backward": fixed + gradients + residual + layer_workspace
        + max(activations, activations - sum(per_layer[checkpointed:]) + recompute + fetched_ahead),
        "optimizer step": fixed + gradients + step_temporaries,
    }  # fmt: skip
    if teacher:  # before the student's forward: none of its activations of this micro-batch exist yet
        phases["teacher forward"] = fixed + grads_now + teacher_forward
    rollout = rollout_memory(facts, s, element, gradient_accumulation) if s.method.online else None
    if rollout:  # between optimizer steps: the gradients were freed, no activations exist
        phases["generation"] = fixed + rollout.total
        if scores_rollout:
            phases["scoring the rollout"] = fixed + reference_forward
    phase = max(phases, key=phases.get)
    return MemoryPlan(
        weights=weights_split,
        adapter=adapter_split,
        gradients=gradients,
        optimizer_states=states,
        activations=activations,
        recompute=recompute,
        loss=loss,
        attention_workspace=attention_workspace,
        step_temporaries=step_temporaries,
        ddp_buckets=ddp_buckets,
        reference_copy=reference_copy,
        reference_forward=reference_forward,
        peak=int(phases[phase]),
        peak_phase=phase,
        host=sum(host_parts.values()),
        host_parts=host_parts,
        per_layer=per_layer,
        parked_layers=parked,
        phases={name: int(value) for name, value in phases.items()},
        notes=notes,
        margin_fraction=margin_fraction,
        gathered_weights=gathered,
        teacher_weights=teacher_weights,
        teacher_forward=teacher_forward,
        teacher_targets=targets,
        tiled_mlp_backward=tiled_mlp,
        mlp_workspace=mlp_workspace,
        rollout=rollout,
    )


def _as_held(parameters: list[Parameter], s: PlanSettings, element: int) -> list[Parameter]:
    """The parameters as the run holds them: under FSDP2 the trained ones in float32 (accelerate upcasts them under
    mixed precision, hellbender over a 4-bit base: train/fsdp.py), so their gradients and optimizer states are float32
    too, and each layer computes with a gathered copy in the run's dtype; under DeepSpeed every one in the run's dtype
    (its engine casts them, a float32 adapter too), the trained ones with float32 masters in the optimizer."""
    if s.sharding == "fsdp2":
        return [replace(p, element_size=4) if p.trainable else p for p in parameters]
    if s.sharding.startswith("zero"):
        return [replace(p, element_size=element) for p in parameters]
    return parameters


def _weight_bytes(parameters: list[Parameter], s: PlanSettings, double_quant: bool) -> int:
    """The weights' bytes, the quantized ones as a 4- or 8-bit base stores them."""
    return sum(
        quantized_bytes(p, s.quantized_bits, double_quant) if s.quantized_bits and p.quantizable else p.nbytes
        for p in parameters
    )


def _widest_inner(facts: ModelFacts) -> int:
    return max((w.inner for w in facts.layer_widths), default=facts.intermediate)
