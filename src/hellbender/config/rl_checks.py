"""The rules of online reinforcement learning (`rl: grpo`, `rl: rloo` and their `trl:` block): the block only with
such a method, the keys only GRPO reads, whole groups in every batch, one weight per reward function, reward
functions that exist, vLLM only where installed, and the data and keys these methods do not read."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from hellbender.config.data import is_transform_type
from hellbender.config.reward_functions import (
    TRANSFORM_CALL,
    load_reward_function,
    load_user_function,
    reward_model_problem,
    reward_model_source,
)
from hellbender.config.rl import GRPO_ONLY_KEYS, ONLINE_RL_METHODS
from hellbender.config.schema import HellbenderConfig
from hellbender.errors import ConfigError


def launched_world_size() -> int:
    """The processes of this run where it is known (inside `hellbender train --nproc N`), else 1."""
    return int(os.environ["WORLD_SIZE"]) if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ else 1


def online_batches(cfg: HellbenderConfig, micro_batch: int) -> tuple[int, int | None]:
    """Completions in online RL's global batch and in its evaluation batch (None without evaluation data) at
    `micro_batch`: each must hold whole groups of `trl.num_generations`."""
    processes = launched_world_size()
    evaluation = (cfg.eval_batch_size or micro_batch) * processes if cfg.has_eval_data else None
    return micro_batch * cfg.gradient_accumulation_steps * processes, evaluation


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def rl_problems(cfg: HellbenderConfig) -> list[str]:
    """Each problem of `rl: grpo` / `rl: rloo` and the `trl:` block, one paragraph each."""
    if cfg.rl not in ONLINE_RL_METHODS:
        problems = [
            f"`{key}[{i}].type: {e.type}` names a transform function in a Python file; hellbender runs transform "
            "functions only for the prompt rows of `rl: grpo` and `rl: rloo` (docs/rl.md). Convert the rows to one of "
            "hellbender's formats (`alpaca`, `chat_template`, `completion`, `pretokenized`, or a preference type)."
            for key in ("datasets", "test_datasets")
            for i, e in enumerate(getattr(cfg, key))
            if is_transform_type(e.type)
        ]
        if cfg.trl is not None:
            now = f"this config sets `rl: {cfg.rl}`" if cfg.rl else "`rl` is not set"
            problems.append(
                f"`trl:` sets online reinforcement learning, and {now}, so it would change nothing. Set `rl: grpo` "
                "or `rl: rloo`, or remove the `trl:` block."
            )
        return problems
    method = f"`rl: {cfg.rl}`"
    trl = cfg.trl
    if trl is None or not trl.reward_funcs:
        return [
            f"{method} scores its generated completions with reward functions, and `trl.reward_funcs` names none. "
            "Add `trl:` with `reward_funcs: [module.function]` (a function of `module.py` next to the config; "
            "docs/rl.md)."
        ]
    problems: list[str] = []
    if cfg.rl == "rloo":
        problems += [
            f"`trl.{key}` is a setting of GRPO, and `rl: rloo` does not read it: RLOO's advantage is each reward "
            "minus the mean reward of the other completions of its prompt, and its loss is averaged per sequence. "
            f"Remove `trl.{key}`, or set `rl: grpo`."
            for key in GRPO_ONLY_KEYS
            if getattr(trl, key) is not None
        ]
    if cfg.rl == "gdpo" and trl.multi_objective_aggregation == "sum_then_normalize":
        problems.append(
            "`rl: gdpo` normalises each reward function within its group before summing them, and "
            "`trl.multi_objective_aggregation: sum_then_normalize` sums them first, which is GRPO. Set `rl: grpo`, or "
            "remove `multi_objective_aggregation`."
        )
    if trl.num_completions_to_print is not None and not trl.log_completions:
        problems.append(
            "`trl.num_completions_to_print` sets how many logged completions are printed, and `trl.log_completions` "
            "is off, so nothing is printed. Set `trl.log_completions: true`, or remove `num_completions_to_print`."
        )
    processes = launched_world_size()
    batch, eval_batch = online_batches(cfg, cfg.micro_batch_size)
    if batch % trl.num_generations:
        problems.append(
            f"`trl.num_generations: {trl.num_generations}` must divide the global batch, which holds that many "
            f"completions of each prompt; the batch here is {batch} completions (`micro_batch_size: "
            f"{cfg.micro_batch_size}` x `gradient_accumulation_steps: {cfg.gradient_accumulation_steps}` x "
            f"{processes} process(es)). Make the batch a multiple of {trl.num_generations} (e.g. "
            f"`gradient_accumulation_steps: {_steps_for(cfg.micro_batch_size * processes, trl.num_generations)}`), "
            "or choose a `num_generations` that divides it."
        )
    if eval_batch is not None and eval_batch % trl.num_generations:
        problems.append(
            f"`eval_batch_size: {cfg.eval_batch_size or cfg.micro_batch_size}` must hold whole groups of "
            f"`trl.num_generations: {trl.num_generations}` completions of each evaluation prompt; the evaluation "
            f"batch here is {eval_batch} completions ({processes} process(es)). Set `eval_batch_size` to a multiple "
            f"of {trl.num_generations}."
        )
    if trl.reward_weights is not None and len(trl.reward_weights) != len(trl.reward_funcs):
        problems.append(
            f"`trl.reward_weights` has {len(trl.reward_weights)} weight(s) for {len(trl.reward_funcs)} reward "
            "function(s) in `trl.reward_funcs`: give one weight per function, in the same order."
        )
    if trl.use_vllm and not vllm_installed():
        problems.append(
            "`trl.use_vllm: true` generates with vLLM, and the `vllm` package is not installed here. Install it "
            "(`pip install vllm`, on a machine with a GPU), or remove `use_vllm` to generate with transformers."
        )
    elif trl.use_vllm:
        problems.append(
            "`trl.use_vllm: true`: generation through vLLM is not verified with hellbender yet. Remove `use_vllm` "
            "to generate with transformers' `generate`."
        )
    if trl.compile_generation and (blocker := compiled_generation_blocker(cfg)):
        problems.append(
            f"`trl.compile_generation: true` cannot be used here: {blocker}. Remove `compile_generation` (generation "
            "then decodes eagerly)."
        )
    directory = trl.reward_funcs_dir or "."
    for name in trl.reward_funcs:
        if reward_model_source(name, directory) is not None:
            if problem := reward_model_problem(name, directory):
                problems.append(problem)
            continue
        try:
            load_reward_function(name, directory)
        except ConfigError as exc:
            problems.append(str(exc))
    problems += _data_problems(cfg)
    if cfg.rl_beta is not None:
        problems.append(
            f"`rl_beta` is the beta of DPO, IPO, KTO and SimPO; the KL weight of {method} is `trl.beta`. Move the "
            "value there."
        )
    return problems


def compiled_generation_blocker(cfg: HellbenderConfig) -> str | None:
    """Why generation cannot decode with a static cache and a compiled step (`trl.compile_generation`), or None."""
    trl = cfg.trl
    if trl is not None and trl.use_vllm:
        return "`trl.use_vllm` generates with vLLM, not with transformers' `generate`"
    if cfg.fsdp_version == 2:
        return "FSDP2 gathers the sharded weights for each generation, and compiling over them is not verified"
    if cfg.quantized_bits or cfg.adapter == "qlora":  # `qlora` implies 4 bits before the defaults are filled in
        return f"the base model is loaded in {cfg.quantized_bits or 4} bits, whose layers transformers does not compile"
    if cfg.is_multimodal:
        return "compiled decoding is not verified for vision-language models yet"
    if cfg.torch_compile:
        return (
            "`torch_compile` compiles the decoder layers for training, and compiling generation over them is not "
            "verified"
        )
    return None


def _steps_for(per_step: int, generations: int) -> int:
    steps = 1
    while (per_step * steps) % generations:
        steps += 1
    return steps


# Keys of data preparation (tokenizing, cutting, filtering, ordering rows) that online RL's prompt rows never go through.
PREPARATION_KEYS = (
    "excess_length_strategy", "max_prompt_len", "eval_sample_packing", "pad_to_sequence_len", "train_on_inputs",
    "dataset_exact_deduplication", "min_sample_len", "group_by_length",
    "sample_packing_sequentially", "curriculum_sampling", "skip_prepare_dataset", "eot_tokens",
)  # fmt: skip
# What an online RL entry may set: where its rows are, and for a vision-language model where its images are.
ENTRY_KEYS = ("path", "type", "ds_type", "data_files", "name", "split", "revision")
IMAGE_ENTRY_KEYS = ("image_column", "image_base_dir")


def _differs_from_default(model: Any, key: str) -> bool:
    """Set to something other than its default or `false` (the resolved config writes `false` for what validation
    fills in, and must validate again on resume)."""
    value = getattr(model, key)
    return value is not False and value != type(model).model_fields[key].get_default(call_default_factory=True)


def _prompt_entries(cfg: HellbenderConfig) -> list[tuple[str, int, Any]]:
    """(key, index, entry) of every prompt dataset: training's and evaluation's."""
    return [(key, i, e) for key in ("datasets", "test_datasets") for i, e in enumerate(getattr(cfg, key))]


def _data_problems(cfg: HellbenderConfig) -> list[str]:
    """GRPO and RLOO read prompt rows (`prompt` and any columns the reward functions read), declared without a
    `type`."""
    method = f"`rl: {cfg.rl}`"
    problems = [
        f"`{key}[{i}]` (`{e.path}`) has `type: {e.type}`, and {method} reads prompt rows: a `prompt` column "
        "(text, or a list of chat messages) and any other columns the reward functions read. Remove `type` and give "
        "the rows that shape, or name a transform `module.function` that maps each row to one (docs/rl.md)."
        for key, i, e in _prompt_entries(cfg)
        # the resolved config names rows used as they are `pretokenized`
        if e.type not in (None, "pretokenized") and not is_transform_type(e.type)
    ]
    directory = cfg.trl.reward_funcs_dir if cfg.trl is not None and cfg.trl.reward_funcs_dir else "."
    for key, i, e in _prompt_entries(cfg):
        if is_transform_type(e.type):
            try:
                load_user_function(e.type, directory, f"{key}[{i}].type", TRANSFORM_CALL)
            except ConfigError as exc:
                problems.append(str(exc))
    if cfg.pretraining_dataset:
        problems.append(
            f"`pretraining_dataset` cannot be used with {method}: online RL trains on prompts, not on streamed text. "
            "Remove `pretraining_dataset`."
        )
    for key, why in (
        ("cache_images", "the prompts' images are opened per batch, and no prepared data holds them"),
        ("vision_tokens_to_mask", "only generated completions are trained, and they hold no image tokens"),
    ):
        if getattr(cfg, key):
            problems.append(f"`{key}` cannot be used with {method}: {why}. Remove `{key}`.")
    for key in PREPARATION_KEYS:
        if _differs_from_default(cfg, key):
            problems.append(
                f"`{key}` cannot be used with {method}: it tunes the preparation of training rows, and online RL "
                f"reads its prompt rows as they are (they are not tokenized, cut or reordered beforehand). Remove `{key}`."
            )
    allowed = ENTRY_KEYS + (IMAGE_ENTRY_KEYS if cfg.is_multimodal else ())
    for key, i, entry in _prompt_entries(cfg):
        extra = [k for k in type(entry).model_fields if k not in allowed and _differs_from_default(entry, k)]
        if extra:
            problems.append(
                f"`{key}[{i}]` sets {', '.join(f'`{k}`' for k in extra)}, which {method} does not read: its rows "
                "are used as they are (`prompt` and the reward functions' columns). Remove them."
            )
    if cfg.shuffle_merged_datasets is False:
        problems.append(
            f"`shuffle_merged_datasets: false` cannot be honoured with {method}: TRL's sampler draws the prompts in "
            "a seeded random order. Remove `shuffle_merged_datasets`."
        )
    if cfg.streaming:
        problems.append(f"`streaming: true` cannot be used with {method}: its prompt rows are read whole. Remove it.")
    return problems
