"""Axolotl's `save_strategy` / `eval_strategy` (transformers' words for when to save and evaluate), read as the
schedule keys hellbender uses: `epoch` is once per epoch, `steps` defers to `save_steps` / `eval_steps`."""

from __future__ import annotations

from typing import Any

# strategy key -> (steps key, per-epoch key)
SCHEDULE_KEYS = {
    "save_strategy": ("save_steps", "saves_per_epoch"),
    "eval_strategy": ("eval_steps", "evals_per_epoch"),
}


def read_strategies(raw: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Rewrite `save_strategy` / `eval_strategy` in `raw` as schedule keys. Returns (problems, notices)."""
    problems: list[str] = []
    notices: list[str] = []
    for key, (steps_key, per_epoch_key) in SCHEDULE_KEYS.items():
        value = raw.pop(key, None)
        if value is None:
            continue
        word = "no" if value is False else str(value).lower()  # YAML 1.1 reads a bare `no` as false
        scheduled = raw.get(steps_key) is not None or raw.get(per_epoch_key) is not None
        if word == "steps":
            if not scheduled:
                problems.append(f"`{key}: steps` needs `{steps_key}` (or `{per_epoch_key}`) to say how often.")
        elif word == "epoch":
            if scheduled:
                problems.append(
                    f"`{key}: epoch` and `{steps_key}` / `{per_epoch_key}` both set when to "
                    f"{'save' if key == 'save_strategy' else 'evaluate'}; keep one."
                )
            else:
                raw[per_epoch_key] = 1
                notices.append(f"`{key}: epoch` is read as `{per_epoch_key}: 1`.")
        elif word == "no" and key == "eval_strategy":
            if scheduled or raw.get("val_set_size") or raw.get("test_datasets"):
                problems.append(
                    "`eval_strategy: no` asks for no evaluation, but evaluation data or an evaluation schedule is "
                    "set: hellbender evaluates whenever there is evaluation data. Remove `val_set_size` / "
                    "`test_datasets` (and `eval_steps` / `evals_per_epoch`) to train without evaluating."
                )
        elif word == "no":
            problems.append(
                "`save_strategy: no` is not offered: hellbender always writes checkpoints, so that a stopped run can "
                "resume exactly. Set `save_total_limit: 1` to keep only the newest one."
            )
        else:
            problems.append(
                f"`{key}: {value}` is not offered: use `steps` (with `{steps_key}`) or `epoch`"
                + (
                    ", or leave it out."
                    if key == "eval_strategy"
                    else "; hellbender does not keep a 'best' checkpoint."
                )
            )
    return problems, notices
