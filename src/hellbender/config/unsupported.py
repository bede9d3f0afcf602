"""Axolotl keys hellbender does not implement, sorted by why: a feature that is planned (the refusal says which), a
feature hellbender deliberately does not offer (the refusal says why and what to use instead), or a key that only
steers Axolotl's own tooling (accepted: it changes nothing about the run)."""

from __future__ import annotations

PLANNED: dict[str, tuple[str, ...]] = {
    "more preference tuning (process reward models, padding-free DPO, generation during DPO evaluation, SwanLab "
    "completion tables)": (
        "dpo_padding_free", "dpo_use_logits_to_keep", "dpo_generate_during_eval",
        "process_reward_model",
        "step_separator", "train_on_last_step_only",
        # SwanLab's table of preference-training completions
        "swanlab_log_completions", "swanlab_completion_log_interval", "swanlab_completion_max_buffer",
    ),
    "more online reinforcement learning (EBFT and generation with vLLM)": ("vllm", "ebft"),
    "mixture-of-experts training (quantized experts, expert kernels and parallelism)": (
        "quantize_moe_experts", "use_kernels", "llama4_linearized_experts",
        "use_scattermoe", "use_sonicmoe", "expert_parallel_size", "expert_parallel_backend",
        "expert_parallel_num_nvl_bytes", "expert_parallel_num_rdma_bytes", "expert_parallel_token_capacity",
        "expert_parallel_fallback_on_unsupported", "expert_backend", "nonexpert_quantization", "moe_grouped_backend",
        "moe_dequant_chunk_size", "moe_bnb_fast", "use_dsv4_kernels", "use_glm_dsa_kernels",
        "dsv4_fp8_nonexpert_mode", "dsv4_fp8_lora_kernel", "dsv4_shared_mlp_lora_kernel", "dsv4_bf16_all",
        "dsv4_fp4_grouped_mode", "gemma4_fp8_nonexpert", "gemma4_nf4_nonexpert", "nvfp4_merge_aware",
        "nvfp4_merge_aware_start_step",
    ),
    "the speed work (a fused LoRA embedding and fused attention kernels)": (
        "lora_embedding_kernel", "fused_attn_kernel",
    ),
    "ring-flash-attn's context parallelism (hellbender's `context_parallel_size` runs PyTorch's ring attention over "
    "SDPA, which takes no such setting)": ("heads_k_stride", "ring_attn_func"),
}  # fmt: skip

CLOUD_LAUNCHER = (
    "read by Axolotl's cloud launcher (`axolotl cloud`), whose files describe machines, not a training run; "
    "hellbender trains where it is started: run `hellbender train CONFIG` on the machine with the training config"
)
_KD_SERVER = (
    "a distillation teacher behind a vLLM / SGLang server is not offered; name the teacher with `kd_teacher_model` "
    "(it runs in the training process), or write its top-k log-probabilities into the data first with `hellbender "
    "distill-logprobs`"
)
_ATTENTION_PATCHES = (
    "Axolotl's own patches of attention and MLP code; hellbender uses transformers' attention backends "
    "(`attn_implementation`) and Liger's kernels (`liger_*`) instead"
)
NOT_OFFERED: dict[str, str] = {
    "kd_online_server_base_url": _KD_SERVER,
    "kd_online_server": _KD_SERVER,
    "kd_online_timeout": _KD_SERVER,
    "kd_temperature_min": "a schedule of the distillation temperature is not offered; set one `kd_temperature`",
    "relora": "ReLoRA (merging the adapter into the base and restarting it during training) is not offered; train "
    "one adapter, or full fine-tuning",
    "lisa_n_layers": "LISA (training a random subset of layers at a time) is not offered; use `unfrozen_parameters` "
    "to train a fixed subset",
    "gptq": "GPTQ-quantized base models are not offered; use `load_in_4bit` (QLoRA) or `load_in_8bit`",
    "tensor_parallel_size": "tensor parallelism is not offered; shard the model with FSDP2 (`fsdp_version: 2`) or "
    "DeepSpeed ZeRO-3",
    "fp8": "FP8 training is not offered; train in bf16",
    "use_pose": "PoSE (skipping positions to imitate long context) is not offered",
    "s2_attention": "shifted-sparse attention is not offered (Axolotl no longer offers it either)",
    "flash_attn_cross_entropy": _ATTENTION_PATCHES,
    "xformers_attention": _ATTENTION_PATCHES,
    "sage_attention": _ATTENTION_PATCHES,
    "flash_optimum": _ATTENTION_PATCHES,
    "diffusion": "diffusion language-model training is not offered",
    # Axolotl's key asks for Liger's fused DPO loss and passes it to TRL's `use_liger_kernel`.
    "dpo_use_liger_kernel": "Liger's fused DPO loss is not offered: TRL 1.16, whose DPOTrainer trains DPO here, has no "
    "Liger loss to switch on (its `use_liger_kernel` now only patches the model's layers with Liger's CUDA kernels, "
    "which the `liger_*` keys do, e.g. `liger_rms_norm`, `liger_glu_activation`), and its DPO and KTO trainers "
    "already compute the answers' log-probabilities in chunks through their own fused LM head, without building the "
    "full logits: the memory Liger's fused loss saved",
    "llmcompressor": "sparse fine-tuning with LLM Compressor is not offered",
    "use_onebitllms": "1-bit (BitNet-style) models are not offered",
    **dict.fromkeys(
        (
            "provider",
            "gpu",
            "gpu_count",
            "node_count",
            "secrets",
            "volumes",
            "memory",
            "memory_preprocess",
            "timeout",
            "timeout_preprocess",
            "branch",
            "dockerfile_commands",
        ),
        CLOUD_LAUNCHER,
    ),
}
# Keys that only steer Axolotl's own tooling (its Gradio UI, telemetry, config bookkeeping): accepted, changing nothing.
AXOLOTL_TOOLING: dict[str, str] = {
    **dict.fromkeys(
        ("gradio_max_new_tokens", "gradio_server_name", "gradio_server_port", "gradio_share", "gradio_temperature",
         "gradio_title"),
        "Axolotl's Gradio chat UI",
    ),
    **dict.fromkeys(("use_otel_metrics", "otel_metrics_host", "otel_metrics_port"), "Axolotl's OpenTelemetry metrics"),
    **dict.fromkeys(
        ("is_llama_derived_model", "is_mistral_derived_model", "is_qwen_derived_model", "is_falcon_derived_model"),
        "Axolotl's model-family hints (hellbender reads the family from the model's config)",
    ),
    "strict": "how strictly Axolotl reads its config (hellbender always refuses what it cannot honour)",
    "tokenizer_save_jinja_files": "how Axolotl writes the chat template beside the tokenizer",
}  # fmt: skip

# Keys found in Axolotl configs that Axolotl itself does not define (it ignores them silently) -> what to use instead.
NOT_AXOLOTL_KEYS: dict[str, str] = {
    "eta_min": "PyTorch's name for the floor of its cosine schedule; Axolotl ignores it, so the cosine still decays "
    "to 0. To set a floor on the cosine schedule, use `cosine_min_lr_ratio` (a fraction of `learning_rate`)",
}
# Keys whose one accepted value describes what hellbender always does -> (that value, why no other is possible).
DESCRIBES_HELLBENDER: dict[str, tuple[object, str]] = {
    "save_safetensors": (True, "transformers 5 always writes safetensors"),
}
# Keys that tune a feature above, by their prefix: refused with that feature's reason.
_TUNES = {
    "relora_": "relora",
    "jagged_restart_": "relora",
    "lisa_": "lisa_n_layers",
    "pose_": "use_pose",
    "fp8_": "fp8",
    "gptq_": "gptq",
}
_PLANNED_BY_KEY = {key: feature for feature, keys in PLANNED.items() for key in keys}


def planned_feature(key: str) -> str | None:
    """The planned feature a key belongs to, or None."""
    return _PLANNED_BY_KEY.get(key)


def not_offered_reason(key: str) -> str | None:
    """Why hellbender deliberately does not offer the feature `key` asks for (or tunes), or None."""
    feature = next((name for prefix, name in _TUNES.items() if key.startswith(prefix)), key)
    return NOT_OFFERED.get(feature)


def not_offered_refusal(keys: list[str], reason: str, where: str = "") -> str:
    """One paragraph for the keys refused for the same reason (a cloud launcher file's machine keys, LISA's keys)."""
    named = ", ".join(f"`{key}`" for key in keys)
    them = "it" if len(keys) == 1 else "them"
    return f"{where}{named}: {reason}. Remove {them} (or set {them} to false / null)."


def refusal(key: str, where: str = "") -> str:
    """Why `key` is refused, in one paragraph."""
    if feature := planned_feature(key):
        return (
            f"{where}`{key}` is not supported yet: it belongs to {feature}, which hellbender does not offer yet. "
            "Remove it (or set it to false / null) to run the rest of the config."
        )
    if reason := not_offered_reason(key):
        return not_offered_refusal([key], reason, where)
    return (
        f"{where}`{key}` is not supported yet: hellbender does not implement it, and ignoring it would silently "
        "change your run. Remove it, or set it to false / null if you do not need it."
    )
