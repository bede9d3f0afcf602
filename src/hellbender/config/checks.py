"""Combinations of keys that cannot work together. Each problem is one paragraph naming the keys."""

from __future__ import annotations

import difflib
from pathlib import Path

from hellbender.chat_templates import TEMPLATE_NAMES, is_known_template, known_names_text, not_shipped_reason
from hellbender.config.config_class import config_class_problems
from hellbender.config.data import CHAT_ROLES, is_preference_type
from hellbender.config.data_order import data_order_problems
from hellbender.config.deepspeed import deepspeed_problems
from hellbender.config.defaults import TORCH_COMPILE_DEFAULTS
from hellbender.config.distillation_checks import distillation_problems
from hellbender.config.kernels import PARTITIONING_BACKENDS
from hellbender.config.lora_kernel_checks import lora_kernel_problems
from hellbender.config.mistral_common import mistral_common_problems
from hellbender.config.model import is_hub_kernel
from hellbender.config.model_quantization import model_quantization_problems
from hellbender.config.model_sources import local_source_problem
from hellbender.config.plugins import plugin_problems
from hellbender.config.preference_checks import preference_problems
from hellbender.config.preference_data_checks import preference_data_problems
from hellbender.config.quantization_checks import quantization_problems
from hellbender.config.rl import ONLINE_RL_METHODS
from hellbender.config.rl_checks import rl_problems
from hellbender.config.schema import HellbenderConfig
from hellbender.config.streaming_checks import streaming_problems
from hellbender.config.tracking_checks import swanlab_notices, swanlab_problems
from hellbender.config.training_checks import training_conflicts
from hellbender.config.value_checks import value_conflicts
from hellbender.storage import can_write


def find_conflicts(cfg: HellbenderConfig) -> list[str]:
    problems: list[str] = []

    if not cfg.datasets and not cfg.pretraining_dataset:
        problems.append("No training data: add a `datasets:` list (or `pretraining_dataset:` for streamed raw text).")
    if cfg.bf16 is True and cfg.fp16:
        problems.append("`bf16: true` and `fp16: true` are both set; choose one mixed-precision mode.")
    problems += streaming_problems(cfg)
    for key in ("hub_strategy", "hub_revision"):
        if getattr(cfg, key) is not None and not cfg.hub_model_id:
            problems.append(
                f"`{key}` is set, but `hub_model_id` is not, so nothing is pushed to the Hugging Face Hub. Add "
                f"`hub_model_id: user/name` to push the trained model, or remove `{key}`."
            )
    if cfg.save_steps is not None and cfg.saves_per_epoch is not None:
        problems.append("`save_steps` and `saves_per_epoch` are both set; keep one.")
    if cfg.eval_steps is not None and cfg.evals_per_epoch is not None:
        problems.append("`eval_steps` and `evals_per_epoch` are both set; keep one.")
    if cfg.warmup_steps is not None and cfg.warmup_ratio is not None:
        problems.append("`warmup_steps` and `warmup_ratio` are both set; keep one.")
    problems += training_conflicts(cfg)
    problems += value_conflicts(cfg)
    # Keys at their default ask for nothing: a dumped full fine-tuning config lists them all and must reload.
    lora_keys = sorted(
        k
        for k, field in type(cfg).model_fields.items()
        if k.startswith(("lora_", "peft_")) and getattr(cfg, k) != field.get_default(call_default_factory=True)
    )
    problems += lora_kernel_problems(cfg)
    if cfg.adapter is None and lora_keys:
        problems.append(
            f"{', '.join(f'`{k}`' for k in lora_keys)} set but `adapter` is not: add `adapter: lora` (or `qlora`), "
            "or remove these keys for full fine-tuning."
        )
    if cfg.adapter and cfg.lora_target_parameters and (cfg.lora_dropout or cfg.peft_use_dora):
        # PEFT's ParamWrapper adds the update to the weight itself, so there is no adapter input to drop out and no
        # per-column magnitude for DoRA to keep.
        asked = "`lora_dropout`" if cfg.lora_dropout else "`peft_use_dora: true`"
        problems.append(
            f"`lora_target_parameters` adapts weights directly (PEFT's `target_parameters`), which PEFT cannot "
            f"combine with {asked}: set `lora_dropout: 0` and leave `peft_use_dora` off, or remove "
            "`lora_target_parameters`."
        )
    if cfg.load_in_8bit and (cfg.adapter != "lora" or cfg.load_in_4bit):
        problems.append(
            "`load_in_8bit: true` needs `adapter: lora` (an 8-bit base is trained through an adapter), and not "
            "`load_in_4bit` or `adapter: qlora` (a 4-bit base): choose one precision for the base model."
        )
    if cfg.loftq and (cfg.adapter != "lora" or cfg.quantized_bits):
        quantized = cfg.quantized_bits or cfg.adapter == "qlora"
        base = "a base quantized by bitsandbytes" if quantized else "full fine-tuning (no adapter)"
        problems.append(
            f"`peft.loftq_config` starts a LoRA adapter from the quantization error of the base weights, so it needs "
            f"`adapter: lora` on an unquantized base, not {base}: LoftQ quantizes the weights itself (PEFT cannot "
            "start it from weights bitsandbytes already quantized). Use `adapter: lora` without `load_in_4bit` / "
            "`load_in_8bit`, or remove `peft.loftq_config`."
        )
    if cfg.reinit_weights and cfg.adapter is not None:
        problems.append(
            "`reinit_weights: true` starts from random weights, and `adapter` is set: an adapter on an untrained base "
            "learns nothing useful. Remove `adapter` to pretrain from scratch, or `reinit_weights`."
        )
    if cfg.bnb_config_kwargs is not None and not (cfg.load_in_4bit or cfg.adapter == "qlora"):
        problems.append("`bnb_config_kwargs` sets QLoRA's 4-bit quantization; it needs `adapter: qlora`.")
    if cfg.load_in_4bit and cfg.adapter != "qlora":
        problems.append(
            "`load_in_4bit: true` needs `adapter: qlora` (a 4-bit base can only be trained through an adapter)."
        )
    attn = cfg.attn_implementation
    if cfg.flash_attention and attn not in (None, "flash_attention_2"):
        problems.append(f"`flash_attention: true` contradicts `attn_implementation: {attn}`; keep one.")
    if cfg.sdp_attention and attn not in (None, "sdpa"):
        problems.append(f"`sdp_attention: true` contradicts `attn_implementation: {attn}`; keep one.")
    if cfg.flash_attention and cfg.sdp_attention:
        problems.append("`flash_attention` and `sdp_attention` are both true; keep one.")
    packs = (None, "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
    # A hub kernel packs as flash attention does; whether this kernel is one is known once it is loaded (hub_kernels.py).
    if cfg.sample_packing and attn not in packs and not is_hub_kernel(attn):
        problems.append(
            f"`sample_packing` is not supported yet with `attn_implementation: {attn}`; use sdpa, eager, flash or "
            "flex attention, which keep packed documents from attending to each other."
        )
    problems += _flex_compile_conflicts(cfg)
    problems += _memory_budget_problems(cfg)
    for where, name in [("", cfg.chat_template)] + [
        (f"Dataset `{e.path}`: ", e.chat_template) for e in cfg.datasets + cfg.test_datasets
    ]:
        if name is not None and not is_known_template(name):
            reason = not_shipped_reason(name)
            if reason:
                problems.append(
                    f"{where}`chat_template: {name}` is not offered (an Axolotl template hellbender deliberately "
                    f"does not ship): {reason}."
                )
                continue
            close = difflib.get_close_matches(name, TEMPLATE_NAMES, n=1, cutoff=0.6)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            problems.append(
                f"{where}`chat_template: {name}` is not a chat template hellbender knows{hint}. Known names: "
                f"{known_names_text()}. For another format use `tokenizer_default` (the model's own template) or "
                "`jinja` with the template text in `chat_template_jinja`."
            )
    problems += plugin_problems(cfg.plugins)
    problems += distillation_problems(cfg)
    problems += swanlab_problems(cfg)
    problems += _roles_to_train_problems(cfg)
    problems += preference_data_problems(cfg)
    problems += data_order_problems(cfg)
    problems += mistral_common_problems(cfg)
    problems += model_quantization_problems(cfg)
    problems += quantization_problems(cfg)
    problems += preference_problems(cfg)
    problems += rl_problems(cfg)
    problems += config_class_problems(cfg)
    problems += _multimodal_conflicts(cfg)
    problems += _distributed_conflicts(cfg)
    if cfg.chat_template == "jinja" and not cfg.chat_template_jinja:
        problems.append("`chat_template: jinja` needs the template itself in `chat_template_jinja`.")
    for entry in cfg.datasets + cfg.test_datasets:
        if entry.chat_template == "jinja" and not entry.chat_template_jinja:
            problems.append(
                f"Dataset `{entry.path}`: `chat_template: jinja` needs `chat_template_jinja` in the same entry."
            )
    return problems


def _memory_budget_problems(cfg: HellbenderConfig) -> list[str]:
    if cfg.activation_memory_budget is None:
        return []
    if not cfg.torch_compile:
        return [
            f"`activation_memory_budget: {cfg.activation_memory_budget}` needs `torch_compile: true`: it tells the "
            "compiler what the compiled layers may keep for backward, and nothing is compiled. Add `torch_compile: "
            "true`, or remove the key."
        ]
    backend = cfg.torch_compile_backend or TORCH_COMPILE_DEFAULTS["torch_compile_backend"]
    if backend not in PARTITIONING_BACKENDS:
        return [
            f"`activation_memory_budget` with `torch_compile_backend: {backend}`: only "
            f"{' and '.join(f'`{b}`' for b in PARTITIONING_BACKENDS)} split the compiled graph by torch's partitioner, "
            "which is what honours the budget. Use `inductor` (the default), or remove the key."
        ]
    return []


def _flex_compile_conflicts(cfg: HellbenderConfig) -> list[str]:
    if cfg.flex_attn_compile_kwargs is None:
        return []
    if cfg.attn_implementation != "flex_attention":
        return [
            "`flex_attn_compile_kwargs` sets how flex attention is compiled, but `attn_implementation` is not "
            "`flex_attention`. Set `attn_implementation: flex_attention`, or remove `flex_attn_compile_kwargs`."
        ]
    if cfg.torch_compile:
        return [
            "`flex_attn_compile_kwargs` cannot be honoured with `torch_compile: true`: the whole model is compiled "
            "then, flex attention inside it with the model's settings (`torch_compile_mode`, ...), and a compile "
            "nested in another ignores its own arguments. Remove one of them."
        ]
    return []


def find_notices(cfg: HellbenderConfig) -> list[str]:
    """Settings that ask for nothing in this config, said in one line each (they are not errors: Axolotl's example
    configs carry them routinely)."""
    notices = []
    if (cfg.eval_steps or cfg.evals_per_epoch) and not cfg.has_eval_data:
        notices.append(
            "`eval_steps` / `evals_per_epoch` is set but there is no evaluation data (`val_set_size: 0`, no "
            "`test_datasets`), so nothing is evaluated; add one of them to evaluate."
        )
    flex_settings = cfg.flex_attn_compile_kwargs or {}
    flex = cfg.attn_implementation == "flex_attention"
    if flex and flex_settings.get("dynamic") is False and not cfg.pad_to_sequence_len:
        notices.append(
            "`flex_attn_compile_kwargs: {dynamic: false}` compiles flex attention anew for every batch length, and "
            "batches here are as long as their longest row; after torch's recompile limit (8 by default) it runs "
            "uncompiled, slowly and with the whole score matrix in memory. Set `pad_to_sequence_len: true` (text "
            "models) for one length, or remove `dynamic: false`."
        )
    if cfg.uses_fsdp2 and cfg.load_in_4bit and cfg.fsdp_settings.cpu_ram_efficient_loading:
        notices.append(
            "`fsdp_config.cpu_ram_efficient_loading` does nothing for a 4-bit base: accelerate leaves models with "
            "4-bit weights out of it, so every process loads the whole 4-bit model onto its GPU (about half a byte per "
            "quantized weight, plus the embeddings and output head in the run's dtype) before FSDP2 shards it."
        )
    notices += swanlab_notices(cfg)
    if cfg.loftq and cfg.adapter == "lora" and not cfg.quantized_bits:
        scale = cfg.lora_alpha / (cfg.lora_r**0.5 if cfg.peft_use_rslora else cfg.lora_r)
        if abs(scale - 1) > 1e-6:
            notices.append(
                f"`peft.loftq_config`: LoftQ fits the LoRA matrices to the quantization error at scale 1, and the "
                f"adapter's scale here is {scale:g} (`lora_alpha` / `lora_r`), so it starts by correcting {scale:g} "
                "times that error. Set `lora_alpha` to `lora_r` for LoftQ's own start."
            )
    if "loss_watchdog_patience" in cfg.model_fields_set and cfg.loss_watchdog_threshold is None:
        notices.append(
            "`loss_watchdog_patience` is set but `loss_watchdog_threshold` is not, so the loss is not watched."
        )
    return notices


def _roles_to_train_problems(cfg: HellbenderConfig) -> list[str]:
    """A role in `roles_to_train` that no message can have trains nothing, silently, in every row."""
    problems = []
    for list_key, entries in (("datasets", cfg.datasets), ("test_datasets", cfg.test_datasets)):
        for i, entry in enumerate(entries):
            known = set(CHAT_ROLES) | set(entry.roles or {})
            for role in entry.roles_to_train or []:
                if role not in known:
                    problems.append(
                        f"`{list_key}[{i}].roles_to_train`: `{role}` is not a role a message can have; the roles are "
                        f"{', '.join(sorted(known))}. Dataset role names (`gpt`, `human`, ...) map onto these, and "
                        "`roles:` adds more, e.g. `roles: {assistant: [bot]}`."
                    )
    return problems


def _file_in_the_way(path: Path) -> Path | None:
    """`path`, or the nearest of its parents that exists, when that is not a directory: nothing can be written
    under it."""
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return None if candidate.is_dir() else candidate
    return None


def _unwritable_parent(path: Path) -> Path | None:
    """The nearest existing directory of `path` (itself or a parent), when this process cannot create files in it."""
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return None if can_write(candidate) else candidate
    return None


def find_path_problems(cfg: HellbenderConfig, prepared_path_is_default: bool = False) -> list[str]:
    """Directories the run writes into that cannot be created, found before any work is done (a run would
    otherwise prepare the data, load the model, and only then fail to create `output_dir`)."""
    problems = []
    keys = [("output_dir", cfg.output_dir), ("dataset_prepared_path", cfg.dataset_prepared_path)]
    for key, value in keys:
        blocker = _file_in_the_way(Path(value)) if value else None
        if blocker is None:
            if value and (closed := _unwritable_parent(Path(value))) is not None:
                problems.append(
                    f"`{key}: {value}` cannot be written: `{closed}` does not let this process create files in it "
                    f"(a read-only file system, or its permissions). Point `{key}` at a writable directory."
                )
            continue
        if key == "dataset_prepared_path" and prepared_path_is_default:
            problems.append(
                f"`dataset_prepared_path` defaults to `{value}` (beside `output_dir`), and `{blocker}` is a file. "
                "Move the file away, or set `dataset_prepared_path` to a directory for the prepared data."
            )
        elif blocker == Path(value):
            problems.append(
                f"`{key}: {value}` is a file; it must be a directory (or a path that does not exist yet), where the "
                "run writes its files. Point it somewhere else, or move the file away."
            )
        else:
            problems.append(
                f"`{key}: {value}` cannot be created: `{blocker}` is a file. Point `{key}` at a directory (or a path "
                "that does not exist yet)."
            )
    tokenizer_key = "tokenizer_config" if cfg.tokenizer_config else "base_model"
    for name, key, wanted in (
        (cfg.base_model, "base_model", "model"),
        (getattr(cfg, tokenizer_key), tokenizer_key, "tokenizer"),
    ):
        if problem := local_source_problem(name, key, wanted):
            problems.append(problem)
            break  # a data folder named as `base_model` is one mistake, not two
    problems += deepspeed_problems(cfg)  # the file, its contents, and the optional package
    return problems


MULTIMODAL_ONLY_KEYS = ("freeze_mm_modules", "image_size", "vision_tokens_to_mask", "cache_images")
MULTIMODAL_ENTRY_KEYS = ("image_base_dir", "image_token", "skip_bad_images", "allow_remote_images")
MULTIMODAL_TYPES = {"chat_template", "multimodal_pretrain"}


def _multimodal_conflicts(cfg: HellbenderConfig) -> list[str]:
    problems = []
    entries = cfg.datasets + cfg.test_datasets + cfg.pretraining_dataset
    mm_pretrain = [e for e in entries if e.type == "multimodal_pretrain"]
    if not cfg.is_multimodal:
        keys = [k for k in MULTIMODAL_ONLY_KEYS if getattr(cfg, k)]
        keys += sorted({k for e in entries for k in MULTIMODAL_ENTRY_KEYS if getattr(e, k)})
        if mm_pretrain:
            keys.append("type: multimodal_pretrain")
        if keys or cfg.skip_prepare_dataset:
            keys += ["skip_prepare_dataset"] if cfg.skip_prepare_dataset else []
            problems.append(
                f"{', '.join(f'`{k}`' for k in keys)} apply to vision-language models, and no processor is "
                "configured: set `processor_type` (e.g. `processor_type: AutoProcessor`) or remove these keys."
            )
        return problems
    problems += _multimodal_packing_conflicts(cfg)
    if cfg.pad_to_sequence_len:
        problems.append(
            "`pad_to_sequence_len` is not supported yet with `processor_type`: the processor pads image+text batches "
            "itself. Remove it."
        )
    # Preference types with a processor are checked with the rest of preference data (`preference_data_checks.py`),
    # online RL's prompt rows with the rest of online RL (`rl_checks.py`).
    online = cfg.rl in ONLINE_RL_METHODS
    sft_entries = [e for e in cfg.datasets + cfg.test_datasets if not is_preference_type(e.type) and not online]
    other_types = sorted({e.type or "pretokenized" for e in sft_entries} - MULTIMODAL_TYPES)
    other_types += sorted({e.type for e in cfg.pretraining_dataset} - MULTIMODAL_TYPES)
    if other_types:
        problems.append(
            f"With `processor_type`, datasets must be `type: chat_template` (image+text conversations) or "
            f"`type: multimodal_pretrain` (raw image+text); {', '.join(sorted(set(other_types)))} is not supported "
            "yet for vision-language models."
        )
    if cfg.excess_length_strategy == "truncate":
        problems.append(
            "`excess_length_strategy: truncate` could cut through an image's tokens; with `processor_type` use "
            "`drop` (the default) or `raise`."
        )
    if mm_pretrain:
        problems += _multimodal_pretrain_conflicts(cfg)
    return problems


def _multimodal_packing_conflicts(cfg: HellbenderConfig) -> list[str]:
    """Packing image+text rows is built for chat rows and `multimodal_pretrain` documents, prepared, pre-tokenized or
    streamed; the model family is checked at loading (`models/packed_vision.py`)."""
    keys = [k for k in ("sample_packing", "eval_sample_packing") if getattr(cfg, k)]
    if not keys:
        return []
    named = " and ".join(f"`{k}`" for k in keys)
    if cfg.tokenizer_use_mistral_common:
        return [
            f"{named} is not supported yet with `tokenizer_use_mistral_common` and `processor_type`: mistral-common "
            "encodes the images its own way. Remove the packing keys."
        ]
    return []


def _multimodal_pretrain_conflicts(cfg: HellbenderConfig) -> list[str]:
    problems = []
    both = sorted({e.path for e in cfg.datasets} & {e.path for e in cfg.pretraining_dataset})
    if both:
        problems.append(
            f"Dataset {', '.join(f'`{p}`' for p in both)} is declared under both `datasets:` and "
            "`pretraining_dataset:`; keep it in one place (`datasets:` to prepare it, `pretraining_dataset:` to "
            "stream it)."
        )
    if cfg.streaming and any(e.type == "multimodal_pretrain" for e in cfg.datasets):
        problems.append(
            "`streaming: true` streams `pretraining_dataset:` entries, but a `multimodal_pretrain` entry is under "
            "`datasets:`; move it to `pretraining_dataset:` to stream it, or set `streaming: false`."
        )
    if "chat_template" in cfg.model_fields_set and cfg.chat_template != "tokenizer_default":
        problems.append(
            "`chat_template` does not apply to `multimodal_pretrain` (raw image+text, no chat turns); remove it."
        )
    if cfg.skip_prepare_dataset and any(e.type != "multimodal_pretrain" for e in cfg.datasets):
        problems.append("`skip_prepare_dataset: true` needs every `datasets:` entry to be `type: multimodal_pretrain`.")
    return problems


def _checkpointing_kwargs_problems(kwargs: dict) -> list[str]:
    problems = []
    others = sorted(str(k) for k in kwargs if k != "use_reentrant")
    if others:
        problems.append(
            f"`gradient_checkpointing_kwargs`: {', '.join(f'`{k}`' for k in others)} cannot be passed on: hellbender "
            "sets up activation checkpointing itself (non-reentrant, with offload and partial layers as options). "
            "Remove them; `use_reentrant: false` is the only argument it accepts."
        )
    if kwargs.get("use_reentrant") not in (None, False):
        problems.append(
            "`gradient_checkpointing_kwargs.use_reentrant: true` is not offered; set it to false (or leave it out). "
            "hellbender's checkpointing is always non-reentrant, because reentrant checkpointing gives silently wrong gradients for models that share "
            "keys and values between layers (Gemma 4: gradients off by 0.25-0.40 on a tiny model) and loses the "
            "gradients of inputs that do not require them."
        )
    return problems


def _distributed_conflicts(cfg: HellbenderConfig) -> list[str]:
    problems = []
    if cfg.fsdp:
        problems.append(
            "`fsdp` (FSDP1's option list) is not supported: hellbender shards with FSDP2. Remove `fsdp` and set "
            "`fsdp_version: 2` with an `fsdp_config:` block (e.g. `transformer_layer_cls_to_wrap: LlamaDecoderLayer`)."
        )
    if cfg.fsdp_version == 1:
        problems.append(
            "`fsdp_version: 1` is not supported: hellbender shards with FSDP2 only. Set `fsdp_version: 2`; the "
            "`fsdp_config` keys stay the same."
        )
    fsdp = cfg.fsdp_settings
    if fsdp.use_orig_params is False:
        problems.append(
            "`fsdp_config.use_orig_params: false` cannot be honoured: FSDP2 always trains the original parameters "
            "(FSDP1 flattened them). Remove the key or set it to true."
        )
    if fsdp.sync_module_states is False and fsdp.cpu_ram_efficient_loading:
        problems.append(
            "`fsdp_config.sync_module_states: false` contradicts `cpu_ram_efficient_loading: true`, which sends the "
            "first process's weights to the others. Remove `sync_module_states` (every process starts from the "
            "same weights either way)."
        )
    if cfg.fsdp_final_state_dict_type == "SHARDED_STATE_DICT":
        problems.append(
            "`fsdp_final_state_dict_type: SHARDED_STATE_DICT` is not supported: the final model is always saved whole, "
            "so that transformers and PEFT load it. Remove the key (checkpoints can be sharded with "
            "`fsdp_config.state_dict_type`)."
        )
    if cfg.fsdp_config is not None and cfg.fsdp_version is None:
        problems.append("`fsdp_config` is set but `fsdp_version` is not: add `fsdp_version: 2` to shard with FSDP2.")
    if cfg.fp32_norms and not cfg.uses_fsdp2:
        problems.append(
            "`fp32_norms: true` needs FSDP2: it gives the norm layers their own FSDP2 mixed-precision policy. Add "
            "`fsdp_version: 2` and an `fsdp_config:` block, or remove `fp32_norms` (without FSDP, load the model in "
            "float32 to train every parameter in float32)."
        )
    if cfg.fp32_norms and not any(pattern.strip() for pattern in cfg.fp32_norm_classes):
        problems.append("`fp32_norm_classes` names no class; list class names such as `RMSNorm`, or remove the key.")
    if cfg.fp32_norms and cfg.fsdp_settings.cpu_ram_efficient_loading:
        problems.append(
            "`fp32_norms` and `fsdp_config.cpu_ram_efficient_loading` cannot be combined yet: the norm layers are "
            "sharded before the weights are spread from the first process. Set one of them to false."
        )
    if cfg.compiles_layers and (cfg.uses_fsdp2 or cfg.deepspeed):
        problems.append(
            "`torch_compile: true` with activation checkpointing and FSDP2 or DeepSpeed is not supported yet: "
            "hellbender then compiles each layer's checkpointed call, which has not been verified with the parameter "
            "gathering those engines add around each layer. Turn off "
            "`torch_compile` or activation checkpointing (`gradient_checkpointing`, `fsdp_config.activation_checkpointing`)."
        )
    liger = sorted(k for k in type(cfg).model_fields if k.startswith("liger_") and getattr(cfg, k))
    liger += ["cut_cross_entropy"] if cfg.cut_cross_entropy else []
    if cfg.compiles_layers:
        # Compiled layers leave the model's loss outside the compiled code: the fused cross-entropy runs as it does
        # uncompiled (measured on an H200).
        liger = [k for k in liger if k != "liger_fused_linear_cross_entropy"]
    if cfg.torch_compile and liger:
        problems.append(
            f"`torch_compile: true` with Liger's kernels ({', '.join(f'`{k}`' for k in liger)}) is not supported yet: "
            "compiling them failed with a CUDA illegal memory access on an H100 (torch 2.11, liger-kernel 0.8.5). "
            "Use one or the other."
        )
    if cfg.tiled_mlp and (cfg.uses_fsdp2 or cfg.deepspeed):
        problems.append(
            "`tiled_mlp` with FSDP2 or DeepSpeed is not supported yet: it back-propagates each MLP shard inside the "
            "layer's backward, which their gradient hooks do not expect. Use `tiled_mlp` on one GPU."
        )
    problems += _checkpointing_kwargs_problems(cfg.gradient_checkpointing_kwargs or {})
    if cfg.gradient_checkpointing_layers is not None and not cfg.checkpoints_activations:
        problems.append(
            "`gradient_checkpointing_layers` is set but activation checkpointing is off: add "
            "`gradient_checkpointing: true` (or `offload`), or remove the key."
        )
    if cfg.activation_offload_layers and not cfg.checkpoints_activations:
        problems.append(
            "`activation_offload_layers` offloads some of the checkpointed layers instead of recomputing them, and "
            "activation checkpointing is off: add `gradient_checkpointing: true`, or remove the key."
        )
    if cfg.activation_offload_layers and (cfg.uses_fsdp2 or cfg.deepspeed):
        problems.append(
            "`activation_offload_layers` with FSDP2 or DeepSpeed is not supported yet: the offloaded layers would park "
            "whatever those engines hand their layers (gathered weight shards among them), which has not been "
            "verified. Use it without them (one GPU, or DDP), or remove the key."
        )
    parks_on_host = cfg.activation_offload_layers or cfg.gradient_checkpointing == "offload"
    if cfg.compiles_cuda_graphs and parks_on_host:
        which = "`activation_offload_layers`" if cfg.activation_offload_layers else "`gradient_checkpointing: offload`"
        problems.append(
            f"`torch_compile_mode: {cfg.torch_compile_mode}` (CUDA graphs) with {which} is not supported: the "
            "offloader copies what the compiled layers save to host memory on a side stream, and CUDA graphs reuse "
            "that memory on their next replay (the W1 recipe with offloaded layers diverged at step 3 on an H200). "
            "Use `torch_compile_mode: default` or `max-autotune-no-cudagraphs`, or do not offload."
        )
    if cfg.tiled_mlp_num_shards is not None and not cfg.tiled_mlp:
        problems.append("`tiled_mlp_num_shards` is set but `tiled_mlp` is not: add `tiled_mlp: true`, or remove it.")
    if cfg.fused_cross_entropy_chunk_scale is not None and not cfg.fuses_the_loss:
        problems.append(
            "`fused_cross_entropy_chunk_scale` sizes the chunks of Liger's fused cross-entropy, which this config does "
            "not use: add `liger_fused_linear_cross_entropy: true`, or remove it."
        )
    hybrid = [k for k in ("dp_shard_size", "dp_replicate_size") if getattr(cfg, k) is not None]
    if hybrid and not cfg.uses_fsdp2:
        problems.append(
            f"{' and '.join(f'`{k}`' for k in hybrid)} set the shape of FSDP2 hybrid sharding, but `fsdp_version: 2` "
            "is not set: add it with an `fsdp_config:` block, or remove them."
        )
    if cfg.dp_shard_size == 1:
        problems.append(
            "`dp_shard_size: 1` shards nothing, and FSDP2 needs processes to shard over: replicate without sharding "
            "with DDP (`--nproc N` without `fsdp_version`), or set `dp_shard_size` to 2 or more."
        )
    if cfg.fp32_norms and (cfg.dp_replicate_size or 1) > 1:
        problems.append(
            "`fp32_norms` with hybrid sharding (`dp_replicate_size` > 1) is not supported yet: the norm groups would be "
            "sharded over all processes while the layers are sharded within groups. Use one of them."
        )
    problems += _context_parallel_problems(cfg)
    if cfg.uses_fsdp2 and cfg.deepspeed:
        problems.append("`deepspeed` and `fsdp_version: 2` are both set; choose one engine.")
    if cfg.uses_fsdp2 and cfg.load_in_8bit:
        problems.append("`load_in_8bit` with FSDP2 is not supported yet; use a bf16 base (`load_in_8bit: false`).")
    return problems


def _context_parallel_problems(cfg: HellbenderConfig) -> list[str]:
    """What `context_parallel_size` cannot be combined with: accelerate's context-parallel mesh is built for FSDP2,
    both attentions (the ring for padded rows, the split attention for packed ones) run SDPA's kernels, and it is
    checked here for supervised text training only."""
    if not cfg.splits_sequences:
        return []
    key = f"`context_parallel_size: {cfg.context_parallel_size}`"
    problems = []
    if not cfg.uses_fsdp2:
        problems.append(
            f"{key} splits sequences over FSDP2 processes (accelerate's context parallelism needs FSDP2): add "
            "`fsdp_version: 2` with an `fsdp_config:` block, or remove the key."
        )
    if cfg.attn_implementation not in (None, "sdpa"):
        problems.append(
            f"{key} needs `attn_implementation: sdpa` (PyTorch's ring attention replaces SDPA's kernels for padded "
            f"rows, hellbender's split attention calls them for packed rows), not `{cfg.attn_implementation}`."
        )
    others = [
        name
        for name, used in (
            ("`processor_type` (image+text rows)", cfg.processor_type is not None),
            ("preference and RL methods (`rl`)", cfg.rl is not None),
            ("a reward model (`reward_model`)", bool(cfg.reward_model)),
            ("distillation (`kd_trainer`)", cfg.distills),
            ("`torch_compile`", bool(cfg.torch_compile)),
            ("`gradient_checkpointing: offload`", cfg.gradient_checkpointing == "offload"),
            ("fused cross-entropy (`liger_fused_linear_cross_entropy`, `cut_cross_entropy`)", cfg.fuses_the_loss),
            ("`use_eaft`", bool(cfg.use_eaft)),
        )
        if used
    ]
    if others:
        problems.append(
            f"{key} is supported for supervised text training with the full logits only (tested there); not with "
            f"{', '.join(others)}. Remove those keys, or `context_parallel_size`."
        )
    return problems
