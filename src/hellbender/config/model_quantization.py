"""`model_quantization_config` / `model_quantization_config_kwargs`: a transformers quantization config for loading
a checkpoint that is stored quantized (gpt-oss ships its experts in MXFP4). hellbender trains such checkpoints only
dequantized to the run's precision while loading: transformers' MXFP4 quantizer does not train (its `is_trainable` is
false) and hellbender has no training path through MXFP4 or FP8 weights. Quantizing a base to train an adapter on
it is QLoRA's job (`adapter: qlora`, `load_in_8bit`)."""

from __future__ import annotations

import inspect
from typing import Any

from hellbender.config.model import DEQUANTIZED_CONFIGS
from hellbender.config.schema import HellbenderConfig


def quantization_config_class(name: str) -> Any:
    import transformers

    return getattr(transformers, name)


def _settings(name: str) -> list[str]:
    """The keyword arguments the installed transformers' class takes."""
    parameters = inspect.signature(quantization_config_class(name).__init__).parameters.values()
    return [p.name for p in parameters if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]


def model_quantization_problems(cfg: HellbenderConfig) -> list[str]:
    name, kwargs = cfg.model_quantization_config, cfg.model_quantization_config_kwargs or {}
    if name is None:
        if kwargs:
            return ["`model_quantization_config_kwargs` is set without `model_quantization_config`; name the class."]
        return []
    problems = []
    settings = _settings(name)
    unknown = sorted(set(kwargs) - set(settings))
    if unknown:
        problems.append(
            f"`model_quantization_config_kwargs` has {', '.join(f'`{k}`' for k in unknown)}, which transformers' "
            f"`{name}` does not take (it takes {', '.join(f'`{k}`' for k in settings)})."
        )
    if kwargs.get("dequantize") is not True:
        stored = DEQUANTIZED_CONFIGS[name][1]
        problems.append(
            f"`model_quantization_config: {name}` without `model_quantization_config_kwargs: {{dequantize: true}}` "
            f"would keep the checkpoint's {stored} as they are, and neither transformers nor hellbender can train "
            "them. Add `model_quantization_config_kwargs: {dequantize: true}` to load them in the run's precision "
            "(bf16) and train as usual."
        )
    if cfg.quantized_bits:
        problems.append(
            f"`model_quantization_config: {name}` and bitsandbytes quantization (`load_in_4bit` / `load_in_8bit` / "
            "`adapter: qlora`) both say how to load the base; a checkpoint takes one quantization config. Keep one."
        )
    if cfg.uses_fsdp2 and cfg.fsdp_settings.cpu_ram_efficient_loading:
        problems.append(
            f"`fsdp_config.cpu_ram_efficient_loading` is refused with `model_quantization_config: {name}`, as "
            "Axolotl refuses it: it loads the weights on the first process only, which is not known to work with a "
            "checkpoint dequantized while it loads. Turn it off, or start from an already dequantized checkpoint "
            "(e.g. `axolotl-ai-co/gpt-oss-120b-dequantized`) without `model_quantization_config`."
        )
    return problems
