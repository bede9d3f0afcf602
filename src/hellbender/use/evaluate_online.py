"""`hellbender evaluate` for online RL (`rl: grpo | gdpo | rloo`): the trained model generates `trl.num_generations`
completions for each evaluation prompt (`test_datasets`, or the rows `val_set_size` holds out of `datasets`), the
config's reward functions score them, and the result is the mean reward, each function's mean, the reward's spread and
the mean completion length, over every completion.

Generation and scoring are the trainer's own (TRL's evaluation, as during training), with the sampling settings of
`trl:` (`temperature`, `top_p`, `max_completion_length`) and the random state set from `seed` first, so the same
config, model and seed give the same completions. The reward of a completion is the weighted sum of its functions'
rewards (`trl.reward_weights`), as TRL logs it; a function's None is left out of its mean, and a completion every
function skipped is left out of the reward's. Every completion is written, with its prompt, row and rewards, to a JSON
Lines file beside the metrics."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.storage import write_file_atomically


def completions_path(results: Path) -> Path:
    """Where the completions of the metrics file `results` are written: `eval_completions.jsonl` beside the default
    `eval_results.json`, else `<name>_completions.jsonl`."""
    stem = "eval" if results.name == "eval_results.json" else results.stem
    return results.with_name(f"{stem}_completions.jsonl")


def online_metrics(cfg: HellbenderConfig, model: Any, tokenizer: Any, rows: Any, completions_file: Path) -> dict:
    """The metrics of `model` (the trained policy, as `load_trained` returns it) on the evaluation prompt `rows`; each
    completion is written to `completions_file`."""
    from transformers import set_seed

    from hellbender.train.arguments import training_arguments
    from hellbender.train.methods import preference_method
    from hellbender.train.schedule import plan_schedule

    trl = cfg.trl
    assert trl is not None  # an online method without it is refused at validation
    method = preference_method(cfg)
    config_class, settings = method.arguments(cfg)
    # Nothing is trained, so no reference model is needed (its KL only enters the loss, which is not reported).
    settings = {**settings, "beta": 0.0, "log_completions": False}
    with tempfile.TemporaryDirectory(prefix="hellbender-evaluate-") as scratch:
        schedule = plan_schedule(cfg, len(rows) * trl.num_generations, 1)
        args = training_arguments(cfg, schedule, True, False, config_class, settings)
        args.output_dir, args.report_to = scratch, []  # nothing is saved or sent to a tracker
        # TRL's trainers require training data; nothing is trained, so the evaluation rows stand in for it.
        trainer = method.build_trainer(cfg, model, args, rows, rows, tokenizer)
        set_seed(cfg.seed)
        trainer.evaluate()
        completions = trainer.eval_completions
    assert completions is not None
    completions_file.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(completions_file, "".join(json.dumps(c, default=str) + "\n" for c in completions))
    return reward_summary(completions, list(trl.reward_funcs), trl.reward_weights) | {
        "prompts": len(rows),
        "completions": len(completions),
        "num_generations": trl.num_generations,
        "completions_file": str(completions_file),
    }


def reward_summary(
    completions: list[dict[str, Any]], functions: list[str], weights: list[float] | None
) -> dict[str, Any]:
    """Mean reward, its spread (sample standard deviation), each function's mean and the mean completion length (in
    tokens) of recorded completions (`OnlineRLMixin.eval_completions`)."""
    weights = list(weights) if weights is not None else [1.0] * len(functions)
    names = list(completions[0]["rewards"]) if completions else []
    totals = []
    for completion in completions:
        scores = [completion["rewards"][n] for n in names]
        if any(s is not None for s in scores):
            totals.append(sum(w * s for w, s in zip(weights, scores, strict=True) if s is not None))
    per_function = {}
    for name, function in zip(names, functions, strict=True):
        scored = [c["rewards"][name] for c in completions if c["rewards"][name] is not None]
        per_function[function] = statistics.fmean(scored) if scored else None
    lengths = [c["completion_tokens"] for c in completions]
    return {
        "reward": statistics.fmean(totals) if totals else None,
        "reward_std": statistics.stdev(totals) if len(totals) > 1 else 0.0,
        "rewards": per_function,
        "completion_length": statistics.fmean(lengths) if lengths else None,
    }
