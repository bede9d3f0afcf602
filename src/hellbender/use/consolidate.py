"""`hellbender consolidate`: an FSDP2 sharded checkpoint joined into one model that transformers (or PEFT, for an
adapter) loads without hellbender.

Under `fsdp_config.state_dict_type: SHARDED_STATE_DICT` each process writes its own part of the weights into
`checkpoint-N/pytorch_model_fsdp_0/` (PyTorch distributed checkpoint format). This command reads all parts in one
process, loads them into the model the run's config describes (the base model, with the adapter for LoRA), and
saves it as a run's final model is saved: safetensors and config (or the adapter), tokenizer, written to a staging
directory, moved into place, with `hellbender_model.json` written last.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError
from hellbender.storage import (
    CHECKPOINT_MANIFEST,
    FINAL_MANIFEST,
    incompleteness,
    latest_checkpoint,
    write_directory_atomically,
    write_manifest,
)
from hellbender.use.trained import NotATrainedModel

logger = logging.getLogger("hellbender")
SHARDED_MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate's name for the first (only) model's shards


def consolidate(cfg: HellbenderConfig, checkpoint: str | Path | None = None, output: str | Path | None = None) -> Path:
    """Join the shards of `checkpoint` (default: the newest complete checkpoint in `output_dir`) into one model
    saved in `output` (default `<output_dir>/consolidated`); returns that directory."""
    source = _sharded_checkpoint(cfg, checkpoint)
    target = Path(output).expanduser() if output is not None else Path(cfg.output_dir) / "consolidated"
    if target.resolve() == source.resolve() or source.resolve() in target.resolve().parents:
        raise ConfigError(f"`--output {target}` is inside the checkpoint {source}; choose a directory outside it.")
    state_dict = read_sharded_state_dict(source / SHARDED_MODEL_DIR)
    model, tokenizer_or_processor = _model_for(cfg)
    _load_weights(model, state_dict, source)
    _save(model, tokenizer_or_processor, target)
    logger.info("Consolidated %s into %s", source, target)
    return target


def read_sharded_state_dict(directory: Path) -> dict[str, Any]:
    """All parts of a distributed checkpoint as one plain state dict, read in this process only."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="hellbender-consolidate-") as scratch:
        joined = Path(scratch) / "joined.pt"
        dcp_to_torch_save(str(directory), str(joined))
        saved = torch.load(joined, map_location="cpu", weights_only=True)
    return saved["model"] if set(saved) == {"model"} else saved


def _sharded_checkpoint(cfg: HellbenderConfig, checkpoint: str | Path | None) -> Path:
    if checkpoint is None:
        newest = latest_checkpoint(cfg.output_dir)
        if newest is None:
            raise NotATrainedModel(
                f"`output_dir: {cfg.output_dir}` holds no complete checkpoint to consolidate. Pass `--checkpoint DIR` "
                "(a `checkpoint-N` directory written with `fsdp_config.state_dict_type: SHARDED_STATE_DICT`)."
            )
        directory = newest
    else:
        directory = Path(checkpoint).expanduser()
    if not directory.is_dir():
        raise NotATrainedModel(f"`--checkpoint {directory}` is not a directory.")
    reason = incompleteness(directory)
    if reason is not None:
        raise NotATrainedModel(
            f"`{directory}` is not a complete checkpoint ({reason}); its shards may be partial. Consolidate a complete "
            f"one: checkpoints are complete once their {CHECKPOINT_MANIFEST} is written."
        )
    if not (directory / SHARDED_MODEL_DIR).is_dir():
        raise NotATrainedModel(
            f"`{directory}` holds no sharded weights ({SHARDED_MODEL_DIR}/): it was not written by FSDP2 with "
            "`state_dict_type: SHARDED_STATE_DICT`, so there is nothing to consolidate. A checkpoint with "
            "model.safetensors or adapter_model.safetensors is loaded as it is."
        )
    return directory


def _model_for(cfg: HellbenderConfig) -> tuple[Any, Any]:
    """The model the run trained, built as training built it (base weights, then the adapter), on CPU."""
    from hellbender.models.adapters import apply_adapter
    from hellbender.models.loading import load_model, load_tokenizer_and_processor

    tokenizer, processor = load_tokenizer_and_processor(cfg)
    # A QLoRA run's checkpoint holds the adapter only, which does not depend on how the base is stored: the base is
    # read unquantized, so that consolidating needs neither a GPU nor bitsandbytes.
    base_cfg = cfg.model_copy(update={"load_in_4bit": False}) if cfg.load_in_4bit else cfg
    model = apply_adapter(cfg, load_model(base_cfg, tokenizer))
    return model, processor or tokenizer


def _load_weights(model: Any, state_dict: dict[str, Any], source: Path) -> None:
    """Every saved tensor must land in the model (names and shapes), and every trained parameter must come from
    the checkpoint: anything else means the config is not the one the checkpoint was trained with."""
    expected = model.state_dict()
    state_dict = _with_adapter_names(model, state_dict, expected)
    unexpected = sorted(set(state_dict) - set(expected))
    wrong_shape = sorted(
        name for name, tensor in state_dict.items() if name in expected and tensor.shape != expected[name].shape
    )
    untrained = sorted(name for name, p in model.named_parameters() if p.requires_grad and name not in state_dict)
    if unexpected or wrong_shape or untrained:
        detail = "; ".join(
            f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for label, names in (
                ("not in the model", unexpected),
                ("shape differs", wrong_shape),
                ("trained but missing", untrained),
            )
            if names
        )
        raise ConfigError(
            f"The weights in {source} do not fit the model this config builds ({detail}). Consolidate with the "
            f"config the run was trained with (its output_dir holds it as hellbender_config.yml)."
        )
    model.load_state_dict(state_dict, strict=False)


def _with_adapter_names(model: Any, state_dict: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """PEFT names an adapter's weights with the adapter's name (`lora_A.default.weight`); accelerate's FSDP2
    checkpoints of a PEFT model leave it out (`lora_A.weight`, seen with accelerate 1.15 on two H100s). Both
    spellings are read."""
    names = list(getattr(model, "peft_config", {}) or {})
    aliases = {key.replace(f".{name}.", "."): key for key in expected for name in names if f".{name}." in key}
    return {
        (aliases[key] if key not in expected and key in aliases else key): tensor for key, tensor in state_dict.items()
    }


def _save(model: Any, tokenizer_or_processor: Any, target: Path) -> None:
    def write(staging: Path) -> None:
        model.save_pretrained(str(staging))
        tokenizer_or_processor.save_pretrained(str(staging))
        write_manifest(staging, FINAL_MANIFEST)

    write_directory_atomically(target, write)
