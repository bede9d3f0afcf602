"""Checkpoints that are either complete and trusted, or ignored: manifests, rotation and the choice of resume point.

The Trainer writes a `checkpoint-N` directory file by file; a kill can stop it anywhere. When it has finished,
`CheckpointKeeper` writes `hellbender_checkpoint.json` into it (atomically, after flushing every file to disk),
listing each file and its size. Only a directory whose manifest is present and whose files all match it is a
checkpoint hellbender resumes from. The keeper also does the rotation (`save_total_limit`), after the manifest,
so the newest complete checkpoint is never deleted before a newer one is complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError

logger = logging.getLogger("hellbender")
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
MANIFEST_NAME = "hellbender_checkpoint.json"
MANIFEST_VERSION = 1


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str | bytes) -> None:
    """Write `text` to `path` so that a reader sees the old file or the whole new one, never a part."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(staging, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, path)


def write_manifest(directory: Path, name: str = MANIFEST_NAME) -> None:
    """Record every file under `directory` (flushed to disk first) and its size, as the last write."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != name):
        _fsync(path)
        files[path.relative_to(directory).as_posix()] = path.stat().st_size
    write_atomically(directory / name, json.dumps({"version": MANIFEST_VERSION, "files": files}, indent=1))


def incompleteness(directory: Path, name: str = MANIFEST_NAME) -> str | None:
    """Why `directory` is not a complete checkpoint, or None when it is."""
    manifest = directory / name
    if not manifest.is_file():
        return f"it has no {name} (it was being written when the run stopped, or it is not a hellbender checkpoint)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"its {name} is unreadable"
    for relative, size in files.items():
        path = directory / relative
        if not path.is_file():
            return f"{relative} is missing"
        if path.stat().st_size != size:
            return f"{relative} has {path.stat().st_size} bytes where the manifest says {size}"
    return None


def checkpoint_dirs(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `checkpoint-N` directory in `output_dir`, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_PATTERN.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    complete = [path for _, path in checkpoint_dirs(output_dir) if incompleteness(path) is None]
    return complete[-1] if complete else None


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
        return path
    if cfg.auto_resume_from_checkpoints:
        return latest_checkpoint(cfg.output_dir)
    return None


class CheckpointKeeper(TrainerCallback):
    """After each save: the manifest that makes the checkpoint trusted, then rotation to `save_total_limit`."""

    def __init__(self, save_total_limit: int | None) -> None:
        self.save_total_limit = save_total_limit

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        write_manifest(directory)
        if self.save_total_limit is not None:
            complete = [path for _, path in checkpoint_dirs(args.output_dir) if incompleteness(path) is None]
            for old in complete[: -self.save_total_limit]:
                shutil.rmtree(old)


class TrainingAlreadyDone(Exception):
    """Raised before the first step of a run resumed from a checkpoint at (or past) its last step."""


class StopIfAlreadyDone(TrainerCallback):
    """A run killed after its last checkpoint but before its final save resumes at `max_steps`, where the
    Trainer would still run one more step; this stops it before that step, with the checkpoint loaded."""

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= state.max_steps:
            raise TrainingAlreadyDone
