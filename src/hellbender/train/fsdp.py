"""FSDP2 through transformers' Trainer and accelerate: the config's `fsdp_config` becomes the Trainer's, checked
against what the installed transformers made of it, and the wrap classes are checked against the loaded model
before any step runs."""

from __future__ import annotations

from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError, EnvironmentProblem


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
    return {"fsdp": True, "fsdp_config": fsdp_config}


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
