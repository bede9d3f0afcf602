"""Keys whose `auto` value the memory planner (`hellbender.plan.auto`) resolves while the config is read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hellbender.config.rl import DEFAULT_NUM_GENERATIONS, ONLINE_RL_METHODS

AUTO_KEYS = ("micro_batch_size", "gradient_checkpointing", "gradient_checkpointing_layers", "activation_offload_layers")
# What stands in for each `auto` key while the config is first validated, before the planner chooses.
AUTO_STAND_INS: dict[str, Any] = {
    "micro_batch_size": 1,
    "gradient_checkpointing": True,
    "gradient_checkpointing_layers": None,
    "activation_offload_layers": 0,
}


def stand_ins(raw: dict[str, Any], asked: list[str]) -> dict[str, Any]:
    """The stand-in of each `auto` key asked for in `raw`: KTO's KL term needs at least 2 rows per micro-batch, and
    online RL's batches whole groups of `trl.num_generations` completions."""
    values = {key: AUTO_STAND_INS[key] for key in asked}
    if "micro_batch_size" in values:
        if raw.get("rl") == "kto":
            values["micro_batch_size"] = 2
        elif raw.get("rl") in ONLINE_RL_METHODS:
            trl = raw.get("trl") if isinstance(raw.get("trl"), dict) else {}
            values["micro_batch_size"] = trl.get("num_generations", DEFAULT_NUM_GENERATIONS)
    return values


# (the config validated with the stand-ins, the keys asked for) -> the chosen value of each
AutoChooser = Callable[[Any, list[str]], dict[str, Any]]
