"""What training prints: the progress bar, and one readable line per logged step (numbers, not quoted strings)."""

from __future__ import annotations

from typing import Any

from transformers.trainer_callback import ProgressCallback

# Logged values that say nothing to a reader of the console (they stay in trainer_state.json and the report): FLOP
# counts; TRL's `num_tokens`, which repeats `input_tokens`; the mean logits of chosen / rejected answers, which only
# TRL's developers read; and online RL's extremes of completion lengths and clipping ratios beside their means.
HIDDEN = frozenset(
    f"{prefix}{key}"
    for prefix in ("", "eval_")
    for key in (
        "total_flos",
        "num_tokens",
        "logits/chosen",
        "logits/rejected",
        "completions/min_length",
        "completions/max_length",
        "completions/min_terminated_length",
        "completions/max_terminated_length",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
    )
)
# Shown first, in this order, where logged: what says whether preference tuning (accuracy, margin) or online RL
# (the mean reward of the completions and its spread) learns.
FIRST = tuple(
    f"{prefix}{key}"
    for prefix in ("", "eval_")
    for key in ("loss", "rewards/accuracies", "rewards/margins", "reward", "reward_std")
)


def format_value(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.3e}" if value != 0 and abs(value) < 1e-3 else f"{value:,.4g}"


def step_line(logs: dict[str, Any], step: int, max_steps: int) -> str:
    keys = [key for key in FIRST if key in logs] + [key for key in logs if key not in FIRST and key not in HIDDEN]
    values = "  ".join(f"{key} {format_value(logs[key])}" for key in keys)
    return f"step {step}/{max_steps}  {values}"


class StepLines(ProgressCallback):
    """The Trainer's progress bar, with each log written as one line of `key value` pairs."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and self.training_bar is not None and logs:
            self.training_bar.write(step_line(logs, state.global_step, state.max_steps))
