"""`accelerator_config:` — the fields of transformers' `AcceleratorConfig` (how accelerate prepares the data loaders
and gradient accumulation), passed on to `TrainingArguments.accelerator_config`. Values that would break what
hellbender promises (its batch arithmetic, exact resume, its own process setup) are refused with the reason."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hellbender.config.values import Int


def _only_known_fields(model: type[BaseModel], raw: Any) -> Any:
    """Unknown fields named together with the known ones (transformers would fail on them when training starts)."""
    if isinstance(raw, dict):
        unknown = sorted(str(k) for k in raw if k not in model.model_fields)
        if unknown:
            raise ValueError(
                f"{', '.join(f'`{k}`' for k in unknown)} is not a field of {(model.__doc__ or '').split(', as')[0]}; "
                f"its fields are {', '.join(f'`{k}`' for k in model.model_fields)}"
            )
    return raw


class GradientAccumulationKwargs(BaseModel):
    """accelerate's GradientAccumulationPlugin, as `accelerator_config.gradient_accumulation_kwargs:`."""

    model_config = ConfigDict(extra="forbid")
    _known_fields = model_validator(mode="before")(classmethod(lambda cls, raw: _only_known_fields(cls, raw)))

    sync_each_batch: bool = Field(
        False,
        description="Synchronize gradients across processes after every micro-batch instead of once per optimizer "
        "step: more communication, but no unsynchronized gradients are kept between micro-batches (less memory "
        "with FSDP).",
    )
    num_steps: Int | None = Field(
        None,
        description="Refused: the number of micro-batches per step is `gradient_accumulation_steps`, from which "
        "hellbender plans its schedule.",
    )


REFUSED = {
    "split_batches: true": "`micro_batch_size` is the batch of each process, and the schedule counts steps from it; "
    "to keep the global batch with more processes, lower `micro_batch_size`",
    "use_seedable_sampler: false": "the order of an epoch would then depend on the random state when the data loader "
    "is built, so a resumed run could see other rows than the uninterrupted run, and hellbender's resume is exact",
    "use_configured_state: true": "hellbender sets up accelerate's process state itself, from torchrun's environment",
    "gradient_accumulation_kwargs.num_steps": "the micro-batches per step are `gradient_accumulation_steps`, from "
    "which the schedule is planned; set that instead",
}


class AcceleratorSettings(BaseModel):
    """transformers' AcceleratorConfig, as `accelerator_config:`."""

    model_config = ConfigDict(extra="forbid")

    split_batches: bool = Field(
        False,
        description="`true` is refused: `micro_batch_size` is the batch of each process, and the schedule counts "
        "steps from it. To keep the global batch with more processes, lower `micro_batch_size`.",
    )
    dispatch_batches: bool | None = Field(
        None,
        description="The main process reads every batch and sends each process its share. Default: accelerate's "
        "choice (off for prepared data); always off for streamed data, where it would slice image tensors along "
        "the wrong dimension (`true` is refused there).",
    )
    even_batches: bool = Field(
        True,
        description="When the last batch does not divide evenly over the processes, repeat rows from the start so "
        "every process gets a full batch.",
    )
    use_seedable_sampler: bool = Field(
        True,
        description="Shuffle with accelerate's seeded sampler, so the order of every epoch follows from `seed`. "
        "`false` is refused: resume is exact only when the order follows from the seed.",
    )
    non_blocking: bool | None = Field(
        None,
        description="Copy batches to the GPU without waiting for it. Default: on with a GPU (batches are pinned "
        "in memory there, which makes the copy asynchronous); `false` makes every copy wait for the GPU.",
    )
    gradient_accumulation_kwargs: GradientAccumulationKwargs | None = Field(
        None, description="accelerate's gradient-accumulation settings: `sync_each_batch`."
    )
    use_configured_state: bool = Field(
        False,
        description="`true` is refused: hellbender sets up accelerate's process state itself (from torchrun's "
        "environment).",
    )

    _known_fields = model_validator(mode="before")(classmethod(lambda cls, raw: _only_known_fields(cls, raw)))

    @model_validator(mode="after")
    def _honoured(self) -> AcceleratorSettings:
        accumulation = self.gradient_accumulation_kwargs
        asked = {
            "split_batches: true": self.split_batches,
            "use_seedable_sampler: false": not self.use_seedable_sampler,
            "use_configured_state: true": self.use_configured_state,
            "gradient_accumulation_kwargs.num_steps": accumulation is not None and accumulation.num_steps is not None,
        }
        refused = [f"`{setting}` cannot be honoured: {REFUSED[setting]}" for setting, on in asked.items() if on]
        if refused:
            raise ValueError("; ".join(refused))
        return self

    def trainer_arguments(self) -> dict[str, Any]:
        """The fields as transformers' `TrainingArguments.accelerator_config` takes them (unset ones left out)."""
        return self.model_dump(exclude_none=True)
