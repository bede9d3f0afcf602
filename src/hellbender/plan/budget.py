"""Which card and how much of its memory a plan is measured against, and `train`'s refusal of a config that will
not fit `gpu_memory_limit`."""

from __future__ import annotations

from dataclasses import replace

from hellbender.config import HellbenderConfig
from hellbender.config.training import memory_limit_gib
from hellbender.errors import ConfigError
from hellbender.plan.cards import CARDS, Card, card_named, this_card
from hellbender.plan.fit import Plan, generation_advice, make_plan, smallest_fitting_change
from hellbender.plan.memory import GIB

DEFAULT_CARD = "H100"  # planned for when no GPU is visible and none is named


def card_and_budget(cfg: HellbenderConfig, gpu: str | None = None,
                    gpu_memory: float | None = None) -> tuple[Card, float, str]:  # fmt: skip
    """The card to plan for (`gpu`, else this machine's, else an H100) and the GiB per GPU to fit: `gpu_memory`, else
    `gpu_memory_limit`, else the card's memory."""
    card = card_named(gpu) if gpu else this_card() or next(c for c in CARDS if c.name == DEFAULT_CARD)
    if gpu_memory is not None:
        if not gpu:  # a card of that size: the step time still needs one
            card = replace(card, memory_gib=gpu_memory)
        return card, gpu_memory, "--gpu-memory"
    if cfg.gpu_memory_limit is not None:
        return card, memory_limit_gib(cfg.gpu_memory_limit), "gpu_memory_limit"
    return card, card.memory_gib, f"the {card.name}'s memory"


def plan_for(cfg: HellbenderConfig, gpu: str | None = None, gpu_memory: float | None = None,
             gpus: int = 1) -> Plan:  # fmt: skip
    """The plan of `cfg` on `gpus` cards (see `card_and_budget`)."""
    card, budget, source = card_and_budget(cfg, gpu, gpu_memory)
    return make_plan(cfg, card, gpus, budget, source)


def refuse_what_does_not_fit(cfg: HellbenderConfig, gpus: int = 1) -> Plan | None:
    """With `gpu_memory_limit`, a ConfigError when the planned peak exceeds it, naming the smallest change that fits;
    called by `train` before any data is prepared. Without the key, nothing is planned."""
    if cfg.gpu_memory_limit is None:
        return None
    plan = plan_for(cfg, gpus=gpus)
    if plan.fits:
        return plan
    found = smallest_fitting_change(plan)
    limit = memory_limit_gib(cfg.gpu_memory_limit)
    lowers = generation_advice(plan) or "use more GPUs with FSDP2 (`fsdp_version: 2`), or a larger card"
    if found:
        advice = (
            f"The smallest change that fits: {found[0].describe()} (predicted {found[1].memory.needed / GIB:.1f} GiB)."
        )
    else:
        advice = f"No change the planner tries fits: {lowers}."
    raise ConfigError(
        f"`gpu_memory_limit: {shown_limit(cfg.gpu_memory_limit)}`: this run is predicted to need "
        f"{plan.memory.needed / GIB:.1f} GiB per GPU (peak {plan.memory.peak / GIB:.1f} GiB allocated, at the {plan.memory.peak_phase}, plus the "
        f"allocator's margin and the CUDA context), more than the {limit:.1f} GiB allowed. {advice} "
        "`hellbender plan CONFIG` prints the whole breakdown; raise `gpu_memory_limit` if the card has the room."
    )


def shown_limit(value: float | str) -> str:
    """`gpu_memory_limit` as the user wrote it (`48`, `20GiB`)."""
    return f"{value:g}" if isinstance(value, float) else str(value)
