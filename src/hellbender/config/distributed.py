"""Config keys for training on several devices or machines: FSDP2, DeepSpeed ZeRO and Ray. hellbender configures
these engines (through accelerate and transformers' Trainer); it does not implement its own."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hellbender.config.accelerator import AcceleratorSettings
from hellbender.config.values import Int, Name, PathText

StateDictType = Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"]


class FsdpSettings(BaseModel):
    """`fsdp_config:` — Axolotl's names; the older `fsdp_`-prefixed spellings (`fsdp_offload_params`, ...) are
    accepted too."""

    model_config = ConfigDict(extra="forbid")

    transformer_layer_cls_to_wrap: Name | list[Name] | None = Field(
        None,
        description="Class name(s) of the modules to shard one by one, usually the decoder layer "
        "(`LlamaDecoderLayer`). Default: the model's own `_no_split_modules`.",
    )
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP"] = Field(
        "TRANSFORMER_BASED_WRAP", description="How modules are chosen for sharding: by decoder-layer class."
    )
    reshard_after_forward: bool = Field(
        True, description="Free each layer's gathered parameters after its forward (less memory, one more gather)."
    )
    state_dict_type: StateDictType = Field(
        "SHARDED_STATE_DICT",
        description="How checkpoints are written: each process its own shard (`SHARDED_STATE_DICT`, fast; "
        "`hellbender consolidate` joins them) or one full model (`FULL_STATE_DICT`).",
    )
    offload_params: bool = Field(False, description="Keep sharded parameters and optimizer state in host memory.")
    activation_checkpointing: bool = Field(
        False, description="Same as `gradient_checkpointing: true` (hellbender's own checkpointing is used)."
    )
    cpu_ram_efficient_loading: bool = Field(
        False, description="Only the first process reads the weights; the others receive their shards from it."
    )
    sync_module_states: bool | None = Field(
        None,
        description="FSDP1's key. Every FSDP2 process starts from the same weights (each reads them, or with "
        "`cpu_ram_efficient_loading` the first sends them), so `true` is what happens; `false` is refused with "
        "`cpu_ram_efficient_loading`.",
    )
    use_orig_params: bool | None = Field(
        None,
        description="FSDP1's key. FSDP2 always trains the original parameters, so `true` is what happens; `false` "
        "is refused.",
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_fsdp_prefix(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        renamed = {}
        for key, value in raw.items():
            name = key.removeprefix("fsdp_") if isinstance(key, str) else key
            if name in renamed:
                raise ValueError(f"`{key}` and `{name}` are both set in `fsdp_config`; keep one.")
            renamed[name] = value
        return renamed

    @property
    def layer_classes(self) -> list[str] | None:
        names = self.transformer_layer_cls_to_wrap
        if names is None:
            return None
        return [n.strip() for n in names.split(",") if n.strip()] if isinstance(names, str) else list(names)


class DistributedSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fsdp_version: Int | None = Field(
        None,
        ge=1,
        le=2,
        description="`2` shards the model with PyTorch FSDP2 (through accelerate). FSDP1 is not supported.",
    )
    fsdp_config: FsdpSettings | None = Field(None, description="FSDP2 settings; needs `fsdp_version: 2`.")
    fsdp: list[str] | str | None = Field(
        None, description="FSDP1's option list (`full_shard auto_wrap`); refused: use `fsdp_version: 2`."
    )
    fsdp_final_state_dict_type: StateDictType | None = Field(
        None,
        description="The final model is always saved whole (`FULL_STATE_DICT`, what transformers loads); "
        "`SHARDED_STATE_DICT` is refused.",
    )
    dp_shard_size: Int | None = Field(
        None,
        ge=1,
        description="FSDP2 hybrid sharding: shard the model within groups of this many processes and replicate it "
        "across the groups (default: across all processes; with only `dp_replicate_size` set, the processes it "
        "leaves).",
    )
    dp_replicate_size: Int | None = Field(
        None,
        ge=1,
        description="FSDP2 hybrid sharding: the number of groups that each hold a whole sharded copy of the model "
        "(default: the processes `dp_shard_size` leaves, else 1). `dp_shard_size` x `dp_replicate_size` must equal "
        "the number of processes.",
    )
    context_parallel_size: Int | None = Field(
        None,
        ge=1,
        description="Context parallelism under FSDP2: split every row's sequence over groups of this many processes, "
        "so each process holds 1/N of the row's activations. Padded rows run PyTorch's ring attention over SDPA "
        "(through accelerate and the transformers Trainer); packed rows (`sample_packing`) run hellbender's "
        "attention that gathers the row's keys and values and keeps the documents apart. The processes divide "
        "into `context_parallel_size` x the FSDP2 groups; rows are padded to a multiple of 2 x N.",
    )
    fp32_norms: bool = Field(
        False,
        description="Under FSDP2, keep RMSNorm / LayerNorm parameters (and their computation) in float32 under their "
        "own mixed-precision policy while the rest runs in bf16/fp16.",
    )
    fp32_norm_classes: list[str] = Field(
        default_factory=lambda: ["RMSNorm", "LayerNorm"],
        description="Which modules `fp32_norms` keeps in float32: a name without a dot matches the end of the class "
        "name (`RMSNorm` matches `LlamaRMSNorm`); a dotted name matches the full class path exactly.",
    )
    deepspeed: PathText | None = Field(
        None,
        description="Path to a DeepSpeed JSON config (ZeRO-1 / 2 / 3); a missing path named like one of Axolotl's "
        "presets (`deepspeed_configs/zero2.json`, ...) uses hellbender's preset of that name. Needs the `deepspeed` "
        "extra (`pip install 'hellbender[deepspeed]'`).",
    )
    accelerator_config: AcceleratorSettings | None = Field(
        None,
        description="Settings of transformers' `AcceleratorConfig` (how accelerate prepares data loaders and gradient "
        "accumulation), passed on: `dispatch_batches`, `even_batches`, `non_blocking`, "
        "`gradient_accumulation_kwargs.sync_each_batch`. Unknown fields are refused by name.",
    )
    use_ray: bool = Field(
        False,
        description="Run training under Ray Train's TorchTrainer, one worker per process; needs the `ray` extra.",
    )
    ray_num_workers: Int = Field(1, gt=0, description="Ray workers (training processes) with `use_ray`.")
    ray_run_name: Name = Field("hellbender", description="Name of the Ray Train run.")

    @field_validator("fsdp_version", "fsdp_config", "fsdp", "deepspeed", mode="before")
    @classmethod
    def _unset_when_empty(cls, value: Any) -> Any:
        """Axolotl configs often carry `deepspeed: false`, `fsdp: []` and the like, which ask for nothing."""
        return None if value is False or value in ("", [], {}) else value

    @property
    def uses_fsdp2(self) -> bool:
        return self.fsdp_version == 2

    @property
    def splits_sequences(self) -> bool:
        """Context parallelism: each row's sequence is split over `context_parallel_size` processes."""
        return (self.context_parallel_size or 1) > 1

    @property
    def fsdp_settings(self) -> FsdpSettings:
        return self.fsdp_config or FsdpSettings()
