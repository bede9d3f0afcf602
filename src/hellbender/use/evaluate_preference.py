"""`hellbender evaluate` for preference tuning and reward models: preference accuracy, mean reward margin and the
method's loss on the evaluation rows, scored by the same trainer code that scored them during training.

Each method's reward is the one its trainer logs: DPO / IPO / KTO `rl_beta` times how much more likely the policy
finds the answer than the reference does (summed log-probabilities); ORPO and SimPO `orpo_alpha` / `rl_beta` times
the answer's mean log-probability per token (no reference); a reward model its score. The reference is what training
used: the base model with the adapter switched off (LoRA / QLoRA), or the base model loaded again (full fine-tuning;
also with `precompute_ref_log_probs`, whose scores are not kept). As in the training log, each metric is the mean
over evaluation batches (`eval_batch_size` rows) of the per-batch mean.

KTO's rows are unpaired: its trainer logs the mean reward of the desirable and of the undesirable rows. Where the
evaluation rows hold a prompt with both a desirable and an undesirable answer, those are also scored as pairs
(`kto_pairs.py`).
"""

from __future__ import annotations

import tempfile
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.config.preference import REFERENCE_METHODS
from hellbender.errors import ConfigError

# What every pair method's trainer logs (TRL's evaluation metric -> the name `hellbender evaluate` writes). ORPO's
# and SimPO's log-probabilities are per-token means, DPO's sums.
PAIR_METRICS = {
    "eval_loss": "loss",
    "eval_rewards/accuracies": "preference_accuracy",
    "eval_rewards/margins": "mean_margin",
    "eval_rewards/chosen": "chosen_reward",
    "eval_rewards/rejected": "rejected_reward",
    "eval_logps/chosen": "chosen_logp",
    "eval_logps/rejected": "rejected_logp",
}
REPORTED: dict[str, dict[str, str]] = {
    "dpo": PAIR_METRICS,
    "ipo": PAIR_METRICS,
    "orpo": {**PAIR_METRICS, "eval_nll_loss": "nll_loss", "eval_log_odds_ratio": "log_odds_ratio"},
    "simpo": {**PAIR_METRICS, "eval_nll_loss": "nll_loss"},
    "kto": {
        "eval_loss": "loss",
        "eval_kl": "kl",
        "eval_rewards/chosen": "desirable_reward",
        "eval_rewards/rejected": "undesirable_reward",
        "eval_logps/chosen": "desirable_logp",
        "eval_logps/rejected": "undesirable_logp",
    },
    "reward_model": {
        "eval_loss": "loss",
        "eval_accuracy": "preference_accuracy",
        "eval_margin": "mean_margin",
        "eval_mean_reward": "mean_reward",
        "eval_min_reward": "min_reward",
        "eval_max_reward": "max_reward",
    },
}


def method_name(cfg: HellbenderConfig) -> str:
    return "reward_model" if cfg.reward_model else str(cfg.rl)


def preference_metrics(
    cfg: HellbenderConfig, model: Any, tokenizer: Any, rows: Any, processor: Any = None
) -> dict[str, Any]:
    """The metrics of `model` (the trained policy or reward model, as `load_trained` returns it) on the prepared
    evaluation `rows` (pairs, or KTO's unpaired rows)."""
    from hellbender.data.preference_collator import preference_collator
    from hellbender.models.stack import load_base_model
    from hellbender.train.arguments import training_arguments
    from hellbender.train.methods import preference_method
    from hellbender.train.methods.shared import build_preference_trainer, is_adapter_model
    from hellbender.train.schedule import plan_schedule

    name = method_name(cfg)
    if name not in REPORTED:
        raise ConfigError(
            f"`hellbender evaluate` scores preference pairs (DPO, IPO, KTO, ORPO, SimPO, reward models); `rl: {name}` "
            "is not evaluated this way. Its training run logs its metrics per step (trainer_state.json and the run "
            "report)."
        )
    method = preference_method(cfg)
    keywords: dict[str, Any] = {}
    if name in REFERENCE_METHODS:
        # The policy is the whole trained model: the reference is the base, loaded again. With an adapter, TRL
        # switches it off instead.
        reference = None
        if not is_adapter_model(model):
            reference = load_base_model(cfg, tokenizer).to(model.device).eval().requires_grad_(False)
        keywords["ref_model"] = reference
    # Pairs with images have hellbender's collator; None: the trainer's own.
    keywords["data_collator"] = preference_collator(cfg, tokenizer, processor)
    config_class, settings = method.arguments(cfg)
    if "precompute_ref_log_probs" in settings:  # scored now against the reference: training's scores were not kept
        settings = {**settings, "precompute_ref_log_probs": False}
    with tempfile.TemporaryDirectory(prefix="hellbender-evaluate-") as scratch:
        args = training_arguments(cfg, plan_schedule(cfg, len(rows), 1), True, False, config_class, settings)
        args.output_dir, args.report_to = scratch, []  # nothing is saved or sent to a tracker
        # TRL's trainers require training data; nothing is trained, so the evaluation rows stand in for it.
        trainer = build_preference_trainer(method.TRAINER, model, args, rows, rows, processor or tokenizer, **keywords)
        scores = trainer.evaluate()
        metrics: dict[str, Any] = {new: float(scores[old]) for old, new in REPORTED[name].items() if old in scores}
        if name == "kto":
            from hellbender.use.kto_pairs import kto_pair_metrics

            return metrics | kto_pair_metrics(trainer, cfg.rl_beta)
    return metrics | {"pairs": len(rows)}
