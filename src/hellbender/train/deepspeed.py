"""DeepSpeed ZeRO through transformers' Trainer, at run time. hellbender does not drive DeepSpeed itself: the config's
`deepspeed:` JSON file is checked at validation (`config/deepspeed.py`) and again here, where the precision that
`bf16: auto` picks and the number of processes are known, then its path goes to the Trainer."""

from __future__ import annotations

import copy
import os
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.config.deepspeed import (
    AUTO,
    contradictions,
    deepspeed_installed,
    not_installed_message,
    read_deepspeed_json,
    settings_problems,
    value_at,
    zero_stage,
)
from hellbender.config.precision import run_precision
from hellbender.errors import ConfigError, EnvironmentProblem
from hellbender.train.distributed import world_size


def require_deepspeed_package(cfg: HellbenderConfig) -> None:
    """Stop a run that asks for DeepSpeed on a machine without it (validation only says so)."""
    if cfg.deepspeed and not deepspeed_installed():
        raise EnvironmentProblem(not_installed_message(cfg.deepspeed))


def deepspeed_config(cfg: HellbenderConfig) -> str | None:
    """The checked path of the DeepSpeed JSON config for `TrainingArguments(deepspeed=...)`, or None without
    `deepspeed:`. Checked again at run time, where the precision `bf16: auto` picks and the number of processes
    are known."""
    if not cfg.deepspeed:
        return None
    require_deepspeed_package(cfg)
    settings = read_deepspeed_json(cfg.deepspeed)
    bf16, fp16 = precision_at_run_time(cfg)
    problems = settings_problems(cfg.deepspeed, settings) + contradictions(cfg, settings, bf16, fp16, world_size())
    if problems:
        raise ConfigError("\n\n".join(problems))
    return cfg.deepspeed


def precision_at_run_time(cfg: HellbenderConfig) -> tuple[bool, bool]:
    """(bf16, fp16) as `training_arguments` passes them, with `bf16: auto` resolved on this machine."""
    precision = run_precision(cfg)
    return precision == "bf16", precision == "fp16"


def settings_for_loading(cfg: HellbenderConfig, settings: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config with the `"auto"` values that `deepspeed.zero.Init` reads filled in as the Trainer will
    fill them later (validation made sure the values that are not `"auto"` already agree). DeepSpeed drops the
    remaining `"auto"` values (bucket sizes, optimizer settings) while it partitions the weights."""
    bf16, fp16 = precision_at_run_time(cfg)
    filled = copy.deepcopy(settings)
    values = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "train_batch_size": cfg.micro_batch_size * cfg.gradient_accumulation_steps * world_size(),
        "gradient_clipping": cfg.max_grad_norm,
        "bf16.enabled": bf16,
        "fp16.enabled": fp16,
    }
    for dotted, value in values.items():
        *parents, leaf = dotted.split(".")
        node = value_at(filled, ".".join(parents)) if parents else filled
        if isinstance(node, dict) and node.get(leaf) == AUTO:
            node[leaf] = value
    return filled


def deepspeed_before_loading(cfg: HellbenderConfig) -> Any | None:
    """Called right before the model is loaded. Checks the DeepSpeed setup against this machine, and for ZeRO-3
    registers the config with transformers: `from_pretrained` partitions the weights over the processes as it reads
    them only when a DeepSpeed config is registered before loading (transformers' `HfDeepSpeedConfig`, found through
    a weak reference). The caller keeps the returned object alive until the Trainer has registered its own."""
    if deepspeed_config(cfg) is None:
        return None
    if "LOCAL_RANK" not in os.environ:
        raise EnvironmentProblem(
            f"`deepspeed: {cfg.deepspeed}` needs processes started by a launcher: run `hellbender train CONFIG "
            "--nproc N` (N GPUs), or for one GPU `torchrun --nproc_per_node 1 -m hellbender train CONFIG`."
        )
    settings = read_deepspeed_json(cfg.deepspeed)
    if zero_stage(settings) != 3:
        return None
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    # zero.Init reads the number of processes from DeepSpeed's own communication layer, which wraps the process
    # group already set up (or sets it up from the launcher's environment); uninitialised, it would count one.
    deepspeed.init_distributed()
    return HfDeepSpeedConfig(settings_for_loading(cfg, settings))
