"""Axolotl's `wandb_*` keys (Weights & Biases) and its SwanLab plugin's `swanlab_*` keys. A `wandb_project` turns W&B
reporting on, `use_swanlab` (or a `swanlab_project`, or the plugin in `plugins:`) SwanLab reporting, as in Axolotl. The
keys reach each tracker through the environment variables it and transformers' callback for it read."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hellbender.config.plugins import SWANLAB_PLUGIN
from hellbender.config.values import Name

# key -> the environment variable wandb / transformers' WandbCallback reads it from
WANDB_ENVIRONMENT = {
    "wandb_project": "WANDB_PROJECT",
    "wandb_entity": "WANDB_ENTITY",
    "wandb_run_id": "WANDB_RUN_ID",
    "wandb_mode": "WANDB_MODE",
    "wandb_log_model": "WANDB_LOG_MODEL",
    "wandb_watch": "WANDB_WATCH",
}
# key -> the environment variable it reaches SwanLab through: transformers' SwanLabCallback passes SWANLAB_PROJECT to
# `swanlab.init`, and `swanlab.init` reads the others itself. The experiment name goes as the Trainer's `run_name`.
SWANLAB_ENVIRONMENT = {
    "swanlab_project": "SWANLAB_PROJECT",
    "swanlab_workspace": "SWANLAB_WORKSPACE",
    "swanlab_description": "SWANLAB_DESCRIPTION",
    "swanlab_mode": "SWANLAB_MODE",
}


class TrackingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    use_tensorboard: bool = Field(False, description="Log to TensorBoard; adds `tensorboard` to `report_to`.")
    wandb_project: Name | None = Field(None, description="W&B project; setting it adds `wandb` to `report_to`.")
    wandb_entity: Name | None = Field(None, description="W&B entity (user or team) the run is logged under.")
    wandb_name: Name | None = Field(None, description="W&B run name (the Trainer's `run_name`).")
    wandb_run_id: Name | None = Field(None, description="W&B run id, to continue logging into an existing run.")
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

    use_swanlab: bool | None = Field(
        None,
        description="Log to SwanLab (adds `swanlab` to `report_to`; needs `swanlab_project` and `pip install "
        "swanlab`). Default: on when `swanlab_project` is set or `plugins` lists Axolotl's SwanLab plugin; `false` "
        "turns it off even then.",
    )
    swanlab_project: str | None = Field(None, description="SwanLab project the run is logged to.")
    swanlab_experiment_name: Name | None = Field(
        None, description="SwanLab experiment name (the Trainer's `run_name`, which W&B also uses)."
    )
    swanlab_description: Name | None = Field(None, description="Description shown with the SwanLab experiment.")
    swanlab_workspace: Name | None = Field(
        None, description="SwanLab workspace (an organisation or user) the project belongs to; default your own."
    )
    swanlab_mode: Literal["cloud", "local", "offline", "disabled"] | None = Field(
        None,
        description="`cloud` syncs to SwanLab's server, `local` and `offline` keep the logs on this machine, "
        "`disabled` logs nothing.",
    )
    swanlab_log_model: bool = Field(
        False,
        description="Upload the model to SwanLab. Only `false`: SwanLab's transformers integration cannot upload "
        "models yet (it only warns), so `true` would do nothing.",
    )

    @field_validator("swanlab_project")
    @classmethod
    def _a_project_name(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("is empty: name a SwanLab project, or remove the key")
        return value

    @field_validator("swanlab_log_model")
    @classmethod
    def _no_model_upload(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "cannot be honoured: transformers' SwanLab integration does not upload models (it only warns that "
                "SwanLab cannot yet). Remove it, or set it to false"
            )
        return value


def swanlab_asked(use_swanlab: bool | None, swanlab_project: str | None, plugins: list[str]) -> bool:
    """Whether a config reports to SwanLab: `use_swanlab` when given, else a project or the plugin asks for it."""
    if use_swanlab is not None:
        return use_swanlab
    return bool(swanlab_project) or SWANLAB_PLUGIN in plugins
