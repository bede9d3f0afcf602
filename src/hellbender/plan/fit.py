"""Whether a run fits its GPU budget, and the smallest change that makes it fit: every single change of the knobs
that trade speed for memory is planned, and the fastest one that fits is named (then pairs of them)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import combinations
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.config.distillation_checks import fused_loss_blocker
from hellbender.plan.cards import Card
from hellbender.plan.flops import StepTime, step_time
from hellbender.plan.memory import GIB, MemoryPlan, plan_memory
from hellbender.plan.method import KD_CHUNKED, KD_LOGITS
from hellbender.plan.model_facts import ModelFacts, describe, meta_model, planned_dtype
from hellbender.plan.settings import PlanSettings, plan_settings


@dataclass
class Plan:
    cfg: HellbenderConfig
    facts: ModelFacts
    settings: PlanSettings
    memory: MemoryPlan
    time: StepTime
    card: Card
    budget: int  # bytes per GPU the run may use
    budget_source: str

    @property
    def fits(self) -> bool:
        return self.memory.needed <= self.budget


@dataclass(frozen=True)
class Change:
    keys: dict[str, Any]  # config keys to set
    settings: dict[str, Any]  # the same, as PlanSettings fields

    def describe(self) -> str:
        return ", ".join(f"`{k}: {_yaml(v)}`" for k, v in self.keys.items())


def _yaml(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)


def element_size(cfg: HellbenderConfig) -> int:
    return planned_dtype(cfg).itemsize


def make_plan(cfg: HellbenderConfig, card: Card, gpus: int, budget_gib: float | None, budget_source: str) -> Plan:
    facts = describe(cfg, meta_model(cfg))
    settings = plan_settings(cfg, gpus, facts)
    budget = int((budget_gib if budget_gib is not None else card.memory_gib) * GIB)
    return plan_with(cfg, facts, settings, card, budget, budget_source)


def plan_with(cfg: HellbenderConfig, facts: ModelFacts, settings: PlanSettings, card: Card, budget: int,
              budget_source: str, gradient_accumulation: int | None = None) -> Plan:  # fmt: skip
    """`gradient_accumulation`: in place of the config's (a change that keeps the batch with a smaller micro-batch;
    online RL generates every completion of the step at once)."""
    ga = gradient_accumulation or cfg.gradient_accumulation_steps
    memory = plan_memory(facts, settings, element_size(cfg), ga, cfg.bnb_settings.bnb_4bit_use_double_quant)
    return Plan(cfg, facts, settings, memory, step_time(facts, settings, memory, card, ga), card, budget, budget_source)


def _single_changes(plan: Plan) -> list[Change]:
    s, cfg, layers = plan.settings, plan.cfg, plan.facts.layers
    changes: list[Change] = []
    checkpointed = s.checkpointed(layers)
    if checkpointed < layers:
        for n in sorted({checkpointed + step for step in (1, 2, 4, 8, 16, 32, 64) if checkpointed + step < layers}):
            changes.append(
                Change(
                    {"gradient_checkpointing": True, "gradient_checkpointing_layers": n},
                    {"checkpointing": True, "checkpointed_layers": n},
                )  # fmt: skip
            )
        changes.append(Change({"gradient_checkpointing": True}, {"checkpointing": True, "checkpointed_layers": None}))
    mb = s.micro_batch_size
    smallest = 2 if cfg.rl == "kto" else 1  # KTO's KL term pairs rows within a micro-batch
    while mb // 2 >= smallest:
        mb //= 2
        accumulate = cfg.gradient_accumulation_steps * s.micro_batch_size // mb
        changes.append(
            Change({"micro_batch_size": mb, "gradient_accumulation_steps": accumulate}, {"micro_batch_size": mb})
        )
    method = s.method
    # TRL's trainers compute their own log-probabilities; distillation has its own chunked loss instead of Liger's.
    if not s.fused_loss and not (cfg.rl or cfg.reward_model or method.distills):
        changes.append(Change({"liger_fused_linear_cross_entropy": True}, {"fused_loss": True}))
    if method.head == KD_LOGITS and fused_loss_blocker(cfg) is None:
        changes.append(Change({"kd_fused_loss": True}, {"method": replace(method, head=KD_CHUNKED)}))
    if not s.offload:
        changes.append(
            Change(
                {"gradient_checkpointing": "offload"},
                {"checkpointing": True, "offload": True, "checkpointed_layers": None},
            )  # fmt: skip
        )
    if cfg.adapter == "lora" and s.quantized_bits is None:
        changes.append(Change({"adapter": "qlora", "load_in_4bit": True}, {"quantized_bits": 4}))
    if method.reference_copy:  # the reference scores every row once before training: no copy of the weights
        changes.append(Change({"precompute_ref_log_probs": True}, {"method": replace(method, reference="precomputed")}))
    can_share = plan.facts.shared_prompt_refusal is None and not cfg.is_multimodal
    if cfg.rl in ("dpo", "ipo") and not method.shared_prompt and can_share and method.prompt_len:
        changes.append(Change({"dpo_shared_prompt": True}, {"method": replace(method, shared_prompt=True)}))
    if cfg.adapter is None and "8bit" not in s.optimizer:
        changes.append(Change({"optimizer": "adamw_bnb_8bit"}, {"optimizer": "adamw_bnb_8bit"}))
    return changes


def smallest_fitting_change(plan: Plan) -> tuple[Change, Plan] | None:
    """The change that fits with the fastest predicted step: single changes first, then pairs of them."""
    singles = _single_changes(plan)
    for size in (1, 2, 3):
        found = []
        for group in combinations(singles, size):
            keys: dict[str, Any] = {}
            fields: dict[str, Any] = {}
            for change in group:
                if set(change.settings) & set(fields):
                    break
                keys |= change.keys
                fields |= change.settings
            else:
                candidate = plan_with(
                    plan.cfg, plan.facts, plan.settings.but(**fields), plan.card, plan.budget, plan.budget_source,
                    keys.get("gradient_accumulation_steps"),
                )  # fmt: skip
                if candidate.fits:
                    found.append((Change(keys, fields), candidate))
        if found:
            return max(found, key=lambda pair: pair[1].time.tokens_per_second)
    return None


def generation_advice(plan: Plan) -> str:
    """Online RL whose peak is its generation: what lowers it (no change `smallest_fitting_change` tries does: a
    smaller micro-batch keeps the completions each generation makes), or "" elsewhere."""
    rollout = plan.memory.rollout
    if rollout is None or plan.memory.peak_phase != "generation":
        return ""
    return (
        f"the peak is the generation of {rollout.rows} completions at once ({rollout.kv_cache / GIB:.1f} GiB of "
        "key-value cache): fewer completions per optimizer step (`micro_batch_size` x `gradient_accumulation_steps`) "
        "or a shorter `trl.max_completion_length` lowers it"
    )
