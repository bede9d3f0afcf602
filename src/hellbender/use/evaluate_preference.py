"""`hellbender evaluate` for preference tuning (`rl: dpo` / `ipo`): preference accuracy, mean reward margin and the
preference loss on the evaluation pairs, scored by the same trainer code that scored them during training.

The reference is what training used: the base model with the adapter switched off (LoRA / QLoRA), or the base
model loaded again (full fine-tuning; also with `precompute_ref_log_probs`, whose scores are not kept). As in the
training log, each metric is the mean over evaluation batches (`eval_batch_size` pairs) of the per-batch mean.
"""

from __future__ import annotations

import tempfile
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError

# TRL's evaluation metric -> the name `hellbender evaluate` writes
REPORTED = {
    "eval_loss": "loss",
    "eval_rewards/accuracies": "preference_accuracy",
    "eval_rewards/margins": "mean_margin",
    "eval_rewards/chosen": "chosen_reward",
    "eval_rewards/rejected": "rejected_reward",
    "eval_logps/chosen": "chosen_logp",
    "eval_logps/rejected": "rejected_logp",
}
EVALUATED_METHODS = ("dpo", "ipo")


def preference_metrics(cfg: HellbenderConfig, model: Any, tokenizer: Any, pairs: Any) -> dict[str, float | int]:
    """The metrics of `model` (the trained policy, as `load_trained` returns it) on the prepared `pairs`."""
    from hellbender.models.stack import load_base_model
    from hellbender.train.arguments import training_arguments
    from hellbender.train.methods.dpo import DPOPreferenceTrainer, arguments
    from hellbender.train.methods.shared import is_adapter_model
    from hellbender.train.schedule import plan_schedule

    if cfg.rl not in EVALUATED_METHODS:
        raise ConfigError(
            f"`hellbender evaluate` scores DPO / IPO pairs; `rl: {cfg.rl}` is not evaluated yet. Its training run "
            "logs its evaluation metrics at each `eval_steps` (trainer_state.json and the run report)."
        )
    reference = None
    if not is_adapter_model(model):  # the policy is the whole trained model: the reference is the base, reloaded
        reference = load_base_model(cfg, tokenizer).to(model.device).eval().requires_grad_(False)
    # Scored now against the reference above: scores precomputed in training were never stored.
    config_class, method = arguments(cfg)
    method = {**method, "precompute_ref_log_probs": False}
    with tempfile.TemporaryDirectory(prefix="hellbender-evaluate-") as scratch:
        args = training_arguments(cfg, plan_schedule(cfg, len(pairs), 1), True, False, config_class, method)
        args.output_dir, args.report_to = scratch, []  # nothing is saved or sent to a tracker
        # DPOTrainer requires training data; nothing is trained, so the evaluation pairs stand in for it.
        trainer = DPOPreferenceTrainer(
            model=model,
            ref_model=reference,
            args=args,
            train_dataset=pairs,
            eval_dataset=pairs,
            processing_class=tokenizer,
        )
        scores = trainer.evaluate()
    return {name: float(scores[key]) for key, name in REPORTED.items() if key in scores} | {"pairs": len(pairs)}
