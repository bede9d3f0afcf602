"""`hellbender evaluate`: loss, perplexity and token accuracy of the trained model on the config's evaluation data
(for preference tuning and reward models: preference accuracy, mean reward margin and the method's loss,
`evaluate_preference.py`; for online RL: the rewards of completions generated for the evaluation prompts,
`evaluate_online.py`).

The evaluation rows are prepared exactly as for training (the same cache, the same `val_set_size` split or
`test_datasets`), batched by the training collators, and scored over the tokens training would train (labels
other than -100), each token weighing the same: loss is the mean next-token cross-entropy, perplexity its
exponential, token accuracy the share of those tokens the model ranks first. On a distillation config (`kd_trainer`)
also the distillation loss's two parts per trained token (`kd_loss`, `ce_loss`) and their weighted sum
(`distillation_loss`), with the rows' targets or the config's teacher (`evaluate_distillation.py`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.config.rl import ONLINE_RL_METHODS
from hellbender.errors import ConfigError
from hellbender.metrics import perplexity
from hellbender.storage import write_file_atomically
from hellbender.use.trained import device, find_trained, load_trained

logger = logging.getLogger("hellbender")
RESULTS_NAME = "eval_results.json"


def trained_on_eval_data(cfg: HellbenderConfig) -> list[str]:
    """The paths of `test_datasets` entries that `datasets` trains on too (the same rows: path, name, split, files)."""

    def rows(entry: Any) -> tuple:
        return (entry.path, entry.name, entry.split, str(entry.data_files))

    trained = {rows(entry) for entry in cfg.datasets}
    return [entry.path for entry in cfg.test_datasets if rows(entry) in trained]


def token_metrics(
    model: Any, rows: Any, collator: Any, batch_size: int, distillation: Any = None
) -> dict[str, float | int]:
    """Summed over every trained token of `rows`: mean loss, perplexity, token accuracy, and the token count; with
    `distillation` (a `DistillationScore`), the distillation loss's two parts too."""
    import torch
    import torch.nn.functional as F

    from hellbender.data.collator import REAL_TOKENS_KEY
    from hellbender.data.formats.base import IGNORE_INDEX
    from hellbender.data.streaming import STREAM_ROW_KEY
    from hellbender.data.teacher_targets import TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK
    from hellbender.models.packed_attention import packed_attention_mask
    from hellbender.models.packed_vision import packed_vision_inputs

    target_device = model.device if hasattr(model, "device") else device()
    loss_sum, correct, tokens = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collator([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
            # the teacher's targets of distillation rows never reach the model's forward
            stored = {key: batch.pop(key) for key in (TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK) if key in batch}
            for key in (REAL_TOKENS_KEY, STREAM_ROW_KEY):
                batch.pop(key, None)
            all_labels = batch.pop("labels").to(target_device)
            labels = all_labels[:, 1:]
            inputs = {k: v.to(target_device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            teacher_inputs = dict(inputs)  # before the packed masks: the teacher builds its own
            inputs.update(packed_attention_mask(model, inputs))  # packed rows of a family that needs them
            inputs.update(packed_vision_inputs(model, inputs))
            all_logits = model(**inputs, use_cache=False).logits
            if distillation is not None:
                distillation.add(all_logits, all_labels, stored, teacher_inputs)
            logits = all_logits[:, :-1]
            trained = labels != IGNORE_INDEX
            picked, targets = logits[trained].float(), labels[trained]
            loss_sum += F.cross_entropy(picked, targets, reduction="sum").item()
            correct += int((picked.argmax(-1) == targets).sum())
            tokens += int(trained.sum())
    if tokens == 0:
        raise ConfigError("The evaluation rows hold no trained tokens (every label is masked); nothing to score.")
    loss = loss_sum / tokens
    return {
        "loss": loss,
        "perplexity": perplexity(loss),
        "token_accuracy": correct / tokens,
        "tokens": tokens,
        **(distillation.metrics(tokens) if distillation is not None else {}),
    }


def evaluate(
    cfg: HellbenderConfig, checkpoint: str | Path | None = None, output: str | Path | None = None
) -> dict[str, Any]:
    """Score the final model of `output_dir` (or `checkpoint`) on the config's evaluation data; writes the metrics
    as JSON to `output` (default `<output_dir>/eval_results.json`) and returns them."""
    from hellbender.data.batching import build_collator
    from hellbender.data.prepare import prepare_datasets
    from hellbender.models.loading import load_tokenizer_and_processor
    from hellbender.models.packed_attention import documents_need_one_row

    if not cfg.has_eval_data:
        raise ConfigError(
            "The config has no evaluation data: set `val_set_size` (a fraction below 1, or a number of rows, held out "
            "of `datasets` as in training) or `test_datasets`, then run `hellbender evaluate` again."
        )
    trained = find_trained(cfg, checkpoint, "--checkpoint")  # before the data work, so a bad path fails at once
    target = Path(output).expanduser() if output is not None else Path(cfg.output_dir) / RESULTS_NAME
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    if cfg.rl in ONLINE_RL_METHODS:  # generated completions, scored by the reward functions
        return _evaluate_online(cfg, trained, tokenizer, processor, target)
    prepared = prepare_datasets(cfg, tokenizer, processor)
    if prepared.eval is None or len(prepared.eval) == 0:
        raise ConfigError(
            "No evaluation rows were prepared: `val_set_size` splits the prepared `datasets`, and this config's "
            "training rows are not prepared (streamed or used as they are). Set `test_datasets` instead."
        )
    also_trained = trained_on_eval_data(cfg)
    if also_trained:
        logger.warning(
            "The evaluation rows were also training rows (%s in both `datasets` and `test_datasets`): the scores say "
            "how well the model fits its training data, not how it does on unseen rows.",
            ", ".join(f"`{path}`" for path in also_trained),
        )
    model = load_trained(cfg, trained, tokenizer)
    if cfg.rl is not None or cfg.reward_model:  # preference accuracy, margin and the method's loss
        from hellbender.use.evaluate_preference import preference_metrics

        metrics = preference_metrics(cfg, model, tokenizer, prepared.eval, processor)
    else:
        distillation = None
        if cfg.distills:  # the distillation loss's parts, from the rows' targets or the config's teacher
            from hellbender.use.evaluate_distillation import DistillationScore

            distillation = DistillationScore.from_config(cfg, tokenizer)
        collator = build_collator(cfg, tokenizer, processor, one_row_per_batch=documents_need_one_row(model))
        metrics = token_metrics(model, prepared.eval, collator, cfg.eval_batch_size, distillation)
    results = {
        **metrics,
        "rows": len(prepared.eval),
        "eval_data": _eval_data(cfg),
        "eval_rows_also_trained": bool(also_trained),
        "model": str(trained.path),
        "adapter": trained.is_adapter,
        "step": trained.step,
    }
    return _written(results, target)


def _eval_data(cfg: HellbenderConfig) -> str:
    """Where the evaluation rows came from, as the results name it."""
    return "test_datasets" if cfg.test_datasets else f"val_set_size: {cfg.val_set_size:g} of datasets"


def _written(results: dict[str, Any], target: Path) -> dict[str, Any]:
    target.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(target, json.dumps(results, indent=1) + "\n")
    logger.info("Wrote %s", target)
    return results


def _evaluate_online(cfg: HellbenderConfig, trained: Any, tokenizer: Any, processor: Any, target: Path) -> dict:
    """`evaluate` for online RL: the evaluation prompts are read as training reads them (`grpo_split`)."""
    from hellbender.data.grpo_rows import grpo_split
    from hellbender.use.evaluate_online import completions_path, online_metrics

    eval_rows = grpo_split(cfg, tokenizer)[1]
    also_trained = trained_on_eval_data(cfg)
    if also_trained:
        logger.warning(
            "The evaluation prompts were also training prompts (%s in both `datasets` and `test_datasets`): the "
            "rewards say how the model does on prompts it trained on, not on unseen ones.",
            ", ".join(f"`{path}`" for path in also_trained),
        )
    model = load_trained(cfg, trained, tokenizer)
    metrics = online_metrics(cfg, model, processor or tokenizer, eval_rows, completions_path(target))
    results = {
        **metrics,
        "eval_data": _eval_data(cfg),
        "eval_rows_also_trained": bool(also_trained),
        "seed": cfg.seed,
        "model": str(trained.path),
        "adapter": trained.is_adapter,
        "step": trained.step,
    }
    return _written(results, target)
