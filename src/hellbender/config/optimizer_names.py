"""`optimizer` and `lr_scheduler` names, checked against the installed transformers at validation: transformers
refuses a name it does not know only when the training arguments are built, after the data is prepared."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from functools import cache
from pathlib import Path

from hellbender.config.values import did_you_mean

AUTO = "auto"
# Axolotl's own optimizers (its CustomSupportedOptimizers), which it builds itself instead of through transformers.
AXOLOTL_OPTIMIZERS = (
    "optimi_adamw", "ao_adamw_4bit", "ao_adamw_8bit", "ao_adamw_fp8", "adopt_adamw", "came_pytorch", "muon", "dion",
    "sinkgd", "flash_adamw", "flash_adam", "flash_sgd", "flash_sgdw", "flash_lion", "q_galore_adamw8bit",
)  # fmt: skip
# transformers optimizers hellbender cannot drive, and why.
_NEEDS_TARGET_MODULES = (
    "it needs `optim_target_modules` (the layers it projects), which hellbender does not pass; use `adamw_torch_fused` "
    "or `adamw_bnb_8bit`"
)
REFUSED_OPTIMIZERS = {
    "adamw_torch_xla": "it is for TPUs (torch_xla), which hellbender does not train on",
    "adamw_torch_npu_fused": "it is for Ascend NPUs (torch_npu), which hellbender does not train on",
    **{
        name: _NEEDS_TARGET_MODULES
        for name in (
            "galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise",
            "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise", "apollo_adamw", "apollo_adamw_layerwise",
        )
    },
}  # fmt: skip


def _enum_values(module: str, name: str) -> tuple[str, ...]:
    """The string values of enum class `name` of the installed transformers' `module`. Read from its source file:
    importing the module would load transformers' whole training stack (seconds, and bitsandbytes' start-up
    messages) into every `validate`. Imported after all when the source does not define the class plainly."""
    package = importlib.util.find_spec("transformers")
    if package is not None and package.submodule_search_locations:
        source = Path(package.submodule_search_locations[0], *module.split(".")[1:]).with_suffix(".py")
        if source.is_file():
            for node in ast.parse(source.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ClassDef) and node.name == name:
                    values = tuple(
                        item.value.value
                        for item in node.body
                        if isinstance(item, ast.Assign) and isinstance(item.value, ast.Constant)
                        if isinstance(item.value.value, str)
                    )
                    if values:
                        return values
    return tuple(member.value for member in getattr(importlib.import_module(module), name))


@cache
def transformers_optimizers() -> tuple[str, ...]:
    return _enum_values("transformers.training_args", "OptimizerNames")


@cache
def transformers_schedulers() -> tuple[str, ...]:
    return _enum_values("transformers.trainer_utils", "SchedulerType")


def optimizer_problem(name: str) -> str | None:
    """Why `optimizer: name` cannot train, or None when the installed transformers builds it (its package, e.g.
    bitsandbytes, is a property of the training machine and is checked there)."""
    if name == AUTO or (name in transformers_optimizers() and name not in REFUSED_OPTIMIZERS):
        return None
    if name in REFUSED_OPTIMIZERS:
        return f"`{name}` cannot be used: {REFUSED_OPTIMIZERS[name]}"
    if name in AXOLOTL_OPTIMIZERS:
        return (
            f"`{name}` is one of Axolotl's own optimizers, which is not offered: hellbender trains with the optimizers "
            "of transformers (`adamw_torch_fused`, `adamw_bnb_8bit`, `adamw_torch_8bit`, `paged_adamw_8bit`, `sgd`, "
            "...; `hellbender schema` lists them)"
        )
    offered = (AUTO, *(n for n in transformers_optimizers() if n not in REFUSED_OPTIMIZERS))
    return (
        f"`{name}` is not an optimizer the installed transformers knows{did_you_mean(name, offered)}; it knows "
        + ", ".join(f"`{n}`" for n in offered)
    )


def scheduler_problem(name: str, offered: tuple[str, ...]) -> str | None:
    """Why `lr_scheduler: name` is refused, or None when hellbender offers it (`offered`). transformers' other
    schedules are named as such, with what to use instead."""
    if name in offered:
        return None
    if name in transformers_schedulers():
        return (
            f"transformers' `{name}` schedule is not offered: use one of "
            + ", ".join(f"`{n}`" for n in offered)
            + " (`cosine` with `cosine_min_lr_ratio` decays to a floor)"
        )
    return f"`{name}` is not a learning-rate schedule{did_you_mean(name, offered)}; use one of " + ", ".join(
        f"`{n}`" for n in offered
    )
