"""Finding and loading what a training run saved: the final model or adapter in `output_dir`, a `checkpoint-N`
directory, or a merged model. Only directories whose hellbender manifest is present and matches are trusted, as
for resuming (`train/resume.py`): a half-written or changed save is refused, never half-loaded. What the directory
holds (an adapter or a whole model) is read from the files its manifest lists, so files left beside the current
output by an earlier save of the other kind are never taken for it."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import UserError
from hellbender.storage import (
    CHECKPOINT_MANIFEST,
    FINAL_MANIFEST,
    checkpoint_dirs,
    content_mismatch,
    incompleteness,
    latest_checkpoint,
    listed_files,
)

logger = logging.getLogger("hellbender")
ADAPTER_CONFIG = "adapter_config.json"


class NotATrainedModel(UserError):
    """A directory given as a trained model is missing, incomplete, or not a model hellbender saved."""


@dataclass(frozen=True)
class TrainedDir:
    path: Path
    is_adapter: bool  # a PEFT adapter over `base_model`; otherwise a whole model
    step: int | None  # the optimizer step it was saved at, when trainer_state.json says

    def describe(self) -> str:
        what = "adapter" if self.is_adapter else "model"
        return f"{what} {self.path}" + (f" (step {self.step})" if self.step is not None else "")


def find_trained(cfg: HellbenderConfig, path: str | Path | None, option: str) -> TrainedDir:
    """The trained model in `path` (a checkpoint, a final model or a merged model), or in `output_dir` when no
    path is given; `option` names the command-line option that takes the path, for the error message."""
    if path is None:
        directory = Path(cfg.output_dir)
        reason = _missing(directory) or incompleteness(directory, FINAL_MANIFEST)
        if reason is not None:
            newest = latest_checkpoint(directory)
            hint = f", or pass `{option} {newest}` (its newest complete checkpoint)" if newest else ""
            raise NotATrainedModel(
                f"`output_dir: {directory}` holds no complete trained model: {reason}. Train first "
                f"(`hellbender train CONFIG`){hint}; `{option} DIR` takes a `checkpoint-N` directory or a merged model."
            )
    else:
        directory = Path(path).expanduser()
        reason = _missing(directory) or _manifest_problem(directory)
        if reason is not None:
            inside = [p.name for _, p in checkpoint_dirs(directory)]
            if inside:
                reason += f" (it holds {', '.join(inside)}: point at one of those)"
            raise NotATrainedModel(
                f"`{option} {directory}` is not a complete checkpoint or model that hellbender saved: {reason}. Give a "
                f"complete `checkpoint-N` directory, the `output_dir` of a finished run, or a directory `merge-lora` wrote."
            )
    manifest = _manifest_name(directory)
    changed = content_mismatch(directory, manifest)
    if changed is not None:
        raise NotATrainedModel(
            f"`{directory}` was changed after hellbender saved it: {changed}. Another run may have written into the "
            "same directory, or a file was edited or damaged; train again, or use a checkpoint you trust."
        )
    listed = listed_files(directory, manifest)
    if ADAPTER_CONFIG in listed:
        is_adapter = True
    elif "config.json" in listed:
        is_adapter = False
    elif any(name.startswith("pytorch_model_fsdp_0/") for name in listed):
        raise NotATrainedModel(
            f"`{directory}` holds FSDP2 shards (pytorch_model_fsdp_0/), one part per process. Join them first: "
            f"`hellbender consolidate CONFIG --checkpoint {directory}`, then use the directory it writes."
        )
    else:
        raise NotATrainedModel(
            f"`{directory}` holds neither {ADAPTER_CONFIG} (an adapter) nor config.json (a model), so there is no "
            "model to load from it."
        )
    return TrainedDir(directory, is_adapter, _saved_step(directory))


def _missing(directory: Path) -> str | None:
    if not directory.exists():
        return "it does not exist"
    if not directory.is_dir():
        return "it is not a directory"
    return None


def _manifest_name(directory: Path) -> str:
    return CHECKPOINT_MANIFEST if (directory / CHECKPOINT_MANIFEST).is_file() else FINAL_MANIFEST


def _manifest_problem(directory: Path) -> str | None:
    if (directory / CHECKPOINT_MANIFEST).is_file():
        return incompleteness(directory)
    if (directory / FINAL_MANIFEST).is_file():
        return incompleteness(directory, FINAL_MANIFEST)
    return (
        f"it has neither {CHECKPOINT_MANIFEST} (a checkpoint) nor {FINAL_MANIFEST} (a final or merged model), so it is "
        "not a directory hellbender finished writing"
    )


def _saved_step(directory: Path) -> int | None:
    state = directory / "trainer_state.json"
    if not state.is_file():
        return None
    try:
        return int(json.loads(state.read_text())["global_step"])
    except (ValueError, KeyError, TypeError):
        return None


def device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_trained(cfg: HellbenderConfig, trained: TrainedDir, tokenizer: Any) -> Any:
    """The trained model in evaluation mode, on the GPU when there is one: the base model of the config (loaded
    as for training, quantized for QLoRA) with the adapter, or the whole model saved in the directory."""
    from hellbender.models.stack import load_base_model, with_saved_adapter

    if trained.is_adapter:
        model = with_saved_adapter(cfg, load_base_model(cfg, tokenizer), trained.path)
    else:
        model = load_base_model(cfg, tokenizer, source=trained.path)
    if not getattr(model, "is_loaded_in_4bit", False) and getattr(model, "hf_quantizer", None) is None:
        model = model.to(device())  # bitsandbytes places quantized weights itself
    logger.info("Loaded the %s", trained.describe())
    return model.eval()
