"""What a run asks of the machine that trains it, beyond the config: a GPU for the precision and attention it names,
and the package its optimizer is built from. A config may be validated on a laptop and trained on a GPU server, so
`validate` notes each problem as it stands on its own machine, and `train` stops on it before any file is written or
data prepared (transformers would otherwise fail only once the model is loaded, with a traceback)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from hellbender.config.machine import Machine, this_machine
from hellbender.errors import EnvironmentProblem

if TYPE_CHECKING:
    from hellbender.config.schema import HellbenderConfig

# Optimizers transformers builds from another package: (module imported, what to install). bitsandbytes comes with
# the `gpu` extra.
_BITSANDBYTES = ("bitsandbytes", "bitsandbytes")
OPTIMIZER_PACKAGES: dict[str, tuple[str, str]] = {
    "adamw_torch_4bit": ("torchao", "torchao"),
    "adamw_torch_8bit": ("torchao", "torchao"),
    "adamw_anyprecision": ("torchdistx", "torchdistx"),
    "lomo": ("lomo_optim", "lomo-optim"),
    "adalomo": ("lomo_optim", "lomo-optim"),
    "grokadamw": ("grokadamw", "grokadamw"),
    "schedule_free_radam": ("schedulefree", "schedulefree"),
    "schedule_free_adamw": ("schedulefree", "schedulefree"),
    "schedule_free_sgd": ("schedulefree", "schedulefree"),
    "stable_adamw": ("optimi", "torch-optimi"),
    **{
        name: _BITSANDBYTES
        for name in (
            "adamw_bnb_8bit", "adamw_8bit", "ademamix", "ademamix_8bit", "lion_8bit", "lion_32bit", "paged_adamw_32bit",
            "paged_adamw_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit", "paged_lion_32bit", "paged_lion_8bit",
            "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
        )
    },
}  # fmt: skip


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def optimizer_package_problem(optimizer: str) -> str | None:
    if optimizer not in OPTIMIZER_PACKAGES:
        return None
    module, package = OPTIMIZER_PACKAGES[optimizer]
    if _installed(module):
        return None
    return (
        f"`optimizer: {optimizer}` is built from the `{package}` package, which is not installed: "
        f"`pip install {package}`, or use `optimizer: adamw_torch` (`auto` picks the fused AdamW on a GPU)."
    )


def _tf32_capable() -> bool:
    """An Ampere or newer CUDA GPU: the first that computes in TF32."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def precision_problems(cfg: HellbenderConfig, machine: Machine) -> list[str]:
    problems = []
    if cfg.bf16 is True and not machine.bf16:
        problems.append(
            f"`bf16: true` trains in bfloat16, which needs a CUDA GPU that computes in it, and this machine has "
            f"{machine.describe()}. Use `bf16: auto` (bfloat16 where the GPU has it, else float32), or train on such "
            "a GPU."
        )
    elif cfg.fp16 and cfg.bf16 is not True and not machine.cuda and not (cfg.bf16 == "auto" and machine.bf16):
        problems.append(
            f"`fp16: true` trains in float16 mixed precision, which needs a CUDA GPU, and this machine has "
            f"{machine.describe()}. Remove `fp16` (float32), or train on a GPU."
        )
    if cfg.tf32 and not (machine.cuda and _tf32_capable()):
        problems.append(
            f"`tf32: true` lets matrix products run in TensorFloat-32, which needs an Ampere or newer CUDA GPU, and "
            f"this machine has {machine.describe() if not machine.cuda else 'an older one'}. Remove `tf32`, or train "
            "on such a GPU."
        )
    return problems


def attention_problem(cfg: HellbenderConfig, machine: Machine) -> str | None:
    """PyTorch's flex attention has no backward pass on a CPU: the run would fail at its first step."""
    if cfg.attn_implementation != "flex_attention" or machine.cuda:
        return None
    return (
        f"`attn_implementation: flex_attention` cannot train on this machine ({machine.describe()}): PyTorch's flex "
        "attention has no backward pass on a CPU. Use `attn_implementation: sdpa`, or train on a GPU."
    )


def compiled_generation_problem(cfg: HellbenderConfig, machine: Machine) -> str | None:
    """transformers compiles the decoding step only on accelerators: on a CPU `true` would change nothing."""
    if cfg.trl is None or not cfg.trl.compile_generation or machine.cuda:
        return None
    return (
        f"`trl.compile_generation: true` compiles generation's decoding step, which transformers does only on a GPU, "
        f"and this machine has {machine.describe()}: the key would change nothing here. Remove it, or train on a GPU."
    )


def machine_problems(cfg: HellbenderConfig, machine: Machine | None = None) -> list[str]:
    """Why `cfg` cannot train on `machine` (default: this one), though it is a valid config."""
    machine = machine or this_machine()
    problems = precision_problems(cfg, machine)
    if problem := attention_problem(cfg, machine):
        problems.append(problem)
    if problem := optimizer_package_problem(cfg.optimizer):
        problems.append(problem)
    if problem := compiled_generation_problem(cfg, machine):
        problems.append(problem)
    if cfg.qat is not None:  # `quantization:` alone changes nothing about training: `hellbender quantize` checks it
        from hellbender.config.quantization_machine import machine_problem

        if problem := machine_problem(cfg.qat, "qat"):
            problems.append(problem)
    return problems


def machine_notices(cfg: HellbenderConfig) -> list[str]:
    """`validate`'s notes: each problem as it stands here, where `train` would stop on it."""
    return [f"On this machine `train` would stop: {problem}" for problem in machine_problems(cfg)]


def require_machine(cfg: HellbenderConfig) -> None:
    """Stop a run that this machine cannot train, before any work."""
    if problems := machine_problems(cfg):
        raise EnvironmentProblem("\n\n".join(problems))
