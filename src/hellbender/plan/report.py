"""The plan as text: the per-GPU memory breakdown, host memory, step time and a one-line verdict."""

from __future__ import annotations

from hellbender.plan.cards import MEASURED_HOST_SHARES
from hellbender.plan.fit import Plan, generation_advice, smallest_fitting_change
from hellbender.plan.flops import parked_copy_gb_s
from hellbender.plan.fused_loss_time import chunk_positions
from hellbender.plan.generation import rollout_rows
from hellbender.plan.memory import CUDA_CONTEXT_BYTES, GIB
from hellbender.plan.method import (
    FUSED_HEAD,
    KD_CHUNKED,
    KD_LOGITS,
    LOGITS,
    SCORE_HEAD,
    SUPERVISED,
    TEACHER_MODEL,
)
from hellbender.plan.settings import PlanSettings

DISTILLATION_LOSSES = {
    KD_LOGITS: "distillation loss over the whole logits",
    KD_CHUNKED: "distillation loss, a chunk of positions at a time",
}


def _gib(n: float) -> str:
    return f"{n / GIB:6.2f} GiB"


def describe_run(plan: Plan) -> str:
    s, cfg = plan.settings, plan.cfg
    method = {"lora": "LoRA", "qlora": "QLoRA", None: "full fine-tuning"}[cfg.adapter]
    bits = f", {s.quantized_bits}-bit base" if s.quantized_bits else ""
    layers = plan.facts.layers
    checkpointed = s.checkpointed(layers)
    ckpt = "no checkpointing" if not checkpointed else f"{checkpointed} of {layers} layers checkpointed"
    if checkpointed and s.offload:
        ckpt += " (inputs offloaded)"
    if offloaded := len(s.offloaded(layers)):
        ckpt += f", {offloaded} of them offloaded instead (run once, their activations in host memory)"
    sharding = {"none": "DDP" if s.gpus > 1 else "one GPU", "fsdp2": "FSDP2"}.get(s.sharding, s.sharding.upper())
    if s.shard_group:
        sharding += f", {s.gpus // s.shard_group} replicas each sharded over {s.shard_group}"
    shape = s.method
    if shape.name == SUPERVISED.name:
        batch = f"micro-batch {s.micro_batch_size} x {s.sequence_len} tokens"
    elif shape.distills:
        batch = f"{shape.name}, micro-batch {s.micro_batch_size} x {s.sequence_len} tokens, {_teacher(plan)}"
    elif shape.rollout:
        batch = f"{shape.name}, micro-batch {s.micro_batch_size} completions: {_rows(s)}; {_generation(plan)}"
    else:
        batch = f"{shape.name}, micro-batch {s.micro_batch_size} {shape.example}s: {_rows(s)}"
    head = {
        LOGITS: _fused_loss(plan) if s.fused_loss else "full-logits loss",
        FUSED_HEAD: "TRL's fused LM head (no full logits)",
        SCORE_HEAD: "score head",
        **DISTILLATION_LOSSES,
    }[shape.head]
    return (
        f"{cfg.base_model}: {method}{bits}, {batch}, {ckpt}, {head}, optimizer {s.optimizer}, {s.gpus} GPU(s) "
        f"({sharding})"
    )


def _fused_loss(plan: Plan) -> str:
    s, facts = plan.settings, plan.facts
    chunk = chunk_positions(s.tokens, facts.vocab, facts.hidden, s.loss_chunk_scale)
    return f"fused loss (chunks of {chunk:,} positions)"


def _teacher(plan: Plan) -> str:
    shape, teacher = plan.settings.method, plan.facts.teacher
    if shape.teacher != TEACHER_MODEL or teacher is None:
        return f"the teacher's top {shape.top_k} per token stored with the rows"
    billions = sum(p.numel for p in teacher.parameters) / 1e9
    return f"teacher {plan.cfg.kd_teacher_model} ({billions:.2f}B parameters, frozen) gives its top {shape.top_k}"


def _generation(plan: Plan) -> str:
    """How the rollout is generated, as the report says it."""
    rollout = plan.settings.method.rollout
    assert rollout is not None
    rows = rollout_rows(plan.settings, plan.cfg.gradient_accumulation_steps)
    how = "compiled decoding, static cache" if rollout.compiled else "eager decoding"
    every = "every step" if rollout.iterations == 1 else f"every {rollout.iterations} steps"
    prompts = rows // rollout.generations
    return f"generation {every}: {rows} completions ({prompts} prompts x {rollout.generations}), {how}"


def _rows(s: PlanSettings) -> str:
    """The rows one micro-batch runs, as the report says them."""
    shape = s.method
    prompt, answer = shape.prompt(s.sequence_len), shape.answer(s.sequence_len)
    text = f"{s.rows} rows of {s.row_len:,} tokens"
    if shape.rollout:
        text += f" (a {prompt:,}-token prompt, `sequence_len` less the completion, + a completion of {answer:,})"
    elif shape.head == FUSED_HEAD:
        unset = "" if shape.prompt_len else "; no `max_prompt_len`, so the longest answers"
        if shape.shared_prompt:
            text += f" (a {prompt:,}-token prompt once + 2 answers of {answer:,} + 1{unset})"
        else:
            text += f" (a {prompt:,}-token prompt + an answer of {answer:,}{unset})"
    references = {
        "adapter off": "reference: the base with the adapter off",
        "frozen copy": "reference: a frozen copy of the weights",
        "precomputed": "reference log-probabilities precomputed",
        None: "no reference model",
    }
    text += f", {references[shape.reference]}"
    if shape.kl_rows:
        text += f", {s.rows} KL rows"
    return text


def render(plan: Plan) -> str:
    m, t = plan.memory, plan.time
    checkpointed = plan.settings.checkpointed(plan.facts.layers)
    offloaded = plan.settings.offloaded(plan.facts.layers)
    unchecked = [b for i, b in enumerate(m.per_layer) if i >= checkpointed]
    kept = [b for i, b in enumerate(m.per_layer) if i < checkpointed and i not in offloaded]
    lines = [describe_run(plan)]
    shape = plan.settings.method
    lines += [f"NOT MODELLED: {part}." for part in plan.facts.not_modelled]
    lines += ["", "Predicted peak GPU memory, per GPU:"]
    rows = [
        ("weights", m.weights),
        ("adapter weights", m.adapter),
        ("gradients", m.gradients),
        ("optimizer states", m.optimizer_states),
        ("DDP gradient buckets", m.ddp_buckets),
        ("reference copy (frozen starting weights)", m.reference_copy),
        ("teacher weights (frozen)", m.teacher_weights),
        (f"activations, {len(unchecked)} layers kept whole ({_gib(unchecked[0]).strip() if unchecked else '0'} each)",
         sum(unchecked)),
        (f"activations, {len(kept)} checkpointed layer inputs", sum(kept)),
        ("recomputed layer (backward)", m.recompute),
        (_head_label(plan), m.loss),
        (_scoring_label(plan), m.reference_forward),
        (_cache_label(plan), m.rollout.kv_cache if m.rollout else 0),
        ("generation: keys and values repeated for SDPA, one layer", m.rollout.repeated_kv if m.rollout else 0),
        ("generation: the prefill's or sampling's moment", max(m.rollout.prefill, m.rollout.sampling) if m.rollout else 0),
        (f"teacher's top-{shape.top_k} targets (ids, log-probabilities, mask)", m.teacher_targets),
        ("teacher forward (no gradients, before the student's)", m.teacher_forward),
        ("attention workspace (backward)", m.attention_workspace),
        ("MLP gradient at its inner width (backward)", m.mlp_workspace),
        ("tiled MLP: one shard and the input gradients (backward)", m.tiled_mlp_backward),
        ("optimizer step temporaries", m.step_temporaries),
    ]  # fmt: skip
    for label, value in rows:
        if value:
            lines.append(f"  {label:<58} {_gib(value)}")
    moments = ", ".join(f"{name} {value / GIB:.2f}" for name, value in m.phases.items())
    lines.append(f"  (the parts above do not all coexist; allocated GiB by moment: {moments})")
    lines.append(f"  {'peak allocated (at the ' + m.peak_phase + ')':<58} {_gib(m.peak)}")
    lines.append(f"  {f'allocator margin ({m.margin_fraction:.0%}) and CUDA context':<58} "
                 f"{_gib(m.allocator_margin + CUDA_CONTEXT_BYTES)}")  # fmt: skip
    lines.append(f"  {'needed on the card':<58} {_gib(m.needed)}")
    lines.append("")
    lines.append("Host memory (besides the process and data loaders):")
    if m.host_parts:
        lines += [f"  {label:<58} {_gib(value)}" for label, value in m.host_parts.items()]
    else:
        lines.append("  nothing offloaded")
    measured = "" if plan.card.measured else ", efficiency not measured on this card"
    examples = f", {t.examples_per_second:,.2f} {shape.example}s/s" if shape.example != "row" else ""
    lines += [
        "",
        f"Predicted step on {plan.card.name}{measured}: {t.flops / 1e12:.0f} TFLOP, {t.seconds:.2f} s, "
        f"{t.tokens_per_second:,.0f} tokens/s per GPU{examples}",
    ]
    if not t.launch_bound:
        matmuls = t.compute_seconds - t.attention_seconds - t.memory_bound_seconds
        lines.append(
            f"  GPU work {t.compute_seconds:.3f} s: matmuls {matmuls:.3f}, attention {t.attention_seconds:.3f}, "
            f"memory-bound ops (norms, rotary embeddings, LoRA, the loss) {t.memory_bound_seconds:.3f}"
        )
    if set(t.parts) - {"policy forward and backward", "recomputation"}:  # what the method adds
        lines.append("  " + ", ".join(f"{name} {value / 1e12:,.1f}" for name, value in t.parts.items() if value)
                     + " TFLOP")  # fmt: skip
    if t.rollout:
        r = t.rollout
        per = "per step" if shape.rollout.iterations == 1 else f"once every {shape.rollout.iterations} steps"
        lines.append(
            f"  generation {r.seconds:.2f} s {per}: prefill {r.prefill_seconds:.2f} s, {r.decode_steps:,} decoding steps "
            f"of {1000 * r.seconds_per_token:.1f} ms ({r.kernels_per_token:,.0f} kernels each); training and scoring "
            f"{t.seconds - r.seconds / shape.rollout.iterations:.2f} s per step"
        )
    if t.copy_stall_seconds:
        lines.append(
            f"  the backward waits {t.copy_stall_seconds:.3f} s a step for offloaded layers' copies (planned at "
            f"{parked_copy_gb_s(plan.facts, plan.card):g} GB/s each way): offload fewer layers"
        )
    if t.launch_bound:
        low, high = MEASURED_HOST_SHARES
        checkpointing = (
            f" ({t.checkpoint_host_seconds:.3f} s of it checkpointing's own work)" if t.checkpoint_host_seconds else ""
        )
        lines.append(
            f"  {'training ' if t.rollout else ''}bound by kernel launches: {t.kernels:,.0f} kernels take the host "
            f"{t.launch_seconds:.3f} s{checkpointing}, the GPU's work {t.compute_seconds:.3f} s"
        )
        lines.append(
            f"  hosts differ: those of the H200 machines measured took {low:.2f}-{high:.2f} of the host time planned, "
            f"a step of {t.host_range_seconds[0]:.3f}-{t.host_range_seconds[1]:.3f} s"
        )
    lines += [f"note: {note}" for note in m.notes + plan.facts.notes + _rollout_notes(plan)]
    lines.append("")
    lines.append(verdict(plan))
    return "\n".join(lines) + "\n"


def _head_label(plan: Plan) -> str:
    s = plan.settings
    if s.method.head == FUSED_HEAD:
        return f"fused LM head over {s.scored_tokens:,} answer tokens (no full logits)"
    if s.method.head == SCORE_HEAD:
        return "score head (one score per token, no vocabulary logits)"
    if s.method.distills:
        return DISTILLATION_LOSSES[s.method.head]
    return "logits and loss" if s.rows == s.micro_batch_size else f"logits and loss of {s.rows} rows"


def _rollout_notes(plan: Plan) -> list[str]:
    """Online RL without `sequence_len`: the prompts were planned from its default."""
    shape, cfg = plan.settings.method, plan.cfg
    if shape.rollout is None or "sequence_len" in cfg.model_fields_set:
        return []
    return [
        f"`sequence_len` is not set, so prompts are planned at {shape.prompt(plan.settings.sequence_len):,} tokens "
        f"(its default {cfg.sequence_len:,} less `trl.max_completion_length`): set `sequence_len` to your longest "
        "prompt plus `trl.max_completion_length`"
    ]


def _scoring_label(plan: Plan) -> str:
    rollout = plan.settings.method.rollout
    if rollout is None:
        return "reference forward (no gradients)"
    who = [name for name, runs in (("reference", plan.settings.method.reference_forwards),
                                   ("old log-probabilities", rollout.iterations > 1)) if runs]  # fmt: skip
    return f"scoring the rollout ({' and '.join(who)}; no gradients)"


def _cache_label(plan: Plan) -> str:
    rollout = plan.memory.rollout
    if rollout is None:
        return ""
    return f"generation: key-value cache ({rollout.rows} rows x {rollout.positions:,} positions)"


def verdict(plan: Plan) -> str:
    budget = f"{plan.budget / GIB:.1f} GiB ({plan.budget_source})"
    if plan.facts.not_modelled:
        budget += ", without what is NOT MODELLED above"
    if plan.fits:
        return f"fits: needs {plan.memory.needed / GIB:.1f} GiB of {budget}"
    text = f"does not fit: needs {plan.memory.needed / GIB:.1f} GiB of {budget}"
    found = smallest_fitting_change(plan)
    if found is None:
        advice = generation_advice(plan) or "more GPUs with FSDP2, or a larger card"
        return text + f"; no change the planner tries fits ({advice})"
    change, better = found
    return (
        f"{text}; smallest change that fits: {change.describe()} "
        f"(needs {better.memory.needed / GIB:.1f} GiB, {better.time.tokens_per_second:,.0f} tokens/s)"
    )
