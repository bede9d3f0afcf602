"""`micro_batch_size: auto`, `gradient_checkpointing: auto`, `gradient_checkpointing_layers: auto` and
`activation_offload_layers: auto`: the planner tries every value of the keys left to it and keeps the fastest
predicted setting that fits the budget (`gpu_memory_limit`, else this machine's card, else an H100). Resolved while
the config is read, so the resolved config (`validate --print`, the copy `train` writes into `output_dir`) holds the
numbers chosen."""

from __future__ import annotations

import logging
from typing import Any

from hellbender.config.rl import ONLINE_RL_METHODS
from hellbender.errors import ConfigError

logger = logging.getLogger("hellbender")
_MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
# Settings predicted within this share of the fastest count as equally fast: the larger micro-batch then wins (a
# larger batch uses the GPU better than the FLOPs and launch counts show), then fewer checkpointed layers.
_TIE = 0.01


def _candidates(cfg: Any, asked: list[str], facts: Any) -> list[dict[str, Any]]:
    micro_batches = _MICRO_BATCHES if "micro_batch_size" in asked else (cfg.micro_batch_size,)
    if cfg.rl == "kto":  # its KL term pairs rows within a micro-batch: at least 2
        micro_batches = tuple(mb for mb in micro_batches if mb >= 2)
    if cfg.trl is not None and cfg.rl in ONLINE_RL_METHODS:
        micro_batches = tuple(mb for mb in micro_batches if _holds_whole_groups(cfg, mb))
    modes: tuple[bool | str, ...] = (cfg.gradient_checkpointing,)
    if "gradient_checkpointing" in asked:  # a layer count or offloaded layers the config gives need checkpointing on
        needs_checkpointing = cfg.gradient_checkpointing_layers is not None or cfg.activation_offload_layers
        modes = (True, "offload") if needs_checkpointing else (False, True, "offload")
    layers = facts.layers
    out = []
    for mb in micro_batches:
        for mode in modes:
            if not mode:
                counts: tuple[int | None, ...] = (None,)
            elif "gradient_checkpointing_layers" in asked:  # at least the layers `activation_offload_layers` takes
                counts = tuple(range(max(1, cfg.activation_offload_layers), layers + 1))
            else:
                counts = (cfg.gradient_checkpointing_layers,)
            for count in counts:
                for offloaded in _offload_counts(cfg, asked, facts, mode, count):
                    out.append({
                        "micro_batch_size": mb, "gradient_checkpointing": mode,
                        "gradient_checkpointing_layers": count, "activation_offload_layers": offloaded,
                    })  # fmt: skip
    return out


def _offload_counts(cfg: Any, asked: list[str], facts: Any, mode: bool | str, count: int | None) -> range | tuple:
    """`activation_offload_layers` values to try: the config's, or with `auto` every count up to the checkpointed
    layers where offloaded layers are planned well and can run (compiled layers the planner traced: eight measured
    settings within 4%; uncompiled they measured no gain), else none."""
    if "activation_offload_layers" not in asked:
        return (cfg.activation_offload_layers,)
    if mode is not True or _why_not_offloaded(cfg, facts):
        return (0,)
    return range(0, (facts.layers if count is None else count) + 1)


def _why_not_offloaded(cfg: Any, facts: Any) -> str | None:
    """Why `activation_offload_layers: auto` cannot choose offloaded layers for this config, if it cannot."""
    if facts.compiled_layer is None:
        return "offloaded layers are chosen for compiled layers the planner traces (`torch_compile`) only"
    if cfg.uses_fsdp2 or cfg.deepspeed or cfg.compiles_cuda_graphs:  # the config checks refuse offloading there
        return "offloaded layers are refused under FSDP2, DeepSpeed and the CUDA-graph compile modes"
    return None


def _holds_whole_groups(cfg: Any, micro_batch: int) -> bool:
    """Online RL: the global batch, and the evaluation batch, hold whole groups of `trl.num_generations` completions
    (config/rl_checks.py refuses the others)."""
    from hellbender.config.rl_checks import online_batches

    return all(batch % cfg.trl.num_generations == 0 for batch in online_batches(cfg, micro_batch) if batch is not None)


def choose(cfg: Any, asked: list[str]) -> dict[str, Any]:
    """The values of the `asked` keys for the fastest predicted setting of `cfg` that fits."""
    from hellbender.plan.budget import card_and_budget
    from hellbender.plan.fit import plan_with
    from hellbender.plan.memory import GIB
    from hellbender.plan.model_facts import describe, meta_model
    from hellbender.plan.settings import plan_settings

    card, budget_gib, source = card_and_budget(cfg)
    facts = describe(cfg, meta_model(cfg))
    base = plan_settings(cfg, facts=facts)
    named = ", ".join(f"`{key}: auto`" for key in asked)
    candidates = _candidates(cfg, asked, facts)
    if not candidates:  # online RL: no micro-batch tried makes whole groups with the accumulation given
        raise ConfigError(
            f"{named}: no micro-batch of {', '.join(map(str, _MICRO_BATCHES))} makes the batch whole groups of "
            f"`trl.num_generations: {cfg.trl.num_generations}` completions with `gradient_accumulation_steps: "
            f"{cfg.gradient_accumulation_steps}`. Give `micro_batch_size` a value, or make "
            "`gradient_accumulation_steps` a multiple of `num_generations`"
            + (" and set `eval_batch_size` to one" if cfg.has_eval_data and not cfg.eval_batch_size else "")
            + "."
        )
    fitting = []
    for values in candidates:
        mode = values["gradient_checkpointing"]
        settings = base.but(
            micro_batch_size=values["micro_batch_size"],
            checkpointing=bool(mode),
            offload=mode == "offload",
            checkpointed_layers=values["gradient_checkpointing_layers"],
            offloaded_layers=values["activation_offload_layers"],
        )
        plan = plan_with(cfg, facts, settings, card, int(budget_gib * GIB), source)
        if plan.fits:
            fitting.append((values, plan))
    if not fitting:
        smallest = min(values["micro_batch_size"] for values in candidates)
        every_layer = any(
            v["gradient_checkpointing"] and v["gradient_checkpointing_layers"] is None for v in candidates
        )
        raise ConfigError(
            f"{named}: no setting fits {budget_gib:.1f} GiB per GPU ({source}) by the planner's prediction, even with "
            f"micro-batch {smallest}{' and every layer checkpointed' if every_layer else ''}. Run `hellbender plan "
            "CONFIG` for the breakdown; a 4-bit base (`adapter: qlora`, `load_in_4bit: true`), Liger's fused loss or "
            "more GPUs with FSDP2 lower the need."
        )
    # Offloading only when nothing fits without it: its copies and hooks are host work, which the plan undercounts
    # where the step is bound by the host (W2 at micro-batch 2 on an H200: 0.122 s measured with 5 offloaded
    # layers against 0.095 s planned, slower than the 0.108 s of a setting that fits without offloading).
    fitting = [(v, p) for v, p in fitting if v["gradient_checkpointing"] != "offload"] or fitting
    fastest = max(plan.time.tokens_per_second for _, plan in fitting)
    near = [(v, p) for v, p in fitting if p.time.tokens_per_second >= (1 - _TIE) * fastest]
    values, plan = max(
        near,
        key=lambda vp: (
            vp[0]["micro_batch_size"],
            -(vp[1].settings.checkpointed(facts.layers)),
            -vp[0]["activation_offload_layers"],  # then less host traffic and pinned memory
        ),
    )
    chosen = {key: values[key] for key in asked}
    why_not = _why_not_offloaded(cfg, facts) if "activation_offload_layers" in asked else None
    logger.warning(
        "%s: chose %s (predicted %.1f GiB of %.1f GiB per GPU from %s, %s tokens/s on %s)%s",
        named,
        ", ".join(f"`{key}: {_yaml(value)}`" for key, value in chosen.items()),
        plan.memory.needed / GIB,
        budget_gib,
        source,
        f"{plan.time.tokens_per_second:,.0f}",
        card.name,
        f"; {why_not}" if why_not else "",
    )
    return chosen


def _yaml(value: Any) -> str:
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)
