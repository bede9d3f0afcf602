"""Axolotl keys hellbender does not implement, sorted by why: a feature that is planned (the refusal says which), a
feature hellbender deliberately does not offer (the refusal says why and what to use instead), or a key that only
steers Axolotl's own tooling (accepted: it changes nothing about the run)."""

from __future__ import annotations

PLANNED: dict[str, tuple[str, ...]] = {
    "preference tuning (DPO, IPO, KTO, ORPO, SimPO) and reward models": (
        "rl", "rl_beta", "dpo_beta", "dpo_loss_type", "dpo_label_smoothing", "dpo_use_weighting", "dpo_norm_loss",
        "dpo_padding_free", "dpo_use_liger_kernel", "dpo_use_logits_to_keep", "dpo_generate_during_eval",
        "dpo_loss_weights", "rpo_alpha", "kto_desirable_weight", "kto_undesirable_weight", "orpo_alpha",
        "simpo_gamma", "cpo_alpha", "reward_model", "process_reward_model", "num_labels",
        "center_rewards_coefficient", "precompute_ref_log_probs", "max_prompt_len", "field_chosen", "field_rejected",
        # SwanLab's table of preference-training completions
        "swanlab_log_completions", "swanlab_completion_log_interval", "swanlab_completion_max_buffer",
    ),
    "online reinforcement learning (GRPO and other methods that generate during training)": ("trl", "vllm", "ebft"),
    "mixture-of-experts training (adapters on experts, quantized experts, expert kernels and parallelism)": (
        "quantize_moe_experts", "lora_target_parameters", "use_kernels", "llama4_linearized_experts",
        "use_scattermoe", "use_sonicmoe", "expert_parallel_size",
    ),
    "the speed work (fused LoRA and attention kernels)": (
        "lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel", "fused_attn_kernel",
    ),
    "context parallelism": ("context_parallel_size", "heads_k_stride", "ring_attn_func", "sequence_parallel_degree"),
    "quantization-aware training": ("qat",),
    "the memory planner": ("gpu_memory_limit",),
}  # fmt: skip

_ATTENTION_PATCHES = (
    "Axolotl's own patches of attention and MLP code; hellbender uses transformers' attention backends "
    "(`attn_implementation`) and Liger's kernels (`liger_*`) instead"
)
NOT_OFFERED: dict[str, str] = {
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
    "flash_attn_fuse_mlp": _ATTENTION_PATCHES,
    "flash_attn_rms_norm": _ATTENTION_PATCHES,
    "flash_attn_cross_entropy": _ATTENTION_PATCHES,
    "xformers_attention": _ATTENTION_PATCHES,
    "sage_attention": _ATTENTION_PATCHES,
    "flash_optimum": _ATTENTION_PATCHES,
    "diffusion": "diffusion language-model training is not offered",
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
        "this is a setting of Axolotl's cloud launcher (`axolotl cloud`), whose files describe machines, not a "
        "training run; hellbender trains where it is started",
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
}
_PLANNED_BY_KEY = {key: feature for feature, keys in PLANNED.items() for key in keys}


def planned_feature(key: str) -> str | None:
    """The planned feature a key belongs to, or None."""
    return _PLANNED_BY_KEY.get(key)


def not_offered_reason(key: str) -> str | None:
    """Why hellbender deliberately does not offer the feature `key` asks for (or tunes), or None."""
    feature = next((name for prefix, name in _TUNES.items() if key.startswith(prefix)), key)
    return NOT_OFFERED.get(feature)


def refusal(key: str, where: str = "") -> str:
    """Why `key` is refused, in one paragraph."""
    if feature := planned_feature(key):
        return (
            f"{where}`{key}` is not supported yet: it belongs to {feature}, which hellbender does not offer yet. "
            "Remove it (or set it to false / null) to run the rest of the config."
        )
    if reason := not_offered_reason(key):
        return f"{where}`{key}`: {reason}. Remove it (or set it to false / null)."
    return (
        f"{where}`{key}` is not supported yet: hellbender does not implement it, and ignoring it would silently "
        "change your run. Remove it, or set it to false / null if you do not need it."
    )
