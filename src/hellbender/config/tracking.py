"""Axolotl's `wandb_*` keys: Weights & Biases reporting. A `wandb_project` turns W&B reporting on (as in Axolotl);
the keys reach wandb through the environment variables wandb and transformers' W&B callback read."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# key -> the environment variable wandb / transformers' WandbCallback reads it from
WANDB_ENVIRONMENT = {
    "wandb_project": "WANDB_PROJECT",
    "wandb_entity": "WANDB_ENTITY",
    "wandb_run_id": "WANDB_RUN_ID",
    "wandb_mode": "WANDB_MODE",
    "wandb_log_model": "WANDB_LOG_MODEL",
    "wandb_watch": "WANDB_WATCH",
}


class TrackingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    use_tensorboard: bool = Field(False, description="Log to TensorBoard; adds `tensorboard` to `report_to`.")
    wandb_project: str | None = Field(None, description="W&B project; setting it adds `wandb` to `report_to`.")
    wandb_entity: str | None = Field(None, description="W&B entity (user or team) the run is logged under.")
    wandb_name: str | None = Field(None, description="W&B run name (the Trainer's `run_name`).")
    wandb_run_id: str | None = Field(None, description="W&B run id, to continue logging into an existing run.")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="`offline` logs locally (sync later with `wandb sync`); `disabled` logs nothing."
    )
    wandb_log_model: Literal["checkpoint", "end", "false"] | None = Field(
        None, description="Upload checkpoints (`checkpoint`) or the final model (`end`) as W&B artifacts."
    )
    wandb_watch: Literal["gradients", "parameters", "all", "false"] | None = Field(
        None, description="Log gradient and/or parameter histograms to W&B."
    )

    @field_validator("wandb_log_model", "wandb_watch", mode="before")
    @classmethod
    def _false_is_a_word(cls, value: object) -> object:
        """YAML reads `false` as a boolean; W&B spells the setting as the word."""
        return "false" if value is False else value
