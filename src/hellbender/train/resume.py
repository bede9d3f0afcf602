"""Which checkpoint a run resumes from."""

from __future__ import annotations

import re
from pathlib import Path

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")


def is_complete_checkpoint(path: Path) -> bool:
    """transformers writes trainer_state.json last; with it and the weights present, the checkpoint is whole."""
    return (path / "trainer_state.json").is_file() and any((path / f).is_file() for f in WEIGHT_FILES)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := CHECKPOINT_PATTERN.match(p.name)) and p.is_dir() and is_complete_checkpoint(p)
    ]
    return max(found)[1] if found else None


def checkpoint_to_resume(cfg: HellbenderConfig) -> Path | None:
    if cfg.resume_from_checkpoint:
        path = Path(cfg.resume_from_checkpoint)
        if not is_complete_checkpoint(path):
            raise ConfigError(
                f"`resume_from_checkpoint: {path}` is not a complete checkpoint (it needs trainer_state.json and the "
                "weights). Point it at a `checkpoint-N` directory, or use `auto_resume_from_checkpoints: true`."
            )
        return path
    if cfg.auto_resume_from_checkpoints:
        return latest_checkpoint(cfg.output_dir)
    return None
