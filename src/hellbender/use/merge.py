"""`hellbender merge-lora`: the LoRA adapter merged into the base model, saved as a standalone model.

The merged directory is what plain transformers (and serving engines such as vLLM) load: safetensors shards with
the base model's own parameter names, config.json, generation_config.json, and the tokenizer or processor with
the chat template training used. A QLoRA base is loaded unquantized in bfloat16 for the merge (4-bit weights
cannot absorb the adapter). Like the final model of a run, it is written to a staging directory and renamed into
place, with `hellbender_model.json` (the file list) written last.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError
from hellbender.storage import FINAL_MANIFEST, write_directory_atomically, write_file_atomically, write_manifest
from hellbender.use.chat import stop_token_ids
from hellbender.use.trained import NotATrainedModel, find_trained

logger = logging.getLogger("hellbender")
MERGE_INFO = "hellbender_merge.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"


def merge_lora(
    cfg: HellbenderConfig,
    adapter: str | Path | None = None,
    output: str | Path | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Merge the adapter (default: the final one in `output_dir`) into `base_model` and save the result in
    `output` (default `<output_dir>/merged`); returns that directory."""
    import torch

    from hellbender.models.loading import load_model, load_tokenizer_and_processor
    from hellbender.models.stack import with_saved_adapter

    if cfg.adapter is None:
        raise ConfigError(
            "`merge-lora` merges a LoRA adapter into its base model, but this config has no `adapter`: it trains the "
            f"whole model, and `output_dir` ({cfg.output_dir}) already holds a standalone model that transformers "
            "loads as it is."
        )
    trained = find_trained(cfg, adapter, "--adapter")
    if not trained.is_adapter:
        raise NotATrainedModel(
            f"{trained.path} holds a whole model (config.json, no adapter_config.json), not a LoRA adapter: there is "
            "nothing to merge. Point `--adapter` at a run's `output_dir` or one of its `checkpoint-N` directories."
        )
    target = Path(output).expanduser() if output is not None else Path(cfg.output_dir) / "merged"
    _check_target(target, trained.path)

    load_cfg = cfg
    bits = cfg.quantized_bits
    if bits is not None:
        logger.warning(
            "The base model was trained in %s. Quantized weights cannot absorb the adapter, so `%s` is loaded "
            "unquantized in bfloat16 and the adapter is merged into it: the merged model is a bfloat16 model (2 bytes "
            "per parameter), and its outputs differ slightly from the %d-bit base + adapter of training, whose "
            "base weights were rounded to %d bits.",
            "4-bit (QLoRA)" if bits == 4 else "8-bit",
            cfg.base_model,
            bits,
            bits,
        )
        load_cfg = cfg.model_copy(update={"load_in_4bit": False, "load_in_8bit": False, "bf16": True, "fp16": False})
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    model = with_saved_adapter(cfg, load_model(load_cfg, tokenizer), trained.path)
    with torch.no_grad():
        merged = model.merge_and_unload(safe_merge=True)  # safe_merge: refuse weights that become NaN
    if getattr(merged, "generation_config", None) is not None:  # a reward model (sequence classification) has none
        merged.generation_config.eos_token_id = stop_token_ids(
            tokenizer, processor or tokenizer, processor is not None, merged.generation_config
        )
        merged.generation_config.pad_token_id = tokenizer.pad_token_id
    dtype = next(merged.parameters()).dtype
    info = {
        "base_model": cfg.base_model,
        "adapter": str(trained.path),
        "adapter_step": trained.step,
        "dtype": str(dtype).removeprefix("torch."),
        "dequantized_from_4bit": cfg.load_in_4bit,
        "dequantized_from_8bit": cfg.load_in_8bit,
    }
    _save(merged, processor or tokenizer, target, max_shard_size, info)
    logger.info("Merged %s into %s (%s); saved to %s", trained.describe(), cfg.base_model, info["dtype"], target)
    return target


def _check_target(target: Path, adapter_dir: Path) -> None:
    """The output may be new, or a directory an earlier merge wrote (replaced whole); nothing else is overwritten."""
    if target.resolve() == adapter_dir.resolve() or adapter_dir.resolve().is_relative_to(target.resolve()):
        raise ConfigError(
            f"`--output {target}` would replace the adapter it merges ({adapter_dir}); choose another directory "
            "(the default is `<output_dir>/merged`)."
        )
    if target.exists() and not (target / MERGE_INFO).is_file():
        state = "a file" if not target.is_dir() else "a directory that an earlier merge did not write"
        raise ConfigError(
            f"`--output {target}` is {state}; it is left alone. Choose a new directory, or remove it first."
        )


def _save(model: Any, tokenizer_or_processor: Any, target: Path, max_shard_size: str, info: dict[str, Any]) -> None:
    def write(staging: Path) -> None:
        model.save_pretrained(str(staging), max_shard_size=max_shard_size)
        tokenizer_or_processor.save_pretrained(str(staging))
        write_file_atomically(staging / MERGE_INFO, json.dumps(info, indent=1))
        write_manifest(staging, FINAL_MANIFEST)

    write_directory_atomically(target, write)  # an earlier merge there is replaced whole
