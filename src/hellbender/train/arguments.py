"""Map a hellbender config (and its schedule) onto transformers' TrainingArguments."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from transformers import TrainingArguments

from hellbender.config import HellbenderConfig
from hellbender.config.defaults import machine_defaults
from hellbender.config.tracking import SWANLAB_ENVIRONMENT, WANDB_ENVIRONMENT
from hellbender.config.tracking_checks import run_name
from hellbender.errors import EnvironmentProblem
from hellbender.train.deepspeed import deepspeed_config
from hellbender.train.distributed import runs_on_cpu_processes
from hellbender.train.float32_precision import restate_for_legacy_readers
from hellbender.train.fsdp import check_fsdp_plugin_arguments, fsdp_arguments
from hellbender.train.lr_schedule import scheduler_arguments
from hellbender.train.sampling import sampling_strategy
from hellbender.train.schedule import Schedule

TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab"}
# trackers a key of their own turns on -> that key and how to turn it off, named when the package is missing
TURNED_ON_BY = {
    "wandb": ("wandb_project", "remove `wandb_project`"),
    "swanlab": ("use_swanlab", "set `use_swanlab: false`"),
}


def report_targets(cfg: HellbenderConfig) -> list[str]:
    targets = cfg.report_targets
    for target in targets:
        if importlib.util.find_spec(TRACKER_PACKAGES[target]) is None:
            key, undo = TURNED_ON_BY.get(target, ("", "remove it from `report_to`"))
            asked = f"`{key}` is set" if key and getattr(cfg, key) else f"`report_to` names {target}"
            raise EnvironmentProblem(
                f"{asked}, but the `{TRACKER_PACKAGES[target]}` package is not installed. Install it (`pip install "
                f"{TRACKER_PACKAGES[target]}`), or {undo}."
            )
    return targets


def tracker_environment(cfg: HellbenderConfig) -> dict[str, str]:
    """The environment variables through which the trackers and transformers' callbacks for them read the
    `wandb_*` and `swanlab_*` keys."""
    keys = dict(WANDB_ENVIRONMENT)
    if cfg.use_swanlab:
        keys.update(SWANLAB_ENVIRONMENT)
    return {variable: str(getattr(cfg, key)) for key, variable in keys.items() if getattr(cfg, key)}


def accelerator_arguments(cfg: HellbenderConfig, pinned: bool) -> dict[str, Any] | None:
    """`accelerator_config` as given, with pinned batches copied to the GPU without waiting unless told otherwise, and
    dispatching off for streamed data: every process reads the stream and keeps its share of the samples.
    Dispatching collated batches from one process would slice every tensor along its first dimension, which for
    image tensors (patches, grids) is not the batch dimension."""
    given = cfg.accelerator_config.trainer_arguments() if cfg.accelerator_config else {}
    if pinned:  # a copy from pinned memory need not wait for the GPU
        given.setdefault("non_blocking", True)
    if cfg.uses_streaming:
        given["dispatch_batches"] = False  # `true` is refused at validation
    return given or None


def trainer_compile_arguments(cfg: HellbenderConfig) -> dict[str, Any]:
    """The Trainer compiles the whole model unless the layers are compiled as the model is built (with activation
    checkpointing, models/stack.py). A backend or mode alone would turn the Trainer's compilation on."""
    if not cfg.torch_compile or cfg.compiles_layers:
        return {"torch_compile": False}
    return {
        "torch_compile": True,
        "torch_compile_backend": cfg.torch_compile_backend,
        "torch_compile_mode": cfg.torch_compile_mode,
    }


def training_arguments(
    cfg: HellbenderConfig,
    schedule: Schedule,
    has_eval: bool,
    data_resumes_itself: bool = False,
    arguments_class: type[TrainingArguments] = TrainingArguments,
    method_arguments: dict[str, Any] | None = None,
) -> TrainingArguments:
    """`data_resumes_itself`: the training data starts at the right row on resume by itself, so the Trainer
    must not skip batches. `arguments_class`: a subclass of TrainingArguments a training method's trainer reads
    (TRL's `DPOConfig`, `KTOConfig`, ...), given the same settings, with `method_arguments` added or replacing
    them. TRL's configs change several defaults of TrainingArguments (gradient checkpointing and bf16 on, learning
    rate 1e-6, logging every 10 steps); every such field is set here, so none of them applies."""
    import torch

    os.environ.update(tracker_environment(cfg))  # read when the W&B callback starts the run
    on_this_machine = machine_defaults(cfg)
    precision = on_this_machine["bf16"]
    values: dict[str, Any] = dict(
        output_dir=cfg.output_dir,
        per_device_train_batch_size=cfg.micro_batch_size,
        per_device_eval_batch_size=cfg.eval_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        num_train_epochs=cfg.num_epochs,
        max_steps=schedule.total_steps,
        learning_rate=cfg.learning_rate,
        **scheduler_arguments(cfg),
        warmup_steps=schedule.warmup_steps,
        optim=on_this_machine["optimizer"],
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_epsilon=cfg.adam_epsilon,
        use_cpu=runs_on_cpu_processes(),  # several processes without a GPU: DDP over gloo
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        tf32=cfg.tf32,
        logging_steps=schedule.logging_steps,
        logging_first_step=True,
        # The filter reads every micro-batch's loss on the host, a wait for the GPU; the divergence check stops the run
        # before a non-finite loss is logged, without waiting (train/divergence.py).
        logging_nan_inf_filter=False,
        save_strategy="steps",
        save_steps=schedule.save_steps,
        save_total_limit=None,  # CheckpointKeeper rotates, after the newer checkpoint is complete
        eval_strategy="steps" if has_eval else "no",
        eval_steps=schedule.eval_steps,
        ddp_find_unused_parameters=cfg.ddp_find_unused_parameters,
        seed=cfg.seed,
        run_name=run_name(cfg),
        data_seed=cfg.seed,
        train_sampling_strategy=sampling_strategy(cfg),
        report_to=report_targets(cfg) or "none",
        remove_unused_columns=False,
        ignore_data_skip=cfg.ignore_data_skip or data_resumes_itself,
        restore_callback_states_from_checkpoint=True,  # token counters continue on resume
        accelerator_config=accelerator_arguments(cfg, pinned=torch.cuda.is_available()),
        dataloader_num_workers=on_this_machine["dataloader_num_workers"],
        dataloader_pin_memory=torch.cuda.is_available(),
        include_num_input_tokens_seen="no",
        save_only_model=cfg.save_only_model,
        # Early stopping compares each evaluation loss with the best so far, and the best checkpoint is the final model.
        load_best_model_at_end=cfg.early_stopping_patience is not None,
        metric_for_best_model="loss" if cfg.early_stopping_patience is not None else None,
        deepspeed=deepspeed_config(cfg),
        **trainer_compile_arguments(cfg),
        **fsdp_arguments(cfg),
    )
    values.update(method_arguments or {})  # a method may set a field of every run its own way (KTO's row order)
    args = arguments_class(**values)
    restate_for_legacy_readers()  # transformers may have just set TF32 in a way torch's compiler cannot read back
    check_fsdp_plugin_arguments(cfg, getattr(args, "fsdp_plugin_args", None))
    if args.n_gpu > 1:  # one process, several GPUs: the Trainer would split every batch with nn.DataParallel
        raise EnvironmentProblem(
            f"This process sees {args.n_gpu} GPUs; hellbender trains one process per GPU. Run `hellbender train` "
            "(it keeps a lone process on one GPU), give this process one GPU with `CUDA_VISIBLE_DEVICES`, or launch "
            f"one process per GPU (`hellbender train CONFIG --nproc {args.n_gpu}`)."
        )
    return args
