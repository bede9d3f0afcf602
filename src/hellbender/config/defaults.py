"""Every default the code decides is decided here, so `hellbender validate` prints exactly what runs.

Three kinds of key stay open after validation, each for a stated reason:
- a key whose absence is itself the setting (`UNSET_MEANS`: no resume, no DeepSpeed, the base model's tokenizer);
- a value that depends on the machine that runs (`bf16: auto`, `optimizer: auto`, `dataloader_num_workers: auto`):
  decided by `machine_defaults` where the run happens, since a config validated on one machine may train on another
  (Ray workers, launched processes); `validate` shows what each will be on its own machine;
- a value that depends on the prepared data or the loaded model (steps per epoch for the save interval, the
  model's decoder-layer class): computed by `hellbender.train.schedule` and the model code, listed in `UNSET_MEANS`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from hellbender.config.data import PREFERENCE_TYPES, USER_DEFINED_KEYS, VISION_PREFERENCE_TYPES
from hellbender.config.machine import Machine, this_machine
from hellbender.config.plugins import CUT_CROSS_ENTROPY_PLUGIN
from hellbender.config.precision import run_precision
from hellbender.config.preference import (
    DEFAULT_BETA,
    DEFAULT_CPO_ALPHA,
    DEFAULT_KTO_WEIGHT,
    DEFAULT_ORPO_ALPHA,
    DEFAULT_SIMPO_GAMMA,
    PREFERENCE_UNSET_MEANS,
)
from hellbender.config.quantization import QUANTIZATION_UNSET_MEANS
from hellbender.config.rl import METHOD_DEFAULTS, ONLINE_RL_METHODS, RL_UNSET_MEANS, TRL_UNSET_MEANS
from hellbender.config.schema import DatasetEntry, HellbenderConfig
from hellbender.config.tracking import swanlab_asked

ModelT = TypeVar("ModelT", bound=BaseModel)
ADAPTER_LEARNING_RATE = 2e-4
FULL_FINETUNE_LEARNING_RATE = 2e-5
# Adam's usual constants, which are also transformers' defaults; written out so the config shows them.
ADAM_DEFAULTS = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}
# What LoRA adapts when the config names nothing: the attention and MLP projections of common decoder families.
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Dataset types whose rows hold images (with `processor_type`).
VISION_TYPES = ("chat_template", "multimodal_pretrain")
AUTO = "auto"
IMAGE_LOADER_WORKERS = 4
TORCH_COMPILE_DEFAULTS = {"torch_compile_backend": "inductor", "torch_compile_mode": "default"}

# Keys left null after validation, and what null means for each (top-level and `fsdp_config:` keys; dataset entries
# below). A test keeps every null of a validated config in these lists, so a new key either gets its default decided
# in this module or says here why it stays open.
UNSET_MEANS: dict[str, str] = {
    **PREFERENCE_UNSET_MEANS,
    **RL_UNSET_MEANS,
    **TRL_UNSET_MEANS,
    **QUANTIZATION_UNSET_MEANS,
    "kd_zscore_base_temp": "no logit standardisation",
    "kd_teacher_model": "no online teacher: the rows carry the teacher's top-k (`logprobs_field`)",
    "kd_fused_loss": "with `kd_trainer`, the chunked loss when training on a GPU (unless FSDP2, ZeRO-3 or an adapter "
    "on `lm_head` rules it out), the whole logits on CPU",
    "max_prompt_len": "no limit on prompts of their own (prompt and answer together must fit `sequence_len`)",
    "tokenizer_config": "the tokenizer of `base_model`",
    "revision_of_model": "the default branch of `base_model`",
    "tf32": "transformers' choice (TF32 on when the Trainer compiles the whole model in bf16)",
    "cls_model_config": "`AutoConfig` reads the model's config",
    "tokenizer_legacy": "the tokenizer's own `legacy` setting",
    "hf_use_auth_token": "the saved Hugging Face token, when there is one",
    "peft": "LoRA's usual start (B = 0)",
    "bnb_config_kwargs": "NF4 with double quantization (QLoRA's settings)",
    "experts_implementation": "transformers' choice (`grouped_mm` where the model supports it)",
    "model_quantization_config": "the checkpoint loads as its config.json says",
    "model_quantization_config_kwargs": "no arguments for `model_quantization_config`",
    "flex_attn_compile_kwargs": "transformers compiles flex attention with torch.compile's defaults",
    "low_cpu_mem_usage": "what transformers always does (no second copy of the weights)",
    "experimental_skip_move_to_device": "placement by accelerate and transformers",
    "adapter": "full fine-tuning",
    "lora_target_modules": "with `lora_target_linear`: every linear layer; without an adapter: nothing",
    "chat_template_jinja": "no Jinja template (only `chat_template: jinja` uses one)",
    "max_steps": "`num_epochs` passes over the data",
    "warmup_ratio": "`warmup_steps` decides the warm-up",
    "warmup_steps": "`warmup_ratio` x the number of steps (from the data)",
    "cosine_min_lr_ratio": "the cosine decays to 0",
    "cosine_constant_lr_ratio": "the cosine decays until the last step",
    "early_stopping_patience": "training runs to its last step",
    "accelerator_config": "transformers' defaults, but `non_blocking` on with a GPU (dispatching off for streamed data)",
    "dispatch_batches": "accelerate's choice: off for prepared data; always off for streamed data",
    "gradient_accumulation_kwargs": "accelerate's defaults (gradients synchronized once per optimizer step)",
    "num_steps": "`gradient_accumulation_steps` decides",
    "logging_steps": "about 10 logs per run, at least every 10 steps (from the number of steps)",
    "save_steps": "once per epoch, or `saves_per_epoch` times (from the steps per epoch); streamed: every tenth",
    "saves_per_epoch": "`save_steps` decides",
    "save_total_limit": "every checkpoint is kept",
    "loss_watchdog_threshold": "the loss is not watched",
    "ddp_find_unused_parameters": "the Trainer's rule: on, except for a transformers model with activation checkpointing",
    "wandb_project": "no W&B project named (W&B's default project when `report_to` has `wandb`)",
    "wandb_entity": "W&B's default entity",
    "wandb_name": "a name W&B picks",
    "wandb_run_id": "a new W&B run",
    "wandb_mode": "W&B's own setting (online unless its environment says otherwise)",
    "wandb_log_model": "no model uploaded to W&B",
    "wandb_watch": "W&B's default (no histograms unless its environment says otherwise)",
    "swanlab_project": "no SwanLab project (SwanLab reporting needs one)",
    "swanlab_experiment_name": "`wandb_name`, else a name SwanLab picks",
    "swanlab_description": "no description",
    "swanlab_workspace": "your own SwanLab workspace",
    "swanlab_mode": "SwanLab's own setting (cloud unless its environment says otherwise)",
    "hub_model_id": "nothing is pushed to the Hugging Face Hub",
    "hub_strategy": "nothing is pushed (`every_save`, transformers' default, once `hub_model_id` is set)",
    "hub_revision": "the repository's default branch",
    "eval_steps": "once per epoch, or `evals_per_epoch` times (from the steps per epoch); streamed: every tenth",
    "evals_per_epoch": "`eval_steps` decides",
    "resume_from_checkpoint": "start from the base model",
    "gradient_checkpointing_layers": "every decoder layer is checkpointed",
    "gpu_memory_limit": "no memory limit is planned for: `train` starts without checking the predicted peak",
    "gradient_checkpointing_kwargs": "hellbender's own checkpointing, always non-reentrant",
    "tiled_mlp_num_shards": "about one shard per `hidden_size` tokens (from the model)",
    "fused_cross_entropy_chunk_scale": "Liger's own chunks (a chunk's logits up to the hidden states' size)",
    "torch_compile_backend": "not compiled (`torch_compile` is off)",
    "torch_compile_mode": "not compiled (`torch_compile` is off)",
    "activation_memory_budget": "the compiler keeps what it judges fastest (a budget of 1.0)",
    "image_size": "images keep their size",
    "processor_type": "a text model",
    "fsdp_version": "no FSDP",
    "fsdp_config": "no FSDP",
    "fsdp": "no FSDP",
    "fsdp_final_state_dict_type": "the final model is saved whole",
    "dp_shard_size": "FSDP2 shards over all processes (or those `dp_replicate_size` leaves)",
    "dp_replicate_size": "one copy of the model (or the groups `dp_shard_size` leaves)",
    "context_parallel_size": "each process holds whole rows (no context parallelism)",
    "deepspeed": "no DeepSpeed",
    # fsdp_config
    "transformer_layer_cls_to_wrap": "the model's own `_no_split_modules`",
    "sync_module_states": "every process starts from the same weights (FSDP2 always does)",
    "use_orig_params": "FSDP2 trains the original parameters",
}


# A reward model is a sequence-classification model with one label (its score).
REWARD_MODEL_TYPE = "AutoModelForSequenceClassification"


def default_model_type(cfg: HellbenderConfig) -> str:
    if cfg.reward_model:
        return REWARD_MODEL_TYPE
    return "AutoModelForImageTextToText" if cfg.is_multimodal else "AutoModelForCausalLM"


def preference_method_defaults(cfg: HellbenderConfig) -> dict[str, Any]:
    """The settings of the config's preference method that TRL would otherwise default (Axolotl's values)."""
    return {
        "dpo": {"rl_beta": DEFAULT_BETA},
        "ipo": {"rl_beta": DEFAULT_BETA},
        "kto": {
            "rl_beta": DEFAULT_BETA,
            "kto_desirable_weight": DEFAULT_KTO_WEIGHT,
            "kto_undesirable_weight": DEFAULT_KTO_WEIGHT,
        },
        "orpo": {"orpo_alpha": DEFAULT_ORPO_ALPHA},
        "simpo": {"rl_beta": DEFAULT_BETA, "simpo_gamma": DEFAULT_SIMPO_GAMMA, "cpo_alpha": DEFAULT_CPO_ALPHA},
    }.get(cfg.rl or "", {})


def apply_derived_defaults(cfg: HellbenderConfig) -> HellbenderConfig:
    updates: dict[str, Any] = {}

    def default(key: str, value: Any) -> None:
        if getattr(cfg, key) is None:
            updates[key] = value

    default("learning_rate", ADAPTER_LEARNING_RATE if cfg.adapter else FULL_FINETUNE_LEARNING_RATE)
    default("model_type", default_model_type(cfg))
    default("attn_implementation", "flash_attention_2" if cfg.flash_attention else "sdpa")
    default("dataset_prepared_path", str(Path(cfg.output_dir).parent / "last_run_prepared"))
    default("streaming", bool(cfg.pretraining_dataset))
    default("eval_batch_size", cfg.micro_batch_size)
    default("chat_template", "tokenizer_default")
    for key, value in preference_method_defaults(cfg).items():
        default(key, value)
    if cfg.reward_model:
        default("num_labels", 1)
    if cfg.rl in ONLINE_RL_METHODS and cfg.trl is not None:  # the `trl:` keys whose TRL default is the method's
        trl = {k: v for k, v in METHOD_DEFAULTS[cfg.rl].items() if getattr(cfg.trl, k) is None}
        if trl:
            updates["trl"] = _updated(cfg.trl, trl)
    for key, value in ADAM_DEFAULTS.items():
        default(key, value)
    if cfg.warmup_ratio is None:
        default("warmup_steps", 0)
    if cfg.adapter == "qlora":
        updates["load_in_4bit"] = True
    if cfg.adapter and not cfg.lora_target_linear:
        default("lora_target_modules", list(DEFAULT_LORA_TARGETS))
    if cfg.hub_model_id:
        default("hub_strategy", "every_save")  # transformers' default, which Axolotl leaves in place
    swanlab = swanlab_asked(cfg.use_swanlab, cfg.swanlab_project, cfg.plugins)
    updates["use_swanlab"] = swanlab
    wanted = [("tensorboard", cfg.use_tensorboard), ("wandb", bool(cfg.wandb_project)), ("swanlab", swanlab)]
    if added := [target for target, asked in wanted if asked and target not in cfg.report_targets]:
        updates["report_to"] = [*cfg.report_targets, *added]
    if cfg.kd_trainer is None:
        updates["kd_trainer"] = cfg.distills
    if cfg.cut_cross_entropy is None:
        updates["cut_cross_entropy"] = CUT_CROSS_ENTROPY_PLUGIN in cfg.plugins
    if updates.get("cut_cross_entropy", cfg.cut_cross_entropy):
        updates["liger_fused_linear_cross_entropy"] = True  # the same fused LM head and loss
    if cfg.torch_compile:
        for key, value in TORCH_COMPILE_DEFAULTS.items():
            default(key, value)
    # Streamed raw text is always packed into full bins; streamed image+text rows are not packed.
    streams_text = cfg.streams_pretraining and not cfg.is_multimodal
    default("sample_packing", streams_text)
    default("eval_sample_packing", updates.get("sample_packing", cfg.sample_packing))
    # Curriculum order survives only unshuffled rows packed in order.
    default("shuffle_merged_datasets", not cfg.curriculum_sampling)
    default(
        "sample_packing_sequentially",
        cfg.curriculum_sampling and bool(updates.get("sample_packing", cfg.sample_packing)),
    )
    cfg = _updated(cfg, updates)
    entries: dict[str, Any] = {
        key: [entry_with_defaults(e, cfg) for e in getattr(cfg, key)] for key in ("datasets", "test_datasets")
    }
    if cfg.is_multimodal:
        entries["pretraining_dataset"] = [
            _updated(e, {"image_base_dir": e.image_base_dir or str(default_image_base_dir(e.path))})
            if e.type == "multimodal_pretrain"
            else e
            for e in cfg.pretraining_dataset
        ]
    return _updated(cfg, entries)


def _updated(model: ModelT, updates: dict[str, Any]) -> ModelT:
    """`model` with `updates`, still telling which keys the user wrote (`model_fields_set`): checks that ask
    whether a key was chosen (a DeepSpeed block replacing a chosen schedule) must not count a default as chosen."""
    copied = model.model_copy(update=updates)
    object.__setattr__(copied, "__pydantic_fields_set__", set(model.model_fields_set))
    return copied


# Preference types rendered with a chat template (the dataset's `chat_template`, else the top-level one).
PREFERENCE_TEMPLATE_TYPES = (
    "chat_template.default",
    "chat_template.argilla_chat",
    "chat_template.argilla",
    "bradley_terry.chat_template",
)
_PREFERENCE_DEFAULTS: dict[str, Any] = {
    "field_messages": "messages",
    "message_property_mappings": {"role": "role", "content": "content"},
}
_CHOSEN_REJECTED = ("field_chosen", "field_rejected")
_MAPPINGS = ("message_property_mappings",)


def preference_keys_read(kind: str, kto: bool) -> tuple[str, ...]:
    """The entry keys of a preference type that validation fills (`kto`: the run is `rl: kto`)."""
    if kind == "user_defined.default":
        answers = ("field_completion", "field_label", "completion_format") if kto else (
            "field_chosen", "field_rejected", "chosen_format", "rejected_format")  # fmt: skip
        return ("field_prompt", "field_system", "prompt_format", *answers)
    return {
        "chat_template.default": ("field_messages", *_CHOSEN_REJECTED, *_MAPPINGS),
        "chat_template.argilla_chat": (*_CHOSEN_REJECTED, *_MAPPINGS),
        "chat_template.argilla": (*_CHOSEN_REJECTED, *_MAPPINGS),
        "bradley_terry.chat_template": _CHOSEN_REJECTED,
    }.get(kind, ())


ENTRY_UNSET_MEANS: dict[str, str] = {
    "ds_type": "guessed from the file extension",
    "logprobs_field": "the rows carry no teacher log-probabilities",
    "temperature": "with `logprobs_field`: 1, the log-probabilities were taken at temperature 1",
    "data_files": "every file of the path",
    "name": "the dataset's default configuration",
    "revision": "the default branch of the dataset",
    "field": "`text_column` names the text column",
    "field_messages": "each row's `messages` column, or else its `conversations` column",
    "chat_template_jinja": "no Jinja template (only `chat_template: jinja` uses one)",
    "roles": "the built-in role names (`human`/`user`, `gpt`/`assistant`, `system`, `tool`)",
    "image_token": "the processor's image token",
    "image_base_dir": "not a vision-language dataset",
    # keys used by one dataset type only; null for the others
    "message_property_mappings": "not a `chat_template` dataset",
    "roles_to_train": "not a `chat_template` dataset",
    "train_on_eos": "not a `chat_template` dataset",
    "field_thinking": "not a `chat_template` dataset",
    "template_thinking_key": "not a `chat_template` dataset",
    "field_tools": "not a `chat_template` dataset",
    "chat_template": "not a `chat_template` dataset",
    "train_on_inputs": "not a dataset with prompts (`chat_template`, `alpaca`)",
    "text_column": "not a raw-text dataset (`completion`, `multimodal_pretrain`)",
    "field_chosen": "not a preference dataset that names its answer columns",
    "field_rejected": "not a preference dataset that names its answer columns",
    **dict.fromkeys(
        ("field_prompt", "field_system", "prompt_format", "chosen_format", "rejected_format"),
        "not a `user_defined.default` dataset",
    ),
    **dict.fromkeys(
        ("field_completion", "field_label", "completion_format"), "not a `user_defined.default` dataset of `rl: kto`"
    ),
}

# The entry keys each dataset type reads, which validation fills when they are unset (a test holds this to it).
KEYS_FILLED_FOR_TYPE: dict[str, tuple[str, ...]] = {
    "chat_template": (
        "train_on_inputs",
        "message_property_mappings",
        "roles_to_train",
        "train_on_eos",
        "chat_template",
        "field_thinking",
        "template_thinking_key",
        "field_tools",
    ),
    "alpaca": ("train_on_inputs",),
    "completion": ("text_column",),
    "multimodal_pretrain": ("text_column",),
    "pretokenized": (),
    **{kind: preference_keys_read(kind, kto=False) for kind in PREFERENCE_TYPES},
}
for _kind in PREFERENCE_TEMPLATE_TYPES:  # the top-level `chat_template` always has a value
    KEYS_FILLED_FOR_TYPE[_kind] += ("chat_template",)


def entry_with_defaults(entry: DatasetEntry, cfg: HellbenderConfig) -> DatasetEntry:
    """The dataset entry with the defaults of its type filled in from the top-level keys."""
    updates: dict[str, Any] = {}
    kind = entry.type or "pretokenized"
    updates["type"] = kind
    if kind in ("chat_template", "alpaca") and entry.train_on_inputs is None:
        updates["train_on_inputs"] = cfg.train_on_inputs
    if kind == "chat_template":
        mappings = {"role": "role", "content": "content", **(entry.message_property_mappings or {})}
        updates["message_property_mappings"] = mappings
        updates["roles_to_train"] = entry.roles_to_train or ["assistant"]
        updates["train_on_eos"] = entry.train_on_eos or "turn"
        # Axolotl's default: a message's `reasoning_content` reaches the template under that name.
        updates["field_thinking"] = entry.field_thinking or "reasoning_content"
        updates["template_thinking_key"] = entry.template_thinking_key or "reasoning_content"
        updates["field_tools"] = entry.field_tools or "tools"  # Axolotl's default column
        updates["chat_template"] = entry.chat_template or cfg.chat_template
        if updates["chat_template"] == "jinja" and entry.chat_template_jinja is None:
            updates["chat_template_jinja"] = cfg.chat_template_jinja
    updates.update(
        {
            key: getattr(entry, key) or USER_DEFINED_KEYS.get(key) or _PREFERENCE_DEFAULTS[key]
            for key in preference_keys_read(kind, getattr(cfg, "rl", None) == "kto")
        }
    )
    if kind in PREFERENCE_TEMPLATE_TYPES:
        updates["chat_template"] = entry.chat_template or cfg.chat_template
        if updates["chat_template"] == "jinja" and entry.chat_template_jinja is None:
            updates["chat_template_jinja"] = cfg.chat_template_jinja
    if kind in ("completion", "multimodal_pretrain"):
        updates["text_column"] = entry.field or entry.text_column or "text"
        updates["field"] = None  # one key for the text column from here on
    if cfg.is_multimodal and (kind in VISION_TYPES or kind in VISION_PREFERENCE_TYPES):
        updates["image_base_dir"] = entry.image_base_dir or str(default_image_base_dir(entry.path))
    return _updated(entry, updates)


def default_image_base_dir(dataset_path: str) -> Path:
    """Image paths start from the dataset file's directory (the directory itself for a directory source, the
    current directory for a hub dataset)."""
    path = Path(dataset_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    return Path(".")


def machine_defaults(cfg: HellbenderConfig, machine: Machine | None = None) -> dict[str, Any]:
    """The values of the machine-dependent keys on `machine` (default: this one)."""
    machine = machine or this_machine()
    # transformers' default, fused AdamW, on a GPU where it is faster; plain AdamW on CPU, where the fused kernel made
    # this project's CPU test suite several times slower.
    optimizer = cfg.optimizer if cfg.optimizer != AUTO else ("adamw_torch_fused" if machine.cuda else "adamw_torch")
    return {
        "bf16": run_precision(cfg, machine),
        "optimizer": optimizer,
        "dataloader_num_workers": dataloader_workers(cfg, machine),
    }


def dataloader_workers(cfg: HellbenderConfig, machine: Machine | None = None) -> int:
    """`dataloader_num_workers`, with `auto` decided: background processes for prepared image+text rows on a GPU,
    where opening and processing images in the training process left the GPU waiting 22% of each step. Streamed
    rows stay in the training process (each worker would read the whole stream), as do text rows (nothing to gain)."""
    if cfg.dataloader_num_workers != AUTO:
        return cfg.dataloader_num_workers
    machine = machine or this_machine()
    if cfg.is_multimodal and not cfg.uses_streaming and machine.cuda:
        return min(IMAGE_LOADER_WORKERS, machine.cpus)
    return 0
