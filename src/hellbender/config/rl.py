"""The `trl:` block of online reinforcement learning (`rl: grpo`, `rl: rloo`), with Axolotl's key names and the fields
of TRL's `GRPOConfig` / `RLOOConfig` they feed. Its rules (the batch, the reward functions, the keys only GRPO reads)
are in `rl_checks.py`; the defaults that differ by method are filled in by `online_rl_defaults`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hellbender.config.values import Float, Int

# The loss types of TRL 1.16's GRPOTrainer that need no other key hellbender does not offer yet (`luspo` needs
# sequence-level importance sampling); a test checks them against TRL's.
GrpoLossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "vespo"]
ScaleRewards = Literal["group", "batch", "none"]
# How several reward functions are combined before the advantage (TRL's `multi_objective_aggregation`).
RewardAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
ImportanceSamplingLevel = Literal["token", "sequence"]
DEFAULT_NUM_GENERATIONS = 8
# Compiled generation reads the prompts into the static cache this many positions at a time: the prefill's
# activations, not the cache, set the peak of a whole-batch prefill. 64 rows x 256 prompt tokens of the 1B shape on an
# H200: 1.6 GiB above the model against 2.9 read whole and 2.4 for eager decoding, at about the same speed
# (bench/grpo_generation.py). Training (train/methods/online.py) and the planner (plan/generation.py) read it.
PREFILL_CHUNK_TOKENS = 64
# The `rl` methods that generate during training and read the `trl:` block. `gdpo` is GRPO whose reward functions
# are each normalised within the group before they are summed (GDPO), as Axolotl's `rl: gdpo` sets it.
ONLINE_RL_METHODS = ("grpo", "gdpo", "rloo")
# `trl:` keys TRL's RLOOTrainer has no field for: RLOO's advantage is the reward minus the mean of the group's other
# rewards, and its loss is averaged per sequence and token by token.
GRPO_ONLY_KEYS = ("loss_type", "scale_rewards", "multi_objective_aggregation", "importance_sampling_level")
# TRL's defaults of each method (GRPOConfig, RLOOConfig), written into the config at validation.
_GRPO_DEFAULTS: dict[str, Any] = {
    "beta": 0.0,
    "loss_type": "dapo",
    "scale_rewards": "group",
    "multi_objective_aggregation": "sum_then_normalize",
    "importance_sampling_level": "token",
}
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": _GRPO_DEFAULTS,
    "gdpo": {**_GRPO_DEFAULTS, "multi_objective_aggregation": "normalize_then_sum"},
    "rloo": {"beta": 0.05},
}


class TrlSettings(BaseModel):
    """TRL's GRPO and RLOO settings, as `trl:`."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _only_offered_fields(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            unknown = sorted(str(k) for k in raw if k not in cls.model_fields)
            if unknown:
                raise ValueError(
                    f"{', '.join(f'`trl.{k}`' for k in unknown)} is not offered yet (online reinforcement learning "
                    "is new in hellbender); the `trl:` keys it reads are "
                    f"{', '.join(f'`{k}`' for k in cls.model_fields)}. Remove the others"
                )
        return raw

    beta: Float | None = Field(
        None,
        ge=0,
        description="The weight of the KL penalty that keeps the policy near the reference model (GRPO: a term of the "
        "loss; RLOO: subtracted from each completion's reward). With an adapter the reference is the base model with "
        "the adapter switched off; with full fine-tuning, a frozen copy of the starting weights. 0 uses no reference "
        "at all. TRL's defaults: 0 with `rl: grpo`, 0.05 with `rl: rloo`.",
    )
    num_generations: Int = Field(
        DEFAULT_NUM_GENERATIONS,
        ge=2,
        description="Completions generated per prompt: one group, whose rewards are compared with each other. It "
        "must divide the global batch (`micro_batch_size` x `gradient_accumulation_steps` x processes), which holds "
        "that many completions of each of its prompts.",
    )
    max_completion_length: Int = Field(
        512, ge=1, description="The most tokens generated per completion; longer ones are cut there."
    )
    temperature: Float = Field(1.0, gt=0, description="The sampling temperature of the generation.")
    top_p: Float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: keep the most likely tokens up to this probability mass."
    )
    reward_funcs: Annotated[list[str], Field(min_length=1)] | None = Field(
        None,
        description="The reward functions, each `module.function`: the function `function` of the Python file "
        "`module.py` in `reward_funcs_dir` (the config file's directory by default). Validation and training "
        "import that file, so it runs the file's code: name only files you trust. Each is called with the prompts, "
        "the completions and the dataset's other columns, and returns one number (or None) per completion "
        "(docs/rl.md). An entry with a `/` or naming a directory is a reward model instead: a directory (absolute, "
        "or relative to `reward_funcs_dir`) or a hub id `org/name` of a sequence-classification checkpoint with one "
        "score (`reward_model: true` trains one), which scores each prompt with its completion. Required with "
        "`rl: grpo` and `rl: rloo`.",
    )
    reward_funcs_dir: str | None = Field(
        None,
        description="The directory `reward_funcs` files are imported from. Filled in from the config file's "
        "directory when the config is read from a file (the working directory otherwise), so the resolved config "
        "names it.",
    )
    reward_weights: Annotated[list[Float], Field(min_length=1)] | None = Field(
        None,
        description="One weight per reward function, in the same order; the reward is their weighted sum.",
    )
    loss_type: GrpoLossType | None = Field(
        None,
        description="With `rl: grpo`: how the per-token losses are combined (TRL's variants): `grpo` (mean per sequence, then over "
        "sequences), `dapo` (TRL's default: over all completion tokens of the global batch), `dr_grpo` (divided by "
        "a constant, `max_completion_length`), `bnpo` (over the tokens of the local batch), `cispo` (clipped "
        "importance weights), `sapo` (a soft gate instead of clipping), `vespo` (sequence-level soft weighting).",
    )
    scale_rewards: bool | ScaleRewards | None = Field(
        None,
        description="With `rl: grpo`: divide each advantage by the standard deviation of the rewards in its `group` (`true`, the "
        "default), in the whole `batch`, or not at all (`none` / `false`, as Dr. GRPO recommends).",
    )
    multi_objective_aggregation: RewardAggregation | None = Field(
        None,
        description="With `rl: grpo` / `gdpo` and several reward functions: `sum_then_normalize` (GRPO, TRL's "
        "default) sums the weighted rewards, then normalises the sum within the group; `normalize_then_sum` (GDPO, "
        "the default of `rl: gdpo`) normalises each function's rewards within the group first, then sums them with "
        "`reward_weights`, so a function with a wide range cannot drown out the others.",
    )
    importance_sampling_level: ImportanceSamplingLevel | None = Field(
        None,
        description="With `rl: grpo` / `gdpo`: the probability ratio of the clipped loss per `token` (GRPO, the "
        "default) or one per completion, the mean of its tokens' log-ratios (`sequence`, GSPO).",
    )
    log_completions: bool = Field(
        False,
        description="Every logging step, print a sample of prompts with their completions, rewards and advantages, "
        "and write them all to `output_dir/completions/completions_<step>.parquet` (TRL's completion log).",
    )
    num_completions_to_print: Int | None = Field(
        None,
        ge=1,
        description="With `log_completions`: how many completions are printed each logging step (all written).",
    )
    epsilon: Float = Field(0.2, gt=0, description="The clipping range of the probability ratio (lower bound).")
    epsilon_high: Float | None = Field(
        None,
        gt=0,
        description="The upper clipping bound of the ratio (DAPO's clip-higher, e.g. 0.28); default `epsilon`.",
    )
    num_iterations: Int = Field(
        1, ge=1, description="Optimizer passes over each batch of generated completions (GRPO's mu)."
    )
    mask_truncated_completions: bool = Field(
        False,
        description="Leave completions cut at `max_completion_length` out of the loss (DAPO), so an unfinished "
        "answer is not penalized for being unfinished.",
    )
    compile_generation: bool | None = Field(
        None,
        description="Generate with a static key-value cache and transformers' compiled decoding step (torch.compile; "
        "CUDA graphs on a GPU) instead of eager decoding, whose per-token cost on a GPU is mostly Python and kernel "
        "launches (2.1x the steps of plain TRL at W6, docs/rl.md). The first generation compiles (about 100 s more for "
        "a 1B model on an H200); a longer prompt than any before compiles again. Refused with `use_vllm`, FSDP2, a "
        "quantized base model, vision-language models and `torch_compile`; unset, it is on where none of these is "
        "set and a GPU generates. Liger's `liger_rope` halves its speed (a warning says so).",
    )
    use_vllm: bool = Field(
        False,
        description="Generate with vLLM (TRL's integration) instead of transformers' `generate`. Needs the `vllm` "
        "package; refused where it is not installed.",
    )

    @field_validator("scale_rewards", mode="after")
    @classmethod
    def _scale_rewards_word(cls, value: bool | str | None) -> str | None:
        """Axolotl writes a boolean; TRL reads `true` as `group` and `false` as `none`."""
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value


class RlSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trl: TrlSettings | None = Field(
        None,
        description="With `rl: grpo` or `rl: rloo`: the generation, reward and loss settings of online "
        "reinforcement learning (the `trl:` keys below; docs/rl.md).",
    )


RL_UNSET_MEANS: dict[str, str] = {
    "trl": "TRL's defaults with `rl: grpo`, `gdpo` or `rloo` (which then need `reward_funcs`)"
}
TRL_UNSET_MEANS: dict[str, str] = {
    "beta": "TRL's default of the method: 0 with `rl: grpo`, 0.05 with `rl: rloo`",
    "loss_type": "`dapo` with `rl: grpo` / `gdpo` (TRL's default); RLOO has no loss types",
    "scale_rewards": "`group` with `rl: grpo` / `gdpo` (TRL's default); RLOO does not scale its advantages",
    "multi_objective_aggregation": "`sum_then_normalize` with `rl: grpo`, `normalize_then_sum` with `rl: gdpo`",
    "importance_sampling_level": "`token` with `rl: grpo` / `gdpo`",
    "num_completions_to_print": "all of the logged completions",
    "reward_funcs": "none: required with `rl: grpo` and `rl: rloo`",
    "reward_funcs_dir": "the config file's directory",
    "reward_weights": "1.0 for each reward function",
    "epsilon_high": "`epsilon`",
    "compile_generation": "on when generating on a GPU (CUDA) with transformers' `generate`, unless the config "
    "rules it out (see the key); off on CPU, where transformers does not compile the decoding step",
}
