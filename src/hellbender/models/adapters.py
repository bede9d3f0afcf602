"""LoRA / QLoRA / DoRA adapters through PEFT, and freezing the vision side of vision-language models."""

from __future__ import annotations

import importlib.util
import logging
import re
from importlib.metadata import version
from typing import Any

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError, EnvironmentProblem
from hellbender.models.expert_targets import (
    check_adapted,
    check_parameter_wrapper_options,
    expert_weights,
    layers_peft_moves,
    names_reaching_experts,
    wanted_expert_weights,
)
from hellbender.models.fixes.unadaptable_layers import left_out_notice, refusal, unadaptable_layers

logger = logging.getLogger("hellbender")

# PEFT's ModulesToSaveWrapper forwards keyword-only calls from this version on; Gemma 4 calls its vision
# tower and embedder with keyword arguments only.
MIN_PEFT_FOR_KEYWORD_MODULES = (0, 21)


def language_model_prefix(model: Any) -> str:
    """Name of the language-model part of a vision-language model (e.g. `model.language_model`)."""
    decoder = model.get_decoder()
    for name, module in model.named_modules():
        if module is decoder:
            return name
    raise ConfigError(f"Could not find the language model inside {type(model).__name__}.")


def _linear_modules(model: Any, prefix: str) -> dict[str, str]:
    """Full name -> leaf name of every linear layer under `prefix`, the output head excepted."""
    import torch

    head = model.get_output_embeddings()
    return {
        name: name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head and name.startswith(prefix)
    }


def adapter_targets(cfg: HellbenderConfig, model: Any) -> tuple[list[str] | str, list[str]]:
    """(PEFT's `target_modules`, its `target_parameters`). A model without fused expert weights, and a config without
    `lora_target_parameters`, keeps the plain path; otherwise every target is decided here by full name."""
    prefix = language_model_prefix(model) if cfg.is_multimodal else ""
    if not cfg.lora_target_parameters and not expert_weights(model, prefix):
        return target_modules(cfg, model), []
    linear = _linear_modules(model, prefix)
    if cfg.reward_model:  # PEFT trains the new score head in full (SEQ_CLS); it is no layer to adapt
        linear = {n: leaf for n, leaf in linear.items() if leaf != "score"}
    if isinstance(cfg.lora_target_modules, str):  # a regex: PEFT's rule, the whole name; experts only by parameter
        modules = [n for n in _linear_modules(model, "") if re.fullmatch(cfg.lora_target_modules, n)]
        asked: set[str] | None = set()
    elif cfg.lora_target_linear:
        modules, asked = list(linear), None
    else:
        asked = set(cfg.lora_target_modules or [])
        leaves = set(linear.values())
        if missing := sorted(asked - leaves - names_reaching_experts(model, prefix, asked)):
            raise ConfigError(
                f"`lora_target_modules`: {', '.join(missing)} not found among the linear layers or the expert "
                f"weights: {', '.join(sorted(leaves))}. Name the ones to adapt in `lora_target_modules` (expert "
                "weights in `lora_target_parameters`), or set `lora_target_linear: true`."
            )
        modules = [n for n, leaf in linear.items() if leaf in asked]
    modules = _without_unadaptable(model, modules, cfg.lora_target_linear and asked is None)
    parameters = wanted_expert_weights(cfg, model, prefix, asked)
    if cfg.unfrozen_parameters:
        modules = [n for n in modules if any(re.match(p, f"{n}.weight") for p in cfg.unfrozen_parameters)]
        parameters = [n for n in parameters if any(re.match(p, n) for p in cfg.unfrozen_parameters)]
    if not modules and not parameters:
        raise ConfigError(
            "No layer or expert weight to adapt: check `lora_target_modules`, `lora_target_parameters` and "
            "`unfrozen_parameters`."
        )
    # Layers PEFT would silently turn into expert-weight targets are adapted as parameters (their `.weight`) instead.
    moved = layers_peft_moves(model, modules)
    modules = sorted(set(modules) - moved)
    parameters = sorted({*parameters, *(f"{n}.weight" for n in moved)})
    why = "This config adapts expert weights (or layers PEFT adapts like them, e.g. a shared expert's `down_proj`):"
    check_parameter_wrapper_options(cfg, parameters, why)
    return modules, parameters


def _without_unadaptable(model: Any, modules: list[str], every_linear: bool) -> list[str]:
    """`modules` (full names) without the layers LoRA cannot adapt in this model's family, left out with one notice
    line. When the config named them (not `every_linear`), a name that reaches only such layers is refused; one that
    also reaches adaptable layers (a sparse-attention indexer's `gate_proj` beside the MLP's) keeps those."""
    left_out = unadaptable_layers(model)
    hit = [name for name in modules if name in left_out]
    if not hit:
        return modules
    if not every_linear:
        adaptable_leaves = {_leaf(name) for name in modules if name not in left_out}
        only_unadaptable = [name for name in hit if _leaf(name) not in adaptable_leaves]
        if only_unadaptable:
            raise ConfigError(refusal(only_unadaptable, left_out))
    logger.warning(left_out_notice({name: left_out[name] for name in hit}))
    return [name for name in modules if name not in left_out]


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def target_modules(cfg: HellbenderConfig, model: Any) -> list[str] | str:
    """What LoRA adapts: the targets the config names, kept to the layers `unfrozen_parameters` matches when it is
    set (an adapter never trains base weights in full)."""
    targets = _named_targets(cfg, model)
    if not cfg.unfrozen_parameters:
        return targets
    if isinstance(targets, str):  # `all-linear`, or a regex PEFT matches against the whole module name
        linear = _linear_modules(model, "")
        targets = list(linear) if targets == "all-linear" else [n for n in linear if re.fullmatch(targets, n)]
    elif not cfg.is_multimodal:  # leaf names: every layer with that leaf name
        targets = [name for name, leaf in _linear_modules(model, "").items() if leaf in targets]
    kept = sorted(n for n in targets if any(re.match(p, f"{n}.weight") for p in cfg.unfrozen_parameters))
    if not kept:
        raise ConfigError(
            f"`unfrozen_parameters` matches none of the layers LoRA adapts (e.g. `{targets[0]}.weight`): with an "
            "adapter it chooses which of those layers get adapter matrices. Fix the patterns (matched from the start "
            "of the parameter name), or remove `unfrozen_parameters`."
            if targets
            else "No layer to adapt: check `lora_target_modules`."
        )
    return kept


def _named_targets(cfg: HellbenderConfig, model: Any) -> list[str] | str:
    """What LoRA adapts, as the config names it. A regex string is passed to PEFT as is (it may reach the vision tower). Otherwise
    targets are leaf names (`q_proj`; validation fills the default list), and for vision-language models only
    layers of the language model are adapted, given as full names. A named target the model lacks is an error."""
    if isinstance(cfg.lora_target_modules, str):
        matched = [name for name in unadaptable_layers(model) if re.fullmatch(cfg.lora_target_modules, name)]
        _without_unadaptable(model, matched, every_linear=False)  # refuses any match
        return cfg.lora_target_modules
    prefix = language_model_prefix(model) if cfg.is_multimodal else ""
    # PEFT's `all-linear` would take the layers LoRA cannot adapt too: then the targets are listed by full name.
    left_out = unadaptable_layers(model)
    if not cfg.is_multimodal and cfg.lora_target_linear and not cfg.lora_target_modules and not left_out:
        return "all-linear"
    linear = _linear_modules(model, prefix)
    leaves = set(linear.values())
    wanted = set(cfg.lora_target_modules or [])
    missing = sorted(wanted - leaves)
    if missing or not (wanted or cfg.lora_target_linear):
        where = f" of the language model (`{prefix}`)" if prefix else ""
        raise ConfigError(
            f"`lora_target_modules`: {', '.join(missing) or 'no module'} not found among the linear layers{where}: "
            f"{', '.join(sorted(leaves))}. Name the ones to adapt in `lora_target_modules`, or set "
            "`lora_target_linear: true`."
        )
    if cfg.lora_target_linear and left_out:
        return _without_unadaptable(model, sorted(linear), every_linear=True)
    if cfg.lora_target_linear:
        wanted = leaves
    named = sorted(name for name, leaf in linear.items() if leaf in wanted)
    kept = _without_unadaptable(model, named, every_linear=False)
    if cfg.is_multimodal or kept != named:  # full names: PEFT would match a leaf name everywhere
        return kept
    return sorted(wanted)


def freeze_vision_modules(model: Any) -> list[str]:
    """Freeze every parameter outside the language model and the output head; returns their names."""
    prefix = language_model_prefix(model)
    head = {id(p) for p in model.get_output_embeddings().parameters()}
    frozen = []
    for name, param in model.named_parameters():
        if not name.startswith(prefix) and id(param) not in head:
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def freeze_all_but(model: Any, patterns: list[str]) -> None:
    """Freeze every parameter whose name matches none of `patterns` (`re.match`: from the start of the name)."""

    names = [name for name, _ in model.named_parameters()]
    unmatched = [p for p in patterns if not any(re.match(p, name) for name in names)]
    if unmatched:
        raise ConfigError(
            f"`unfrozen_parameters`: {', '.join(f'`{p}`' for p in unmatched)} match no parameter of the model (they "
            f"are matched from the start of the name, e.g. `{names[0]}`). Fix the patterns."
        )
    for name, param in model.named_parameters():
        if not any(re.match(p, name) for p in patterns):
            param.requires_grad_(False)


def check_peft_version(cfg: HellbenderConfig) -> None:
    installed = version("peft")
    parts = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
    if cfg.lora_modules_to_save and parts < MIN_PEFT_FOR_KEYWORD_MODULES:
        raise EnvironmentProblem(
            f"`lora_modules_to_save` needs peft >= {'.'.join(map(str, MIN_PEFT_FOR_KEYWORD_MODULES))} (its wrapper "
            f"passes keyword-only calls through, which vision towers such as Gemma 4's need); installed: {installed}. "
            "Run `pip install -U peft`."
        )


def loftq_arguments(cfg: HellbenderConfig) -> dict[str, Any]:
    """LoraConfig's arguments for `peft.loftq_config`. PEFT's LoftQ quantizes with bitsandbytes on a CUDA device
    (it moves each weight there) and PEFT asks for scipy, so all three are checked first."""
    if cfg.loftq is None:
        return {}
    import torch
    from peft import LoftQConfig

    if not torch.cuda.is_available():
        raise EnvironmentProblem(
            "`peft.loftq_config` quantizes the base weights with bitsandbytes on a CUDA GPU (PEFT's LoftQ runs "
            "there), and none is visible here. Run on a GPU, or remove `peft.loftq_config` for LoRA's usual start."
        )
    if missing := [name for name in ("bitsandbytes", "scipy") if importlib.util.find_spec(name) is None]:
        raise EnvironmentProblem(
            f"`peft.loftq_config` needs {' and '.join(missing)} (bitsandbytes quantizes the base weights; PEFT's LoftQ "
            f"asks for scipy): `pip install 'hellbender[gpu]'` (or `pip install {' '.join(missing)}`)."
        )
    loftq = LoftQConfig(loftq_bits=cfg.loftq.loftq_bits, loftq_iter=cfg.loftq.loftq_iter)
    return {"init_lora_weights": "loftq", "loftq_config": loftq}


def apply_adapter(cfg: HellbenderConfig, model: Any) -> Any:
    """Wrap `model` in a PEFT adapter when the config asks for one; otherwise return it for full fine-tuning."""
    if cfg.freeze_mm_modules:
        freeze_vision_modules(model)
    if cfg.adapter is None:
        if cfg.unfrozen_parameters:
            freeze_all_but(model, cfg.unfrozen_parameters)
        return model
    check_peft_version(cfg)
    from peft import LoraConfig, get_peft_model

    # QLoRA keeps the weights that are not quantized (embeddings, output head, norms) in the run's dtype, as LoRA
    # does. PEFT's `prepare_model_for_kbit_training` would cast them to float32: on an 8B model that is 4 GiB
    # more for the embeddings and head, a float32 residual stream (twice the activation memory) and a float32
    # output-head matmul. Checkpointing is enabled later, by hellbender (train/run.py), for every kind of training.
    modules, parameters = adapter_targets(cfg, model)
    settings = dict(
        **loftq_arguments(cfg),
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=modules,
        target_parameters=parameters or None,
        modules_to_save=list(cfg.lora_modules_to_save) or None,
        use_dora=cfg.peft_use_dora,
        use_rslora=cfg.peft_use_rslora,
        # A reward model's score head is new: PEFT's SEQ_CLS task trains it in full and saves it with the adapter.
        task_type="SEQ_CLS" if cfg.reward_model else "CAUSAL_LM",
    )
    if cfg.qat is not None:  # the linear layers are fake-quantized by now: LoRA on them fake-quantizes W + B·A
        from hellbender.models.qat_lora import qat_lora_config

        lora = qat_lora_config(cfg.qat, **settings)
    else:
        lora = LoraConfig(**settings)
    if cfg.lora_kernels:
        from hellbender.models.fused_lora import enable_lora_kernels, register_fused_lora

        register_fused_lora(lora)
    prefix = language_model_prefix(model) if cfg.is_multimodal else ""
    experts = expert_weights(model, prefix)
    adapted = get_peft_model(model, lora)
    if cfg.lora_kernels:
        enable_lora_kernels(adapted, cfg.lora_kernels)
    decided_here = bool(cfg.lora_target_parameters or experts)  # full names, from `adapter_targets`
    check_adapted(adapted, modules if decided_here else None, parameters, experts)
    if cfg.qat is not None:
        from hellbender.models.qat_lora import check_adapted_under_qat

        logger.info(
            "qat: %d LoRA layers train against their fake-quantized merged weight", check_adapted_under_qat(adapted)
        )
    return adapted
