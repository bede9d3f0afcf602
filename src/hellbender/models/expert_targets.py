"""LoRA on the experts of mixture-of-experts models.

transformers 5 stores each MoE layer's experts as 3-D parameters on one `*Experts` module
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`: experts x in x out, or transposed), not as `nn.Linear` layers, so
neither a `lora_target_modules` name nor "every linear layer" reaches them: a run would silently adapt attention only.
PEFT adapts such parameters through `target_parameters` (its `ParamWrapper`). This module finds the expert weights,
decides which of them the config asks for, and checks afterwards that PEFT adapted exactly what was decided.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError, EnvironmentProblem

logger = logging.getLogger("hellbender")

# A projection's name (transformers 4 and dense MLPs; Mixtral's w1/w2/w3) -> the fused expert weight holding it.
EXPERT_WEIGHT_OF = {
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "w1": "gate_up_proj",
    "w3": "gate_up_proj",
    "down_proj": "down_proj",
    "w2": "down_proj",
}
# Names that share one fused weight: adapting it adapts both halves, so a config naming one half only is refused.
FUSED_HALVES = (("gate_proj", "up_proj"), ("w1", "w3"))


def expert_weights(model: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Full name -> shape of every expert weight under `prefix`: a 3-D parameter (one matrix per expert) of an
    experts module (transformers names their classes `*Experts`). Other 3-D parameters are not experts: the
    convolutions of hybrid linear-attention layers (Qwen3-Next's `Conv1d`) have them too."""
    return {
        f"{module_name}.{name}" if module_name else name: tuple(param.shape)
        for module_name, module in model.named_modules()
        if type(module).__name__.endswith("Experts")
        for name, param in module.named_parameters(recurse=False)
        if param.dim() == 3 and f"{module_name}.{name}".startswith(prefix)
    }


def short_names(names: list[str] | dict[str, Any]) -> list[str]:
    """`model.layers.3.mlp.experts.gate_up_proj` -> `mlp.experts.gate_up_proj`: the part after the layer index, which
    is what `lora_target_parameters` usually names."""
    return sorted({(re.split(r"\.\d+\.", name)[-1]) for name in names})


def matches(name: str, target: str) -> bool:
    """PEFT's rule for `target_parameters`: the full name, or a suffix of it after a dot."""
    return name == target or name.endswith(f".{target}")


def wanted_expert_weights(cfg: HellbenderConfig, model: Any, prefix: str, linear_names: set[str] | None) -> list[str]:
    """Full names of the expert weights to adapt. `lora_target_parameters` names them exactly; otherwise they follow
    the projections the config adapts (`linear_names`, leaf names; None means every linear layer)."""
    experts = expert_weights(model, prefix)
    if cfg.lora_target_parameters:
        params = [name for name, _ in model.named_parameters() if name.startswith(prefix)]
        unmatched = [t for t in cfg.lora_target_parameters if not any(matches(n, t) for n in params)]
        if unmatched:
            listed = ", ".join(f"`{t}`" for t in unmatched)
            raise ConfigError(
                f"`lora_target_parameters`: {listed} match no parameter of the model (a target is a full parameter "
                "name or its suffix after a dot). "
                + (
                    f"Its expert weights are {', '.join(f'`{n}`' for n in short_names(experts))}: name those."
                    if experts
                    else "This model has no fused expert weights (no 3-D parameters): its MLP projections are linear "
                    "layers, which `lora_target_modules` or `lora_target_linear: true` adapt. Remove "
                    "`lora_target_parameters`."
                )
            )
        return sorted(n for n in params if any(matches(n, t) for t in cfg.lora_target_parameters))
    if not experts:
        return []
    if linear_names is None:
        return sorted(experts)
    for half, other in FUSED_HALVES:
        fused = EXPERT_WEIGHT_OF[half]
        if (half in linear_names) != (other in linear_names) and any(n.endswith(f".{fused}") for n in experts):
            named, missing = (half, other) if half in linear_names else (other, half)
            raise ConfigError(
                f"`lora_target_modules` names `{named}` but not `{missing}`: this model's experts hold both in one "
                f"fused weight ({', '.join(f'`{n}`' for n in short_names(experts) if n.endswith(fused))}), which is "
                f"adapted whole. Add `{missing}` to `lora_target_modules`, or name the expert weights to adapt in "
                "`lora_target_parameters`."
            )
    leaves = {EXPERT_WEIGHT_OF.get(n, n) for n in linear_names}
    return sorted(n for n in experts if n.rsplit(".", 1)[-1] in leaves)


def names_reaching_experts(model: Any, prefix: str, linear_names: set[str]) -> set[str]:
    """The names among `linear_names` that are projections held in the model's fused expert weights."""
    leaves = {n.rsplit(".", 1)[-1] for n in expert_weights(model, prefix)}
    return {n for n in linear_names if EXPERT_WEIGHT_OF.get(n, n) in leaves}


def layers_peft_moves(model: Any, modules: list[str]) -> set[str]:
    """The linear layers among `modules` that PEFT would not adapt as layers. For MoE families whose transformers 4
    checkpoints it converts (Mixtral, Qwen2/3-MoE, DeepSeek-V3, ...), PEFT 0.21 rewrites every target named like a
    v4 expert projection (`gate_proj`, `down_proj`, `w1`, `gate`, ...) into the fused expert weight; a dense MLP or
    shared expert of that name would lose its adapter. Asked of PEFT's own conversion, on a copy of the config."""
    if not modules:
        return set()
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers,
            get_model_conversion_mapping,
        )
    except ImportError:  # an older or newer PEFT: `check_adapted` still catches any layer left out
        return set()
    probe = LoraConfig(target_modules=set(modules))
    convert_peft_config_for_transformers(probe, model=model, conversions=get_model_conversion_mapping(model))
    return set(modules) - set(probe.target_modules or ())


def check_parameter_wrapper_options(cfg: HellbenderConfig, parameters: list[str], why: str) -> None:
    """PEFT's ParamWrapper refuses dropout and DoRA (it adds the update to the weight itself); say so by key."""
    if parameters and (cfg.lora_dropout or cfg.peft_use_dora):
        asked = f"`lora_dropout: {cfg.lora_dropout:g}`" if cfg.lora_dropout else "`peft_use_dora: true`"
        raise ConfigError(
            f"{why} PEFT adapts them as parameters (`target_parameters`: {', '.join(f'`{n}`' for n in short_names(parameters))}), "
            f"and it cannot combine that with {asked}. Set `lora_dropout: 0` and leave `peft_use_dora` off, or leave "
            "these weights out of `lora_target_modules` / `lora_target_parameters`."
        )


def adapted_names(peft_model: Any) -> tuple[set[str], set[str]]:
    """(linear layers with LoRA, parameters with LoRA) of a PEFT model, by their names in the base model."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    layers, params = set(), set()
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if isinstance(module, ParamWrapper):
            params.add(f"{base_name}.{module.parameter_name}")
        else:
            layers.add(base_name)
    return layers, params


def check_adapted(peft_model: Any, modules: list[str] | None, parameters: list[str], experts: dict[str, Any]) -> None:
    """Fail when PEFT adapted other layers or parameters than were decided (`modules` None: a regex or `all-linear`
    PEFT resolved itself), and log how many expert weights carry adapters."""
    from importlib.metadata import version

    layers, params = adapted_names(peft_model)
    left_out = sorted((set(modules) - layers) if modules is not None else set()) + sorted(set(parameters) - params)
    if left_out:
        raise EnvironmentProblem(
            f"PEFT {version('peft')} left {len(left_out)} of the targets without an adapter (e.g. `{left_out[0]}`); "
            "hellbender refuses to train an adapter that silently skips layers. Report it with the model's name, or "
            "try another PEFT version."
        )
    adapted = sorted(params & set(experts))
    if not experts:
        return
    count = {name: shape[0] for name, shape in experts.items()}
    if adapted:
        logger.info(
            "LoRA on %d of the model's %d expert weights (%s; %d experts each) and %d linear layers.",
            len(adapted),
            len(experts),
            ", ".join(short_names(adapted)),
            max(count.values()),
            len(layers),
        )
    else:
        logger.warning(
            "LoRA adapts %d linear layers and none of the model's %d expert weights (%s): the experts stay as they "
            "are. To adapt them, add them to `lora_target_parameters` (or their projections, e.g. `down_proj`, to "
            "`lora_target_modules`).",
            len(layers),
            len(experts),
            ", ".join(short_names(experts)),
        )
