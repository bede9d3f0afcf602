"""What a preference-tuning run's log says about learning the preference: the share of pairs whose chosen answer
the policy prefers more than the reference does (TRL's `rewards/accuracies`) and the mean reward margin, on the
training pairs (per logged step) and on the evaluation pairs, at the first and the last logged step."""

from __future__ import annotations

from typing import Any

ACCURACY, MARGIN = "rewards/accuracies", "rewards/margins"


def is_preference_log(history: list[dict[str, Any]]) -> bool:
    return any(MARGIN in entry or f"eval_{MARGIN}" in entry for entry in history)


def preference_lines(history: list[dict[str, Any]]) -> list[str]:
    """One report line for the training pairs and one for the evaluation pairs (where logged)."""
    lines = []
    for prefix, pairs in (("", "training pairs, per logged step"), ("eval_", "evaluation pairs")):
        logged = [e for e in history if f"{prefix}{ACCURACY}" in e and f"{prefix}{MARGIN}" in e and "step" in e]
        if not logged:
            continue
        first, last = logged[0], logged[-1]
        accuracy, margin = f"{prefix}{ACCURACY}", f"{prefix}{MARGIN}"
        lines.append(
            f"- Preference accuracy ({pairs}): {_share(first[accuracy])} at step {first['step']}, "
            f"{_share(last[accuracy])} at step {last['step']}; mean reward margin {first[margin]:.4g} -> "
            f"{last[margin]:.4g}"
        )
    return lines


def preference_summary(history: list[dict[str, Any]]) -> str | None:
    """The final preference accuracy and margin in one phrase: on the evaluation pairs where they were scored,
    else on the last logged training step; None for a run that is not preference tuning."""
    for prefix, pairs in (("eval_", "the evaluation pairs"), ("", "the training pairs of the last logged step")):
        logged = [e for e in history if f"{prefix}{ACCURACY}" in e and f"{prefix}{MARGIN}" in e]
        if logged:
            last = logged[-1]
            return (
                f"preference accuracy {_share(last[f'{prefix}{ACCURACY}'])}, mean reward margin "
                f"{last[f'{prefix}{MARGIN}']:.4g} on {pairs}"
            )
    return None


def _share(value: float) -> str:
    return f"{100 * value:.0f} %"
