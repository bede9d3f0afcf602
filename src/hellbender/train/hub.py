"""`hub_model_id`: push the trained model to the Hugging Face Hub with huggingface_hub's `create_repo` and
`upload_folder`, from the main process only.

When is decided by `hub_strategy`, with transformers' meanings: `end` pushes the final model; `every_save` also pushes
the model files of each checkpoint as it is saved; `checkpoint` also mirrors the whole latest checkpoint into
`last-checkpoint/` (resumable); `all_checkpoints` also pushes each checkpoint into `checkpoint-N/`. The final model
always goes to the repository's root at the end.

Whether the hub can be reached is checked when the run starts (a token, not offline) and the repository is created
then, so a run that cannot push stops before it prepares data, never after hours of training."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from transformers import TrainerCallback

from hellbender.config import HellbenderConfig
from hellbender.errors import EnvironmentProblem
from hellbender.storage import FINAL_MANIFEST

logger = logging.getLogger("hellbender")

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
LAST_CHECKPOINT = "last-checkpoint"
# What a checkpoint holds only to resume training (optimizer, schedule, RNG, DeepSpeed's and FSDP's shards, the
# manifest); the rest of it is the model as saved at that step. fnmatch patterns: `*` crosses folders.
RESUME_STATE = [
    "optimizer*",
    "scheduler.pt",
    "scaler.pt",
    "rng_state*",
    "generation_buffer_*",  # online RL's completions between two generations (train/methods/generation_state.py)
    "training_args.bin",
    "hellbender_checkpoint.json",
    "global_step*",
    "latest",
    "zero_to_fp32.py",
    "pytorch_model_fsdp*",
]


class HubApi(Protocol):
    """The part of `huggingface_hub.HfApi` a push uses; tests pass a stand-in."""

    def create_repo(self, repo_id: str, *, private: bool, exist_ok: bool) -> Any: ...

    def create_branch(self, repo_id: str, *, branch: str, exist_ok: bool) -> Any: ...

    def upload_folder(
        self,
        *,
        repo_id: str,
        folder_path: str,
        path_in_repo: str | None = None,
        revision: str | None = None,
        commit_message: str | None = None,
        allow_patterns: list[str] | None = None,
        ignore_patterns: list[str] | None = None,
        delete_patterns: list[str] | None = None,
    ) -> Any: ...


def _is_set(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_problem(
    cfg: HellbenderConfig,
    environ: Mapping[str, str] | None = None,
    token_lookup: Callable[[], str | None] | None = None,
) -> str | None:
    """Why this run could not push to the hub, known before any work: offline mode, or no token. None without
    `hub_model_id` or when nothing stands in the way (the network itself is tried when the repository is created)."""
    if not cfg.hub_model_id:
        return None
    environ = os.environ if environ is None else environ  # looked up now: libraries may replace os.environ
    offline = [name for name in OFFLINE_VARIABLES if _is_set(environ.get(name))]
    if offline:
        return (
            f"`hub_model_id: {cfg.hub_model_id}` pushes the trained model to the Hugging Face Hub, but {offline[0]}="
            f"{environ[offline[0]]} turns the hub off in this environment. Unset {offline[0]} to push, or remove "
            "`hub_model_id` (and `hub_strategy` / `hub_revision`) to train offline and upload `output_dir` later with "
            "`hf upload`."
        )
    if token_lookup is None:
        from huggingface_hub import get_token as token_lookup
    if not token_lookup():
        return (
            f"`hub_model_id: {cfg.hub_model_id}` pushes the trained model to the Hugging Face Hub, but no token is "
            "found: log in with `hf auth login` or set HF_TOKEN to a token with write access, or remove "
            "`hub_model_id` (and `hub_strategy` / `hub_revision`) to train without pushing."
        )
    return None


class HubPublisher:
    """Pushes what `hub_strategy` asks for, when it asks for it. Every method is called on the main process only."""

    def __init__(self, repo_id: str, strategy: str, revision: str | None, api: HubApi) -> None:
        self.repo_id = repo_id
        self.strategy = strategy
        self.revision = revision
        self.api = api

    def prepare(self) -> None:
        """Create the repository (private, as Axolotl creates it; an existing one is kept as it is) and the branch,
        at the start of the run: a wrong token or repository id stops the run before it trains."""
        try:
            created = self.api.create_repo(self.repo_id, private=True, exist_ok=True)
            self.repo_id = getattr(created, "repo_id", None) or self.repo_id  # `name` alone: under the token's user
            if self.revision:
                self.api.create_branch(self.repo_id, branch=self.revision, exist_ok=True)
        except Exception as exc:  # the hub's client raises HTTP, connection and validation errors alike
            raise EnvironmentProblem(
                f"`hub_model_id: {self.repo_id}`: the repository could not be created or reached on the Hugging Face "
                f"Hub ({_first_line(exc)}). Check the token's write access to it and the network, or remove "
                "`hub_model_id` to train without pushing."
            ) from None

    def checkpoint_saved(self, checkpoint: Path, step: int) -> None:
        """After `checkpoint-N` is complete. A failed upload is reported and training goes on: the checkpoint is
        on disk, and the final push comes at the end."""
        if self.strategy == "end":
            return
        uploads: list[dict[str, Any]] = [
            dict(folder_path=str(checkpoint), ignore_patterns=RESUME_STATE, commit_message=f"Model at step {step}")
        ]
        if self.strategy == "checkpoint":
            uploads.append(
                dict(
                    folder_path=str(checkpoint),
                    path_in_repo=LAST_CHECKPOINT,
                    delete_patterns=["*"],  # the folder mirrors this checkpoint, nothing of the previous one
                    commit_message=f"Checkpoint at step {step}",
                )
            )
        elif self.strategy == "all_checkpoints":
            uploads.append(
                dict(folder_path=str(checkpoint), path_in_repo=checkpoint.name, commit_message=f"Checkpoint {step}")
            )
        for upload in uploads:
            try:
                self._upload(**upload)
            except Exception as exc:  # see `prepare`
                logger.warning(
                    "Pushing %s to %s failed (%s); training goes on, and the final model is pushed at the end.",
                    checkpoint,
                    self.repo_id,
                    _first_line(exc),
                )
                return

    def final_model_saved(self, output_dir: Path, extra_files: list[str]) -> None:
        """After the final model is saved in `output_dir`: the files its manifest lists, its manifest and
        `extra_files`, to the repository's root (checkpoints and the run report stay local)."""
        files = json.loads((output_dir / FINAL_MANIFEST).read_text())["files"]
        allowed = [*files, FINAL_MANIFEST, *extra_files]
        try:
            self._upload(folder_path=str(output_dir), allow_patterns=allowed, commit_message="Final model")
        except Exception as exc:  # see `prepare`
            raise EnvironmentProblem(
                f"`hub_model_id: {self.repo_id}`: pushing the final model failed ({_first_line(exc)}). The model is "
                f"saved in {output_dir}; upload it with `hf upload {self.repo_id} {output_dir}`."
            ) from None
        logger.info("Pushed the final model to https://huggingface.co/%s", self.repo_id)

    def _upload(self, **kwargs: Any) -> None:
        self.api.upload_folder(repo_id=self.repo_id, revision=self.revision, **kwargs)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def hub_publisher(cfg: HellbenderConfig, api: HubApi | None = None) -> HubPublisher | None:
    """The publisher for `hub_model_id`, or None without it. Without `api` (the real hub), the run must be able to
    reach the hub: offline mode or a missing token stop it here, before any work."""
    if not cfg.hub_model_id:
        return None
    if api is None:
        problem = hub_problem(cfg)
        if problem:
            raise EnvironmentProblem(problem)
        from huggingface_hub import HfApi

        api = HfApi()
    return HubPublisher(cfg.hub_model_id, cfg.hub_strategy or "every_save", cfg.hub_revision, api)


class HubPush(TrainerCallback):
    """Pushes each checkpoint as `hub_strategy` asks, once it is complete (placed after `CheckpointKeeper`)."""

    def __init__(self, publisher: HubPublisher) -> None:
        self.publisher = publisher

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            step = state.global_step
            self.publisher.checkpoint_saved(Path(args.output_dir) / f"checkpoint-{step}", step)
