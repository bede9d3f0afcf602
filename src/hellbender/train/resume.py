"""Checkpoints that are either complete and trusted, or ignored: rotation, tidying and the choice of resume point.

The Trainer writes a `checkpoint-N` directory file by file; a kill can stop it anywhere. When it has finished,
`CheckpointKeeper` writes its manifest (`storage.write_manifest`: every file with its size and SHA-256, flushed first,
and the run's identity). Only a directory whose manifest is present and whose files all match it is a checkpoint
hellbender resumes from: sizes are checked when checkpoints are listed, and the one chosen for resuming has every
hash checked too (`verify_contents`). The keeper also does the rotation (`save_total_limit`), after the manifest,
so the newest complete checkpoint is never deleted before a newer one is complete.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError
from hellbender.storage import (
    checkpoint_dirs,
    complete_checkpoints,
    content_mismatch,
    incompleteness,
    is_model_only,
    latest_checkpoint,
    write_manifest,
)
from hellbender.train.run_identity import RunIdentity

logger = logging.getLogger("hellbender")


def remove_incomplete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Delete the `checkpoint-N` directories a killed save left half-written (the run writes them again), and
    report each; returns them."""
    removed = []
    for _, path in checkpoint_dirs(output_dir):
        reason = incompleteness(path)
        if reason is not None:
            logger.warning("Ignoring and removing %s: %s.", path, reason)
            shutil.rmtree(path)
            removed.append(path)
    return removed


def checkpoint_to_resume(cfg: HellbenderConfig) -> Path | None:
    if cfg.resume_from_checkpoint:
        path = Path(cfg.resume_from_checkpoint)
        reason = "it does not exist" if not path.exists() else "it is not a directory" if not path.is_dir() else None
        reason = reason or incompleteness(path)
        if reason is not None and checkpoint_dirs(path):
            reason += f" (it holds {', '.join(p.name for _, p in checkpoint_dirs(path))}: point at one of those)"
        if reason is not None:
            raise ConfigError(
                f"`resume_from_checkpoint: {path}` is not a complete checkpoint: {reason}. Point it at a complete "
                "`checkpoint-N` directory, or use `auto_resume_from_checkpoints: true` to take the newest complete one."
            )
        return _resumable(path, "resume_from_checkpoint")
    if cfg.auto_resume_from_checkpoints:
        latest = latest_checkpoint(cfg.output_dir)
        return _resumable(latest, "auto_resume_from_checkpoints") if latest is not None else None
    return None


def resume_key(cfg: HellbenderConfig) -> str:
    """The config key that chose the checkpoint to resume from."""
    return "resume_from_checkpoint" if cfg.resume_from_checkpoint else "auto_resume_from_checkpoints"


def verify_contents(path: Path, key: str) -> None:
    """Refuse a checkpoint whose files are not byte for byte the ones its run saved (one streamed read of each file,
    on threads; the resume reads them again right after, mostly from the page cache)."""
    reason = content_mismatch(path)
    if reason is not None:
        which = f"`{path}`" if key == "resume_from_checkpoint" else f"the newest checkpoint of `output_dir`, `{path}`,"
        raise ConfigError(
            f"`{key}`: {which} was changed after it was saved: {reason}. Another run may have written into the same "
            "`output_dir`, or the file was edited or damaged. Delete that checkpoint to resume from the one before it, "
            "or resume from a checkpoint you trust."
        )


def _resumable(path: Path, key: str) -> Path:
    """`path`, unless it was written with `save_only_model`: the optimizer, scheduler and random state a run needs
    to continue exactly are not in it, and resuming without them would silently train differently."""
    if not is_model_only(path):
        return path
    which = f"`{path}`" if key == "resume_from_checkpoint" else f"the newest checkpoint of `output_dir`, `{path}`,"
    raise ConfigError(
        f"`{key}`: {which} was written with `save_only_model: true`: it holds the model (or adapter) but not the "
        "optimizer, scheduler and random state, so the run cannot continue exactly from it. Start a new run from its "
        f"weights instead (`base_model: {path}` for a full fine-tune), or resume from a checkpoint written without "
        "`save_only_model`."
    )


class CheckpointKeeper(TrainerCallback):
    """After each save: the manifest that makes the checkpoint trusted, then rotation to `save_total_limit` (which
    never removes the best checkpoint that `early_stopping_patience` keeps)."""

    def __init__(self, save_total_limit: int | None, run: RunIdentity | None = None) -> None:
        self.save_total_limit = save_total_limit
        self.run = run

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        write_manifest(directory, model_only=args.save_only_model, run=self.run.record() if self.run else None)
        if self.save_total_limit is not None:
            # The best checkpoint (early stopping loads it at the end) is kept beside the newest ones.
            best = Path(state.best_model_checkpoint).resolve() if state.best_model_checkpoint else None
            for old in complete_checkpoints(args.output_dir)[: -self.save_total_limit]:
                if old.resolve() != best:
                    shutil.rmtree(old)


class SaveFirstStep(TrainerCallback):
    """`save_first_step`: a checkpoint after the first optimizer step, whatever the save interval."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 1:
            control.should_save = True


class TrainingAlreadyDone(Exception):
    """Raised before the first step of a run resumed from a checkpoint at (or past) its last step."""


class StopIfAlreadyDone(TrainerCallback):
    """A run killed after its last checkpoint but before its final save resumes at `max_steps`, where the
    Trainer would still run one more step; this stops it before that step, with the checkpoint loaded."""

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= state.max_steps:
            raise TrainingAlreadyDone
