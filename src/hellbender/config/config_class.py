"""`cls_model_config`: the transformers config class that reads the model's config.json must be one the model class
of `model_type` is built from; otherwise loading fails deep inside transformers, or builds the wrong model."""

from __future__ import annotations

from typing import Any

from hellbender.config.defaults import default_model_type
from hellbender.config.schema import HellbenderConfig


def config_class(cfg: HellbenderConfig) -> Any:
    """The class that reads the model's config: `cls_model_config`'s, or `AutoConfig`."""
    import transformers

    return getattr(transformers, cfg.cls_model_config or "AutoConfig")


def config_class_problems(cfg: HellbenderConfig) -> list[str]:
    if cfg.cls_model_config in (None, "AutoConfig"):
        return []
    import transformers

    name = cfg.cls_model_config
    config_cls = config_class(cfg)
    model_type = cfg.model_type or default_model_type(cfg)
    model_cls = getattr(transformers, model_type, None)
    if model_cls is None:
        return []  # refused by name when the model loads
    mapping = getattr(model_cls, "_model_mapping", None)  # an Auto class picks the model from the config's class
    if mapping is not None:
        if config_cls in mapping:
            return []
        return [
            f"`cls_model_config: {name}` reads the model's config as `{name}`, and `model_type: {model_type}` has no "
            f"model built from that config class. Set `model_type` to the model class of `{name}`'s family (e.g. "
            "`Gemma3ForCausalLM` for `Gemma3TextConfig`), or remove `cls_model_config`."
        ]
    expected = getattr(model_cls, "config_class", None)
    if not isinstance(expected, type) or issubclass(config_cls, expected):
        return []
    return [
        f"`cls_model_config: {name}` reads the model's config as `{name}`, and `model_type: {model_type}` is built "
        f"from a `{expected.__name__}`. Set `cls_model_config: {expected.__name__}`, or a `model_type` built from "
        f"`{name}`."
    ]
