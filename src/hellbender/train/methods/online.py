"""What online reinforcement learning (`rl: grpo`, `rl: rloo`) shares on TRL's GRPOTrainer and RLOOTrainer: the
`trl:` fields both configs have, the user's reward functions wrapped so that a failing one is named with its row, and
the trainers' prompt rows and token counts. The model generates `trl.num_generations` completions per prompt with
transformers' `generate`; TRL receives the model hellbender built and applies hellbender's tokenizer and chat template
to the prompts itself."""

from __future__ import annotations

import json
import logging
import math
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hellbender.config import HellbenderConfig
from hellbender.config.precision import torch_dtype
from hellbender.config.reward_functions import load_reward_function, reward_model_source
from hellbender.config.rl import PREFILL_CHUNK_TOKENS
from hellbender.config.rl_checks import compiled_generation_blocker
from hellbender.data.contexts import image_policy
from hellbender.data.grpo_images import IMAGE_PATHS, with_opened_images
from hellbender.data.grpo_rows import ROW_COLUMN
from hellbender.data.images import ImagePolicy
from hellbender.errors import DataError
from hellbender.models.reward_scorer import load_reward_scorer
from hellbender.storage import write_file_atomically
from hellbender.train.methods.shared import build_preference_trainer, shared_arguments

logger = logging.getLogger("hellbender")

# The columns online RL reads: each row's `prompt` (the others are the reward functions' keywords).
PROMPT_COLUMNS = ("prompt",)
# Whose rows a reward function's messages name: training's, or evaluation's (`test_datasets`, or the rows of
# `datasets` that `val_set_size` held out, which keep their index there).
TRAINING_ROWS = "training"
TEST_ROWS = "`test_datasets`"
HELD_OUT_ROWS = "held-out `datasets`"
# Where `trl.log_completions` writes the completions of each evaluation, beside TRL's of training.
EVAL_COMPLETIONS = "completions/eval_completions_{step:05d}.jsonl"
# What TRL passes to every reward function besides the dataset's columns; not per-completion lists.
_TRL_KEYWORDS = ("trainer_state", "log_extra", "log_metric", "environments")


def online_arguments(cfg: HellbenderConfig) -> dict[str, Any]:
    """The fields of the `trl:` block that GRPOConfig and RLOOConfig share, beside those every method shares."""
    trl = cfg.trl
    assert trl is not None  # an online method without it is refused at validation
    return {
        **shared_arguments(),
        "beta": trl.beta,
        "num_generations": trl.num_generations,
        "max_completion_length": trl.max_completion_length,
        "temperature": trl.temperature,
        "top_p": trl.top_p,
        "reward_weights": list(trl.reward_weights) if trl.reward_weights is not None else None,
        "epsilon": trl.epsilon,
        "epsilon_high": trl.epsilon_high,
        "num_iterations": trl.num_iterations,
        "mask_truncated_completions": trl.mask_truncated_completions,
        "use_vllm": trl.use_vllm,
        # A static key-value cache is what transformers' compiled decoding step needs (`compiled_generation`).
        "cache_implementation": "static" if compiled_generation(cfg) else None,
        # The dataset's other columns are the reward functions' keywords.
        "remove_unused_columns": False,
        # TRL prints a sample of them with `rich` every logging step and writes all to output_dir/completions/.
        "log_completions": trl.log_completions,
        "num_completions_to_print": trl.num_completions_to_print,
    }


def compiled_generation(cfg: HellbenderConfig) -> bool:
    """`trl.compile_generation`, or unset: on when generating on a GPU, unless the config rules it out. Eager decoding
    of a 1B model at 64 rows spends most of each token's time in Python and kernel launches
    (bench/grpo_generation.py)."""
    trl = cfg.trl
    assert trl is not None
    if trl.compile_generation is None and torch.cuda.is_available():
        blocker = compiled_generation_blocker(cfg)
        if blocker:
            logger.info("Generation decodes eagerly, not compiled (`trl.compile_generation`): %s.", blocker)
        compiled = blocker is None
    else:
        compiled = bool(trl.compile_generation)
    if compiled and cfg.liger_rope:
        logger.warning(
            "Liger's rotary kernel (`liger_rope`) breaks the compiled decoding step at every layer: decoding takes "
            "about twice as long per token as compiled without it (18.8 against 8.7 ms for a 1B model at 64 rows on an "
            "H200, bench/grpo_generation.py). Remove `liger_rope` for faster generation."
        )
    return compiled


class RewardFunction:
    """A user's reward function as TRL calls it, checked: an exception, a wrong number of scores or a score that is
    neither a number nor None becomes a DataError naming the function and the training row."""

    def __init__(self, name: str, function: Callable[..., Any]) -> None:
        self.name = name
        self.function = function
        # Whose rows it scores now, for its messages: the trainer switches it during evaluation.
        self.rows_of = TRAINING_ROWS
        self.__name__ = name.rpartition(".")[2]  # TRL logs each function's reward under this name

    def __call__(self, *, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        rows = kwargs.pop(ROW_COLUMN, None) or list(range(len(prompts)))
        try:
            scores = self.function(prompts=prompts, completions=completions, **kwargs)
        except Exception as exc:  # the user's code: any failure is theirs, reported with the row it failed on
            raise DataError(self._failure(exc, prompts, completions, rows, kwargs)) from None
        if scores is None or isinstance(scores, (str, bytes)) or not hasattr(scores, "__len__"):
            raise DataError(
                f"Reward function `{self.name}` returned {type(scores).__name__}, not a list of scores: it must "
                f"return one number (or None to skip) per completion, {len(completions)} here."
            )
        scores = list(scores)
        if len(scores) != len(completions):
            raise DataError(
                f"Reward function `{self.name}` returned {len(scores)} score(s) for {len(completions)} completions "
                f"({self.rows_of} rows {_shown_rows(rows)}): it must return one number (or None to skip) per completion, "
                "in the order of `completions`."
            )
        for position, score in enumerate(scores):
            if score is not None and (isinstance(score, bool) or not isinstance(score, numbers.Real)):
                raise DataError(
                    f"Reward function `{self.name}` returned {score!r} ({type(score).__name__}) for completion "
                    f"{position} ({self.rows_of} row {rows[position]}): a score is a number, or None to skip it."
                )
            if score is not None and math.isnan(float(score)):
                raise DataError(
                    f"Reward function `{self.name}` returned NaN for completion {position} ({self.rows_of} row "
                    f"{rows[position]}): return None to skip a completion."
                )
        return [float(s) if s is not None else None for s in scores]

    def _failure(
        self, exc: Exception, prompts: list[Any], completions: list[Any], rows: list[int], kwargs: dict[str, Any]
    ) -> str:
        """The paragraph for a function that raised: the first row it fails on alone (the whole batch's failure
        when every row alone passes)."""
        for position in range(len(completions)):
            one = {k: (v[position : position + 1] if k not in _TRL_KEYWORDS else v) for k, v in kwargs.items()}
            try:
                self.function(
                    prompts=prompts[position : position + 1], completions=completions[position : position + 1], **one
                )
            except Exception as alone:  # noqa: BLE001 - the user's code, as above
                return (
                    f"Reward function `{self.name}` failed on {self.rows_of} row {rows[position]} (completion "
                    f"{position} of the batch): {type(alone).__name__}: {alone}. Fix the function (it is called with "
                    "`prompts`, `completions` and the dataset's other columns as keywords; docs/rl.md)."
                )
        return (
            f"Reward function `{self.name}` failed on the batch of {self.rows_of} rows {_shown_rows(rows)}: "
            f"{type(exc).__name__}: {exc}. Fix the function (docs/rl.md)."
        )


def _shown_rows(rows: list[int]) -> str:
    unique = sorted(set(rows))
    return ", ".join(map(str, unique[:8])) + (", ..." if len(unique) > 8 else "")


def reward_functions(cfg: HellbenderConfig) -> tuple[list[Any], list[Any]]:
    """The entries of `trl.reward_funcs` in order, as TRL takes them: each function wrapped (`RewardFunction`), each
    reward model loaded; and beside them, each one's tokenizer (None for a function)."""
    trl = cfg.trl
    assert trl is not None and trl.reward_funcs
    directory = trl.reward_funcs_dir or "."
    scorers: list[Any] = []
    tokenizers: list[Any] = []
    for name in trl.reward_funcs:
        source = reward_model_source(name, directory)
        if source is None:
            scorers.append(RewardFunction(name, load_reward_function(name, directory)))
            tokenizers.append(None)
        else:
            model, tokenizer = load_reward_scorer(source, name, torch_dtype(cfg))
            scorers.append(model)
            tokenizers.append(tokenizer)
    return scorers, tokenizers


def build_online_trainer(
    trainer_class: type,
    cfg: HellbenderConfig,
    model: Any,
    args: Any,
    train_dataset: Any,
    eval_dataset: Any,
    tokenizer: Any,
    **hellbender: Any,
) -> Any:
    """An online method's trainer for `cfg`, on `model` as built (`build_trainable_model`) and prompt rows (`prompt`
    and the columns the reward functions read), scored by the config's reward functions and models. `hellbender`:
    `HellbenderMixin`'s keywords and the Trainer's `callbacks`."""
    scorers, scorer_tokenizers = reward_functions(cfg)
    trainer = build_preference_trainer(
        trainer_class,
        model,
        args,
        train_dataset,
        eval_dataset,
        tokenizer,
        reward_funcs=scorers,
        reward_processing_classes=scorer_tokenizers,
        **hellbender,
    )
    # A vision-language run's images are opened per batch, each path checked again against its directory.
    trainer.prompt_image_policy = image_policy(cfg) if cfg.is_multimodal else None
    # TRL builds its generation config with compilation off; the static cache `online_arguments` asked for where
    # `compiled_generation` holds is only worth it compiled.
    compiled = args.cache_implementation == "static"
    trainer.generation_config.disable_compile = not compiled
    if compiled:
        trainer.generation_config.prefill_chunk_size = PREFILL_CHUNK_TOKENS
    trainer.eval_rows_of = TEST_ROWS if cfg.test_datasets else HELD_OUT_ROWS
    return trainer


class OnlineRLMixin:
    """Put between `PreferenceMixin` and the TRL trainer's mixins: prompt rows, and the tokens of generated batches."""

    columns = PROMPT_COLUMNS
    prompt_image_policy: ImagePolicy | None = None
    eval_rows_of = TEST_ROWS
    # Each completion generated by the latest `evaluate`, with its prompt, row, length and rewards (`EvalCompletion`).
    eval_completions: list[dict[str, Any]] | None = None

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """Prompt rows with images get them decoded here, through hellbender's image sandbox, as TRL's `images`."""
        if inputs and IMAGE_PATHS in inputs[0]:
            assert self.prompt_image_policy is not None  # set by `build_online_trainer` for vision-language runs
            inputs = [with_opened_images(row, self.prompt_image_policy) for row in inputs]
        rows_of = TRAINING_ROWS if self.model.training else self.eval_rows_of  # type: ignore[attr-defined]
        for function in self.reward_funcs:  # type: ignore[attr-defined]
            if isinstance(function, RewardFunction):
                function.rows_of = rows_of
        return super()._generate_and_score_completions(inputs)  # type: ignore[misc]

    def _calculate_rewards(
        self, inputs: list[dict[str, Any]], prompts: list[Any], completions: list[Any], completion_ids: list[Any]
    ) -> Any:
        """TRL's rewards of each completion and function; during evaluation each completion is also recorded."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids)  # type: ignore[misc]
        if self.eval_completions is not None and not self.model.training:  # type: ignore[attr-defined]
            # `rewards` holds every process's completions in process order; this process's come at its index.
            start = self.accelerator.process_index * len(prompts)  # type: ignore[attr-defined]
            names = self.reward_func_names  # type: ignore[attr-defined]
            for i, (row, prompt, completion, ids) in enumerate(
                zip(inputs, prompts, completions, completion_ids, strict=True)
            ):
                scores = rewards[start + i].tolist()
                self.eval_completions.append(
                    {
                        "row": row.get(ROW_COLUMN),
                        "prompt": prompt,
                        "completion": completion,
                        "completion_tokens": len(ids),
                        "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(names, scores, strict=True)},
                    }
                )
        return rewards

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """TRL's evaluation: completions generated for the evaluation prompts, scored by the reward functions, their
        metrics logged with `eval_`; the completions are kept in `eval_completions` and, with `trl.log_completions`,
        written to `output_dir/completions/eval_completions_<step>.jsonl`."""
        self.eval_completions = []
        metrics = super().evaluate(*args, **kwargs)  # type: ignore[misc]
        if self.log_completions and self.accelerator.is_main_process:  # type: ignore[attr-defined]
            target = Path(self.args.output_dir, EVAL_COMPLETIONS.format(step=self.state.global_step))  # type: ignore[attr-defined]
            target.parent.mkdir(parents=True, exist_ok=True)
            rows = "".join(json.dumps(c, default=str) + "\n" for c in self.eval_completions)
            write_file_atomically(target, rows)
        return metrics

    def batch_tokens(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt and completion tokens, completion tokens) of a generated batch: the completions are trained."""
        completion = inputs["completion_mask"].sum()
        return inputs["prompt_mask"].sum() + completion, completion
