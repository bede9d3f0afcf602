"""FSDP2 through transformers' Trainer and accelerate: the config's `fsdp_config` becomes the Trainer's, checked
against what the installed transformers made of it, and the wrap classes are checked against the loaded model
before any step runs."""

from __future__ import annotations

from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.config.hybrid_sharding import hybrid_shape
from hellbender.errors import ConfigError, EnvironmentProblem
from hellbender.train.distributed import world_size


def fsdp_arguments(cfg: HellbenderConfig) -> dict[str, Any]:
    """TrainingArguments keywords that turn FSDP2 on (none without `fsdp_version: 2`)."""
    if not cfg.uses_fsdp2:
        return {}
    settings = cfg.fsdp_settings
    fsdp_config: dict[str, Any] = {
        "version": 2,
        "auto_wrap_policy": settings.auto_wrap_policy,
        "reshard_after_forward": settings.reshard_after_forward,
        "state_dict_type": settings.state_dict_type,
        "cpu_offload": settings.offload_params,
        "cpu_ram_efficient_loading": settings.cpu_ram_efficient_loading,
        # hellbender checkpoints layers itself (`gradient_checkpointing`), which keeps its fixes for shared K/V.
        "activation_checkpointing": False,
    }
    if settings.layer_classes:
        fsdp_config["transformer_layer_cls_to_wrap"] = settings.layer_classes
    hybrid = parallelism_config(cfg, world_size())
    return {"fsdp": True, "fsdp_config": fsdp_config, **({"parallelism_config": hybrid} if hybrid else {})}


def check_fsdp_plugin_arguments(cfg: HellbenderConfig, plugin_args: dict[str, Any] | None) -> None:
    """The installed transformers must have read `fsdp_config` the way hellbender wrote it; a renamed key would
    otherwise be dropped without a word (e.g. sharding with FSDP1, or without CPU offload)."""
    if not cfg.uses_fsdp2:
        return
    settings = cfg.fsdp_settings
    expected = {
        "fsdp_version": 2,
        "state_dict_type": settings.state_dict_type,
        "reshard_after_forward": settings.reshard_after_forward,
        "cpu_offload": settings.offload_params or None,
    }
    plugin_args = plugin_args or {}
    wrong = {key: plugin_args.get(key) for key, value in expected.items() if plugin_args.get(key) != value}
    if wrong:
        import transformers

        raise EnvironmentProblem(
            f"transformers {transformers.__version__} read hellbender's FSDP settings differently than expected "
            f"({', '.join(f'{k}={v!r}' for k, v in wrong.items())}; expected "
            f"{', '.join(f'{k}={expected[k]!r}' for k in wrong)}). Install a transformers version this hellbender "
            "supports (see pyproject.toml)."
        )


def announce_host_offload(cfg: HellbenderConfig) -> None:
    """With `offload_params`, FSDP2 keeps sharded parameters and gradients in host memory, and the gradient norm
    is reduced over them: the process group needs a CPU backend beside NCCL. accelerate opens it so
    (`cuda:nccl,cpu:gloo`) when its launcher's FSDP variables say offload is on at the moment it first sets up the
    processes, which hellbender does before the Trainer exists; so they are set here, first thing."""
    import os

    if cfg.uses_fsdp2 and cfg.fsdp_settings.offload_params:
        os.environ.setdefault("ACCELERATE_USE_FSDP", "true")
        os.environ.setdefault("FSDP_OFFLOAD_PARAMS", "true")


def check_fsdp_processes() -> None:
    """FSDP2 shards over the run's GPUs; accelerate would quietly train unsharded in a single process, or on CPU."""
    import torch

    if world_size() == 1:
        raise ConfigError(
            "`fsdp_version: 2` shards the model over several training processes, but this run has one. Start it "
            "with `hellbender train CONFIG --nproc N` (N GPUs; or `torchrun` / `accelerate launch -m hellbender "
            "train CONFIG`), or remove `fsdp_version` and `fsdp_config` to train on one device."
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            "`fsdp_version: 2` needs CUDA GPUs: accelerate applies FSDP2 only on accelerators, and on CPU the "
            "processes would train unsharded. Remove `fsdp_version` and `fsdp_config` to train with several CPU "
            "processes (DDP over gloo)."
        )


def check_wrap_classes(cfg: HellbenderConfig, model: Any) -> None:
    """Every class named in `fsdp_config.transformer_layer_cls_to_wrap` must occur in the model (accelerate would
    otherwise fail only once training starts, after data preparation)."""
    if not cfg.uses_fsdp2:
        return
    wanted = cfg.fsdp_settings.layer_classes or list(getattr(model, "_no_split_modules", None) or [])
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in wanted if name not in present]
    if not wanted:
        raise ConfigError(
            f"`fsdp_config.transformer_layer_cls_to_wrap` is not set and {type(model).__name__} does not name its "
            "layer classes itself: set it to the model's decoder-layer class."
        )
    if missing:
        layers = sorted(name for name in present if name.endswith(("DecoderLayer", "Layer", "Block")))
        raise ConfigError(
            f"`fsdp_config.transformer_layer_cls_to_wrap` names {', '.join(f'`{n}`' for n in missing)}, which "
            f"{type(model).__name__} does not contain. Layer classes in this model: "
            f"{', '.join(f'`{n}`' for n in layers) or '(none found)'}. Use its decoder-layer class."
        )


def matches_norm_class(module: Any, patterns: list[str]) -> bool:
    """A pattern without a dot matches the end of the class name (`RMSNorm` matches `LlamaRMSNorm`); a dotted one
    matches the full class path (`transformers.models.llama.modeling_llama.LlamaRMSNorm`) exactly."""
    cls = type(module)
    for pattern in (p.strip() for p in patterns):
        if not pattern:
            continue
        if "." in pattern:
            if f"{cls.__module__}.{cls.__qualname__}" == pattern:
                return True
        elif cls.__name__.endswith(pattern):
            return True
    return False


def norm_modules(model: Any, patterns: list[str]) -> list[Any]:
    """The outermost modules matching `patterns` that hold parameters of their own (a norm without a scale has
    nothing to keep in float32)."""
    found: list[Any] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if matches_norm_class(module, patterns) and any(True for _ in module.parameters(recurse=False)):
            found.append(module)
            inside.update(id(sub) for sub in module.modules())
    return found


def shard_norms_in_fp32(model: Any, patterns: list[str], compute_dtype: Any, mesh: Any = None) -> int:
    """Shard each norm module with its own FSDP2 group whose mixed-precision policy keeps its parameters (and its
    computation) in float32; its output is cast back to `compute_dtype` for the next layer. Done before accelerate
    shards the decoder layers, which then leave these modules' parameters to their own group (FSDP1 required one
    dtype per wrapped group, which is why this needs FSDP2). Returns the number of modules sharded."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=compute_dtype)
    modules = norm_modules(model, patterns)
    for module in modules:
        module.to(torch.float32)
        fully_shard(module, mesh=mesh, mp_policy=policy)
    return len(modules)


def quantized_weights(model: Any) -> dict[str, Any]:
    """Name -> parameter of every bitsandbytes 4-bit weight (none without bitsandbytes)."""
    try:
        from bitsandbytes.nn import Params4bit
    except ImportError:
        return {}
    return {name: p for name, p in model.named_parameters() if isinstance(p, Params4bit)}


def prepare_quantized_for_fsdp(cfg: HellbenderConfig, model: Any) -> int:
    """Ready a QLoRA model for accelerate's FSDP2 sharding; returns the number of 4-bit weights it will shard.

    FSDP2 shards the packed 4-bit weights as plain float tensors: each process keeps a slice of the bytes, and each
    `Linear4bit` keeps the whole weight's quantization state (a few scales per 64 values), which bitsandbytes gives
    back to the gathered weight in its forward. That holds only while the gathered bytes come back unchanged, so
    the storage dtype must be the one FSDP2 gathers in (see `quant_storage_dtype`); a pre-quantized checkpoint may
    bring its own. The trained weights are made float32 here because accelerate (1.15) leaves them as they are in
    a model with 4-bit weights, and FSDP2 needs one dtype among the trained weights of a group (LoRA's are float32,
    `lora_modules_to_save` copies would be bf16); it upcasts them so for every other model."""
    import torch

    from hellbender.models.loading import quant_storage_dtype

    if not (cfg.uses_fsdp2 and cfg.load_in_4bit):
        return 0
    weights = quantized_weights(model)
    wanted = quant_storage_dtype(cfg)
    wrong = sorted({str(p.dtype).removeprefix("torch.") for p in weights.values() if p.dtype != wanted})
    if wrong:
        raise ConfigError(
            f"The 4-bit weights of `base_model: {cfg.base_model}` are stored as {', '.join(wrong)}, but FSDP2 gathers "
            f"this run's weights as {str(wanted).removeprefix('torch.')} and would corrupt packed bytes of another "
            "dtype (a pre-quantized checkpoint brings its own `bnb_4bit_quant_storage`). Use the unquantized model "
            "as `base_model` (hellbender quantizes it while loading, storing the 4-bit weights in the run's dtype), "
            "or train it without `fsdp_version`."
        )
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    return len(weights)


def parallelism_config(cfg: HellbenderConfig, processes: int) -> Any | None:
    """accelerate's `ParallelismConfig` for hybrid sharding and context parallelism: it builds the device mesh
    (`dp_replicate` x `dp_shard` x `cp`) that accelerate passes to `fully_shard` and to PyTorch's context parallelism,
    and spreads the data over the data-parallel processes (the `cp` processes of a group share their rows)."""
    context = context_parallel_groups(cfg, processes)
    shape = hybrid_shape(cfg, processes // context)
    if shape is None and context == 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig

    replicate, shard = shape or (1, processes // context)
    return ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard, cp_size=context)


def context_parallel_groups(cfg: HellbenderConfig, processes: int) -> int:
    """`context_parallel_size` (1 without it), checked to divide the processes into whole groups."""
    context = cfg.context_parallel_size or 1
    if processes % context or processes < context:
        raise ConfigError(
            f"`context_parallel_size: {context}` splits each row over groups of {context} processes, but this run has "
            f"{processes} training process(es). Start a multiple of {context} processes (`--nproc`), or change "
            "`context_parallel_size`."
        )
    return context
