"""Axolotl's `hub_*` keys: push the trained model (and, by `hub_strategy`, its checkpoints) to the Hugging Face Hub.
Only the values are checked here; whether the hub can be reached is checked when `train` starts
(`train/hub.py`), since validation runs anywhere, network or not."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# transformers' `TrainingArguments.hub_strategy` values, with the same meaning.
HubStrategy = Literal["end", "every_save", "checkpoint", "all_checkpoints"]


class HubSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hub_model_id: str | None = Field(
        None,
        description="Hugging Face Hub repository (`user/name`, or `name` under the token's user) the trained model is "
        "pushed to; created private if it does not exist. Needs a token (`hf auth login` or `HF_TOKEN`).",
    )
    hub_strategy: HubStrategy | None = Field(
        None,
        description="When to push, as transformers defines it: `end` (the final model only), `every_save` (the "
        "model at each checkpoint, then the final one), `checkpoint` (also the whole latest checkpoint, in "
        "`last-checkpoint/`), `all_checkpoints` (also each checkpoint, in `checkpoint-N/`).",
    )
    hf_use_auth_token: bool | None = Field(
        None,
        description="Axolotl's switch for downloading with your saved Hugging Face token. hellbender always sends the "
        "saved token (`HF_TOKEN`, or `hf auth login`) when there is one, which is what `true` asks for; `false` "
        "(download without it) is refused: unset `HF_TOKEN` or log out instead.",
    )
    hub_revision: str | None = Field(
        None, description="Branch of `hub_model_id` to push to; created from the default branch if missing."
    )

    @field_validator("hf_use_auth_token")
    @classmethod
    def _the_saved_token_is_used(cls, value: bool | None) -> bool | None:
        if value is False:
            raise ValueError(
                "cannot be honoured: hellbender downloads from the Hugging Face Hub with the saved token whenever "
                "there is one. Remove the key, or unset `HF_TOKEN` / run `hf auth logout` to download without it"
            )
        return value

    @field_validator("hub_model_id")
    @classmethod
    def _a_repository_id(cls, value: str | None) -> str | None:
        if value is None:
            return value
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(value)
        except HFValidationError:
            raise ValueError(
                "is not a Hugging Face Hub repository id: write `user/name` or `name` (letters, digits, `-`, `_`, `.`; "
                "at most 96 characters)"
            ) from None
        return value

    @field_validator("hub_revision")
    @classmethod
    def _a_branch_name(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("is empty: name a branch, or remove the key to push to the default branch")
        return value
