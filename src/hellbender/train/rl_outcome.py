"""What says whether a GRPO run learned its rewards: the mean reward (and each function's) at the first and the last
logged training step, for the run report."""

from __future__ import annotations

from typing import Any

REWARD = "reward"
FUNCTION_PREFIX = "rewards/"


def is_rl_log(history: list[dict[str, Any]]) -> bool:
    return any(REWARD in entry for entry in history)


def reward_lines(history: list[dict[str, Any]]) -> list[str]:
    """One report line for the total reward and one per reward function, first and last logged step."""
    logged = [e for e in history if REWARD in e and "step" in e]
    if not logged:
        return []
    first, last = logged[0], logged[-1]
    lines = [
        f"- Mean reward (generated completions, per logged step): {first[REWARD]:.4g} at step {first['step']}, "
        f"{last[REWARD]:.4g} at step {last['step']}"
    ]
    for key in sorted(k for k in last if k.startswith(FUNCTION_PREFIX) and k.endswith("/mean")):
        if key in first:
            name = key[len(FUNCTION_PREFIX) : -len("/mean")]
            lines.append(f"  - `{name}`: {first[key]:.4g} -> {last[key]:.4g}")
    return lines
