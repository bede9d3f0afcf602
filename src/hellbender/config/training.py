"""Config keys for the optimisation loop, checkpoints, logging and resume."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hellbender.config.optimizer_names import optimizer_problem, scheduler_problem
from hellbender.config.values import SEED_MAX, Float, Int, PathText

Tracker = Literal["tensorboard", "wandb", "mlflow", "swanlab"]
LrScheduler = Literal[
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt"
]


class TrainingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    output_dir: PathText = Field(
        "./outputs", description="Where checkpoints, the final model and the resolved config go."
    )
    micro_batch_size: Annotated[Int, Field(gt=0)] | Literal["auto"] = Field(
        1,
        description="Rows (or packed bins) per device per forward pass. `auto`: the memory planner picks the fastest "
        "predicted micro-batch that fits `gpu_memory_limit` (else the GPU's memory); `gradient_accumulation_steps` "
        "stays as given (docs/plan.md).",
    )
    eval_batch_size: Int | None = Field(
        None, gt=0, description="Rows per evaluation batch; default `micro_batch_size`."
    )
    gradient_accumulation_steps: Int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    num_epochs: Float = Field(1.0, gt=0, description="Passes over the training data (ignored when `max_steps` is set).")
    max_steps: Int | None = Field(
        None, gt=0, description="Stop after this many optimizer steps. Required with streaming."
    )
    learning_rate: Float | None = Field(
        None, gt=0, description="Peak learning rate; default 2e-4 with an adapter, 2e-5 for full fine-tuning."
    )
    lr_scheduler: LrScheduler = Field("cosine", description="Learning-rate schedule after warm-up.")
    warmup_steps: Int | None = Field(
        None,
        ge=0,
        description="Warm-up steps; default 0 (or `warmup_ratio`). A number below 1 (`0.1`) is read as "
        "`warmup_ratio`, as transformers 5 reads it.",
    )
    warmup_ratio: Float | None = Field(None, ge=0, lt=1, description="Warm-up as a fraction of all steps.")
    lr_quadratic_warmup: bool = Field(
        False,
        description="With `lr_scheduler: cosine`: warm up along (step / warm-up steps)^2 instead of a straight line, "
        "so the learning rate stays low longer at the start.",
    )
    cosine_min_lr_ratio: Float | None = Field(
        None,
        ge=0,
        le=1,
        description="With `lr_scheduler: cosine`: the cosine decays to this fraction of `learning_rate` instead of "
        "to 0 (`1.0` keeps the learning rate constant after warm-up).",
    )
    cosine_constant_lr_ratio: Float | None = Field(
        None,
        gt=0,
        le=1,
        description="With `cosine_min_lr_ratio`: the cosine reaches its floor after this fraction of all steps and "
        "the learning rate stays there to the end (`0.8`: decay until 80% of the steps, then hold). `0` is read as "
        "unset, as in Axolotl.",
    )
    optimizer: str = Field(
        "auto",
        description="Optimizer name as transformers knows it (`adamw_torch_fused`, `adamw_torch`, `adamw_bnb_8bit`, "
        "`sgd`, ...). `auto`: `adamw_torch_fused` on a GPU (5% faster than `adamw_torch` on a 1B full fine-tune, "
        "docs/benchmarks.md), `adamw_torch` on CPU, decided on the machine that trains. Checked against the "
        "installed transformers' names; an optimizer built from another package (`torchao`, `bitsandbytes`, "
        "`schedulefree`, ...) needs it on the machine that trains, or `train` stops at its start (`validate` notes "
        "it).",
    )
    weight_decay: Float = Field(0.0, ge=0, description="Decoupled weight decay.")
    adam_beta1: Float | None = Field(
        None, ge=0, lt=1, description="Adam beta1, at least 0 and below 1; default 0.9 (transformers' default)."
    )
    adam_beta2: Float | None = Field(
        None, ge=0, lt=1, description="Adam beta2, at least 0 and below 1; default 0.999 (transformers' default)."
    )
    adam_epsilon: Float | None = Field(
        None,
        gt=0,
        description="Adam epsilon, above 0 (with 0, a weight whose gradient is zero, such as an unused embedding row, "
        "becomes 0/0 = NaN at the first step); default 1e-8 (transformers' default).",
    )
    max_grad_norm: Float = Field(1.0, ge=0, description="Gradient clipping norm; 0 disables clipping.")
    gradient_checkpointing: bool | Literal["offload", "auto"] = Field(
        False,
        description="Recompute each layer's activations in backward to save memory (always non-reentrant); `auto`: "
        "the memory planner picks off, on or `offload`, the fastest predicted that fits (offloading only when "
        "nothing else does; docs/plan.md); "
        "`offload` also keeps the layers' saved inputs in pinned host memory until backward, copied on a side stream "
        "(host memory needed: layers x tokens x hidden size x 2 bytes in bf16, about 85 GiB for an 8B model at "
        "350k tokens).",
    )
    gradient_checkpointing_kwargs: dict[str, Any] | None = Field(
        None,
        description="Arguments of the checkpointing call, as Axolotl passes them to transformers. hellbender's "
        "checkpointing is always non-reentrant, so `{use_reentrant: false}` is what happens; `use_reentrant: true` "
        "and other arguments are refused.",
    )
    gradient_checkpointing_layers: Annotated[Int, Field(ge=0)] | Literal["auto"] | None = Field(
        None,
        description="Checkpoint only the first N decoder layers; the others keep their activations, so they are not "
        "recomputed in backward. A dial between memory and speed: each layer left out costs its activations (measured: "
        "about 0.5 GiB per layer for an 8B model at 4,096 tokens with Liger's kernels) and saves its recomputation. "
        "Default: all layers. `auto`: the memory planner picks the fewest that fit (docs/plan.md).",
    )
    activation_offload_layers: Annotated[Int, Field(ge=0)] | Literal["auto"] = Field(
        0,
        description="Of the checkpointed layers, run N once instead of recomputing them in backward, with everything "
        "they save for backward waiting in pinned host memory: copied out on a side stream while the next layers "
        "compute, and fetched back while the checkpointed layers above them run their backward. It trades "
        "recomputation for host-link traffic (about 0.5 GiB each way per layer of an 8B model at 4,096 tokens) at "
        "the GPU memory of checkpointing; the offloaded layers are spread evenly over the checkpointed ones so the "
        "copies overlap compute. Needs activation checkpointing; at most `gradient_checkpointing_layers` (default: "
        "every layer). Measured in docs/benchmarks.md. `auto`: the memory planner picks the count with the fastest "
        "predicted step that fits, for compiled layers it traces (`torch_compile`; docs/plan.md), and 0 otherwise "
        "(uncompiled, offloaded layers measured no gain).",
    )
    gpu_memory_limit: Annotated[Float, Field(gt=0)] | str | None = Field(
        None,
        description="GPU memory each training process may use, in GiB (`20`) or with a unit (`20GiB`, `80GB`). `train` "
        "plans the run's peak memory first (`hellbender plan`, docs/plan.md) and refuses a config whose predicted "
        "need exceeds it, before any data is prepared, naming the smallest change that fits. (Axolotl uses the key to "
        "let accelerate place weights on the CPU beyond the limit; hellbender never does that.)",
    )
    logging_steps: Int | None = Field(
        None, gt=0, description="Log every N steps; default about 10 logs per run, at least every 10 steps."
    )
    save_steps: Int | None = Field(
        None,
        gt=0,
        description="Save a checkpoint every N steps. Default: once per epoch (streamed data: every tenth of `max_steps`).",
    )
    saves_per_epoch: Int | None = Field(
        None, gt=0, description="Save this many checkpoints per epoch (streamed data: over the whole `max_steps`)."
    )
    save_total_limit: Int | None = Field(None, gt=0, description="Keep at most this many checkpoints.")
    save_only_model: bool = Field(
        False,
        description="Checkpoints hold the model (or adapter) only, without optimizer, scheduler and random state: "
        "smaller and faster to write, but a run cannot resume from them (resuming from one is refused).",
    )
    save_first_step: bool = Field(
        False, description="Also save a checkpoint after the first optimizer step (to check saving early)."
    )
    eval_steps: Int | None = Field(
        None,
        gt=0,
        description="Evaluate every N steps when there is evaluation data. Default: once per epoch (streamed data: every tenth of `max_steps`).",
    )
    evals_per_epoch: Int | None = Field(
        None, gt=0, description="Evaluate this many times per epoch (streamed data: over the whole `max_steps`)."
    )
    early_stopping_patience: Int | None = Field(
        None,
        gt=0,
        description="Stop training when the evaluation loss has not improved for this many evaluations in a row; the "
        "final model is then the checkpoint with the best evaluation loss. Needs evaluation data, and `save_steps` a "
        "multiple of `eval_steps` (each evaluation that may be the best is saved).",
    )
    seed: Int = Field(
        42,
        ge=0,
        le=SEED_MAX,
        description="Seed for initialisation, shuffling, dropout and data splits: 0 to 2**32 - 1 (transformers also "
        "seeds numpy, which takes no larger seed).",
    )
    report_to: list[Tracker] | Tracker | Literal["none"] = Field(
        "none", description="Experiment trackers to log to (each must be installed)."
    )
    resume_from_checkpoint: PathText | None = Field(None, description="Checkpoint directory to resume from exactly.")
    auto_resume_from_checkpoints: bool = Field(
        False, description="Resume from the newest complete checkpoint in `output_dir` if there is one."
    )
    ignore_data_skip: bool = Field(
        False, description="On resume, do not fast-forward the data to where the checkpoint stopped."
    )
    dataloader_num_workers: Annotated[Int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description="Background processes loading batches. `auto`: 4 for prepared image+text data on a GPU (image "
        "processing then keeps up with the GPU: 1.40x on the Gemma-4-E2B benchmark, docs/benchmarks.md), else 0, "
        "decided on the machine that trains.",
    )
    loss_watchdog_threshold: Float | None = Field(
        None,
        gt=0,
        description="Stop the run (saving a checkpoint, writing no final model) when the logged training loss stays "
        "above this for `loss_watchdog_patience` logged steps in a row; about twice the starting loss is a good value.",
    )
    loss_watchdog_patience: Int = Field(
        3, gt=0, description="Logged steps in a row above `loss_watchdog_threshold` before the run stops."
    )
    ddp_find_unused_parameters: bool | None = Field(
        None,
        description="With several processes (DDP): look for parameters that got no gradient in a step (needed when "
        "some parameters are unused, slower).",
    )
    memory_watchdog: Literal["warn", "error", "off"] = Field(
        "warn",
        description="Watch memory per step and report steady growth (a leak) with its rate and the step it would run "
        "out at: `warn`, `error` (stop the run), or `off`.",
    )

    @field_validator("optimizer")
    @classmethod
    def _optimizer_is_known(cls, name: str) -> str:
        if problem := optimizer_problem(name):
            raise ValueError(problem)
        return name

    @field_validator("micro_batch_size", "gradient_checkpointing", "gradient_checkpointing_layers")
    @classmethod
    def _auto_is_resolved(cls, value: object) -> object:
        if value == "auto":  # `load_config` replaces it with the planner's choice before the values are checked
            raise ValueError("`auto` is resolved by the memory planner when the config is read with `load_config`")
        return value

    @field_validator("gpu_memory_limit")
    @classmethod
    def _memory_limit_has_a_unit(cls, value: float | str | None) -> float | str | None:
        if isinstance(value, str):
            memory_limit_gib(value)  # raises ValueError naming what is wrong
        return value

    @field_validator("lr_scheduler", mode="before")
    @classmethod
    def _scheduler_is_known(cls, name: object) -> object:
        if isinstance(name, str) and (problem := scheduler_problem(name, get_args(LrScheduler))):
            raise ValueError(problem)
        return name


_UNITS = {"gib": 1.0, "gb": 1e9 / 1024**3, "mib": 1 / 1024, "mb": 1e6 / 1024**3}


def memory_limit_gib(value: float | str) -> float:
    """`gpu_memory_limit` in GiB: a number is GiB (Axolotl's reading); text carries its unit (`20GiB`, `80GB`)."""
    if not isinstance(value, str):
        return float(value)
    text = value.strip().lower().replace(" ", "")
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if text.endswith(u)), None)
    try:
        number = float(text[: -len(unit)] if unit else text)
    except ValueError:
        number = -1.0
    if number <= 0:
        raise ValueError(f"`{value}` is not an amount of memory: give GiB as a number (`20`) or with a unit (`20GiB`)")
    return number * _UNITS[unit or "gib"]
