"""KTO's evaluation rows read as pairs, where they hold some: a prompt with both a desirable and an undesirable answer
(as in a paired dataset split into KTO rows, e.g. `trl-lib/kto-mix-14k`) gives one pair per desirable-undesirable
combination, ranked by KTO's implicit reward: `rl_beta` times the answer's log-probability under the policy minus that
under the reference, summed over the answer's tokens (the reward TRL logs as `rewards/chosen` / `rewards/rejected`,
and DPO's reward)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

# Written when no prompt of the evaluation rows has both kinds of answer.
NO_PAIRS = (
    "no prompt of the evaluation rows has both a desirable and an undesirable answer, so no pair is ranked: "
    "desirable_reward and undesirable_reward are the mean rewards of each kind of row"
)


def answer_log_probs(model: Any, batch: dict[str, Any]) -> Any:
    """Each row's summed log-probability of its answer tokens (`completion_mask`), through the fused LM head the KTO
    trainer gave the model (TRL's `add_fused_lm_head`): the trainer's own numbers, without building the logits."""
    ids = batch["input_ids"].to(model.device)
    labels = ids.masked_fill(batch["completion_mask"].to(model.device) == 0, -100)
    mask = batch["attention_mask"].to(model.device)
    log_probs = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, use_cache=False).log_probs
    return log_probs[:, -(ids.size(1) - 1) :].sum(-1)  # positions not labelled score 0


def row_rewards(trainer: Any, beta: float) -> list[float]:
    """KTO's implicit reward of each evaluation row of `trainer` (a KTO trainer), in row order. The reference is
    the trainer's: its `ref_model`, or the policy with its adapter switched off."""
    import torch

    rows, size = trainer.eval_dataset, trainer.args.per_device_eval_batch_size
    model = trainer.model.eval()
    rewards = []
    with torch.no_grad():
        for start in range(0, len(rows), size):
            batch = trainer.data_collator([rows[i] for i in range(start, min(start + size, len(rows)))])
            policy = answer_log_probs(model, batch)
            if trainer.ref_model is not None:
                reference = answer_log_probs(trainer.ref_model, batch)
            else:
                with model.disable_adapter():
                    reference = answer_log_probs(model, batch)
            rewards += (beta * (policy - reference)).tolist()
    return rewards


def pair_margins(rows: Any, rewards: list[float]) -> list[float]:
    """reward(desirable) - reward(undesirable) for every pair of answers to the same prompt among `rows`."""
    answers: dict[tuple[int, ...], dict[bool, list[float]]] = defaultdict(lambda: {True: [], False: []})
    for row, reward in zip(rows, rewards, strict=True):
        answers[tuple(row["prompt_ids"])][bool(row["label"])].append(reward)
    return [good - bad for kinds in answers.values() for good in kinds[True] for bad in kinds[False]]


def kto_pair_metrics(trainer: Any, beta: float) -> dict[str, Any]:
    """`pair_summary` of the evaluation rows of `trainer` (a KTO trainer)."""
    return pair_summary(trainer.eval_dataset, row_rewards(trainer, beta))


def pair_summary(rows: Any, rewards: list[float]) -> dict[str, Any]:
    """The row counts of each kind and, where the rows hold pairs, the share ranked right and the mean margin."""
    labels = [bool(row["label"]) for row in rows]
    counts = {"desirable_rows": sum(labels), "undesirable_rows": len(labels) - sum(labels)}
    margins = pair_margins(rows, rewards)
    if not margins:
        return counts | {"pairs": 0, "note": NO_PAIRS}
    return counts | {
        "preference_accuracy": sum(m > 0 for m in margins) / len(margins),
        "mean_margin": sum(margins) / len(margins),
        "pairs": len(margins),
    }
