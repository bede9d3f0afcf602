"""What says whether an online RL run (GRPO, RLOO) learned its rewards, for the run report: the mean reward (and each
function's) at the first and the last logged step, the rewards' spread, how many groups scored all alike, the
completions' length and the KL to the reference. Its loss says nothing of progress: a group's advantages sum to about
zero, so the loss stays near 0 whether the policy improves or not."""

from __future__ import annotations

from typing import Any

REWARD = "reward"
FUNCTION_PREFIX = "rewards/"
# Groups whose completions all scored alike have zero advantages: they teach nothing.
ZERO_SPREAD = "frac_reward_zero_std"
MOSTLY_ALIKE = 0.5


def is_rl_log(history: list[dict[str, Any]]) -> bool:
    return any(REWARD in entry for entry in history)


def _logged(history: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [e for e in history if e.get(key) is not None and "step" in e]


def _first_last(history: list[dict[str, Any]], key: str) -> str | None:
    logged = _logged(history, key)
    if not logged:
        return None
    first, last = logged[0], logged[-1]
    return f"{first[key]:.4g} at step {first['step']}, {last[key]:.4g} at step {last['step']}"


def _share_at_last(history: list[dict[str, Any]], key: str, what: str) -> str:
    """ "; `what`: P% at the last" for the last logged value of the share `key`, or "" when it was never logged."""
    logged = _logged(history, key)
    return f"; {what}: {logged[-1][key]:.0%} at the last" if logged else ""


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def reward_lines(history: list[dict[str, Any]]) -> list[str]:
    """The report's outcome lines of an online RL run, in place of the training loss's."""
    logged = _logged(history, REWARD)
    if not logged:
        return ["- Mean reward: nothing logged yet"]
    first, last = logged[0], logged[-1]
    tail = [e[REWARD] for e in logged[-min(len(logged), max(3, len(logged) // 10)) :]]
    lines = [
        f"- Mean reward (generated completions, per logged step): {first[REWARD]:.4g} at step {first['step']}, "
        f"{last[REWARD]:.4g} at step {last['step']} (mean of the last {len(tail)} logged: {_mean(tail):.4g})"
    ]
    for key in sorted(k for k in last if k.startswith(FUNCTION_PREFIX) and k.endswith("/mean")):
        if key in first:
            name = key[len(FUNCTION_PREFIX) : -len("/mean")]
            lines.append(f"  - `{name}`: {first[key]:.4g} -> {last[key]:.4g}")
    if spread := _first_last(history, "reward_std"):
        alike = _share_at_last(history, ZERO_SPREAD, "groups whose completions all scored alike (no signal)")
        lines.append(f"- Reward spread (standard deviation): {spread}{alike}")
    if length := _first_last(history, "completions/mean_length"):
        cut = _share_at_last(history, "completions/clipped_ratio", "cut at `max_completion_length`")
        lines.append(f"- Completion length (mean tokens): {length}{cut}")
    if kl := _first_last(history, "kl"):
        lines.append(f"- KL to the reference (per token): {kl}")
    if loss := _first_last(history, "loss"):
        lines.append(
            f"- Loss (no measure of progress here: each group's advantages sum to about zero, so it stays near 0 and "
            f"the KL term moves it): {loss}"
        )
    return lines


def reward_notes(history: list[dict[str, Any]]) -> list[str]:
    """What someone judging an online RL run should not miss: a reward that did not rise, groups without signal."""
    notes = []
    rewards = [e[REWARD] for e in _logged(history, REWARD)]
    if len(rewards) >= 8:
        quarter = len(rewards) // 4
        early, late = _mean(rewards[:quarter]), _mean(rewards[-quarter:])
        if late <= early:
            notes.append(
                f"The mean reward did not rise: {early:.4g} over the first quarter of the logs, {late:.4g} over the "
                "last. Check the learning rate, the reward functions and `num_generations`."
            )
    alike = [e[ZERO_SPREAD] for e in _logged(history, ZERO_SPREAD)]
    if alike and _mean(alike[-max(1, len(alike) // 4) :]) > MOSTLY_ALIKE:
        notes.append(
            "In most groups every completion got the same reward (`frac_reward_zero_std` above "
            f"{MOSTLY_ALIKE:.0%} late in the run): such groups have zero advantages and teach nothing. A reward that "
            "grades more finely, a higher `trl.temperature` or more `trl.num_generations` gives them a signal."
        )
    return notes


def eval_reward_lines(evals: list[dict[str, Any]]) -> list[str]:
    """The report's lines of an online RL run's evaluations (completions generated for the evaluation prompts, scored
    by the same reward functions), in place of the evaluation loss's: a group's advantages sum to about zero, so that
    loss says nothing."""
    logged = _logged(evals, f"eval_{REWARD}")
    if not logged:
        return []
    key = f"eval_{REWARD}"
    last, best = logged[-1], max(logged, key=lambda e: e[key])
    lines = [
        f"- Evaluation reward (completions generated for the evaluation prompts): {last[key]:.4g} at step "
        f"{last['step']}; highest {best[key]:.4g} at step {best['step']}"
    ]
    prefix = f"eval_{FUNCTION_PREFIX}"
    for name_key in sorted(k for k in last if k.startswith(prefix) and k.endswith("/mean")):
        lines.append(f"  - `{name_key[len(prefix) : -len('/mean')]}`: {last[name_key]:.4g}")
    details = []
    if last.get(f"eval_{REWARD}_std") is not None:
        details.append(f"spread {last[f'eval_{REWARD}_std']:.4g}")
    if last.get("eval_completions/mean_length") is not None:
        details.append(f"mean completion length {last['eval_completions/mean_length']:.4g} tokens")
    if details:
        lines[0] += f" ({', '.join(details)} at the last)"
    return lines
