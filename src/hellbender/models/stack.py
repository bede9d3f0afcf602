"""The model a config describes, assembled in one place: the base model with its family's preparation, then what
training adds (fused kernels, a new adapter, tiled MLPs, activation checkpointing), or a saved adapter on top for
what is done with a trained run (inference, evaluation, merging)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError
from hellbender.models.activation_checkpointing import enable_activation_checkpointing
from hellbender.models.adapter_loading import complete_adapter_load
from hellbender.models.adapters import apply_adapter, loftq_arguments
from hellbender.models.fixes import prepare_for_training
from hellbender.models.gated_norms import apply_gated_norm_kernel
from hellbender.models.kernels import apply_liger_kernels
from hellbender.models.loading import load_model
from hellbender.models.tiled_mlp import tile_mlps

logger = logging.getLogger("hellbender")


def load_base_model(cfg: HellbenderConfig, tokenizer: Any, source: str | Path | None = None) -> Any:
    """The model of `base_model` (or the whole model saved in `source`), ready for its family's forward passes."""
    model = prepare_for_training(load_model(cfg, tokenizer, source), cfg.attn_implementation)
    if cfg.flex_attn_compile_kwargs is not None:
        from hellbender.models.flex_attention import use_compiled_flex

        use_compiled_flex(model, cfg.flex_attn_compile_kwargs)
    if cfg.attn_implementation == "flex_attention":
        from hellbender.config.precision import torch_dtype
        from hellbender.models.flex_attention import check_flex_compiles

        check_flex_compiles(model, cfg.flex_attn_compile_kwargs, torch_dtype(cfg))
    return model


def build_trainable_model(cfg: HellbenderConfig, tokenizer: Any) -> Any:
    """The base model with everything training adds, in the order each step needs."""
    from transformers import set_seed

    # Weights the checkpoint lacks are drawn while loading (a reward model's score head, the rows of added tokens):
    # seeded here, they do not depend on what the data preparation before drew from the RNG.
    set_seed(cfg.seed)
    model = load_base_model(cfg, tokenizer)
    if cfg.splits_packed_rows:  # PyTorch's ring attention would let packed documents read each other
        from hellbender.models.split_attention import use_split_attention

        use_split_attention(model)
    apply_liger_kernels(cfg, model)  # before the adapter, so LoRA wraps the projections the fused modules call
    if fused := apply_gated_norm_kernel(cfg, model):
        logger.info("liger_rms_norm_gated: %d gated RMSNorms run the fused kernel", len(fused))
    if cfg.qat is not None:  # before the adapter (LoRA wraps the fake-quantized layers), tiling and checkpointing
        from hellbender.models.qat import prepare_for_qat

        prepare_for_qat(model, cfg.qat)
    set_seed(cfg.seed)  # the adapter's initial weights must not depend on what loading drew from the RNG
    model = apply_adapter(cfg, model)
    if cfg.tiled_mlp:  # after Liger and the adapter: tiles whatever forward the MLPs have by now
        logger.info("tiled_mlp: %d MLPs run in shards", tile_mlps(model, cfg.tiled_mlp_num_shards))
    if cfg.checkpoints_activations:  # hellbender's own setup, not the Trainer's nor FSDP's: activation_checkpointing.py
        compile_options = (
            {"backend": cfg.torch_compile_backend, "mode": cfg.torch_compile_mode} if cfg.compiles_layers else None
        )
        enable_activation_checkpointing(
            model,
            offload=cfg.gradient_checkpointing == "offload",
            layers=cfg.gradient_checkpointing_layers,
            compile_options=compile_options,
            offload_layers=cfg.activation_offload_layers,
        )
    return model


def with_saved_adapter(cfg: HellbenderConfig, base: Any, adapter_dir: Path) -> Any:
    """`base` wrapped with the PEFT adapter saved in `adapter_dir`."""
    from peft import PeftModel

    loftq_arguments(cfg)  # a LoftQ adapter's config makes PEFT quantize the base again on loading: check it can
    try:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    except (ValueError, RuntimeError, KeyError) as exc:  # shapes or module names that do not fit the base
        raise ConfigError(
            f"The adapter in {adapter_dir} does not fit `base_model: {cfg.base_model}`: {exc}. Use the config the "
            "adapter was trained with."
        ) from None
    if placed := complete_adapter_load(model, adapter_dir):
        logger.warning(
            "PEFT left %d saved LoRA tensor(s) of %s out while loading; hellbender placed them itself (checked equal to "
            "the file).",
            placed,
            adapter_dir,
        )
    return model
