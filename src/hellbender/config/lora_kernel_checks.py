"""Where the fused LoRA computation (`lora_qkv_kernel`, `lora_o_kernel`, `lora_mlp_kernel`; models/fused_lora.py)
cannot run. It computes plain LoRA over an unquantized or 4-bit linear layer, so a key asking for it anywhere else would
change nothing, and is refused instead."""

from __future__ import annotations

from hellbender.config.schema import HellbenderConfig


def lora_kernel_problems(cfg: HellbenderConfig) -> list[str]:
    keys = cfg.lora_kernels
    if not keys or cfg.adapter is None:  # without an adapter, refused with the other `lora_*` keys
        return []
    asked = ", ".join(f"`{k}: true`" for k in keys)
    turn_off = f"or set {' and '.join(f'`{k}: false`' for k in keys)}"
    problems = []
    if cfg.load_in_8bit:
        problems.append(
            f"{asked} with `load_in_8bit: true`: the fused LoRA computation is built for an unquantized or a 4-bit "
            f"(QLoRA) base, not an 8-bit one. Remove `load_in_8bit`, {turn_off}."
        )
    if cfg.lora_dropout:
        problems.append(
            f"{asked} with `lora_dropout: {cfg.lora_dropout:g}`: the fused LoRA computation has no dropout on the "
            f"adapter's input. Set `lora_dropout: 0`, {turn_off}."
        )
    if cfg.peft_use_dora:
        problems.append(
            f"{asked} with `peft_use_dora: true`: the fused computation is plain LoRA, not DoRA. Remove "
            f"`peft_use_dora`, {turn_off}."
        )
    if cfg.qat is not None:
        problems.append(
            f"{asked} with `qat:`: LoRA under quantization-aware training computes with the fake-quantized merged "
            f"weight, not through the fused computation. Remove `qat:`, {turn_off}."
        )
    sharded = cfg.fsdp_version is not None or cfg.fsdp_config is not None
    if cfg.deepspeed or (sharded and not cfg.uses_fsdp2) or (cfg.uses_fsdp2 and cfg.quantized_bits):
        engine = "DeepSpeed" if cfg.deepspeed else "FSDP2 over a 4-bit base" if cfg.uses_fsdp2 else "FSDP1"
        problems.append(
            f"{asked} with {engine} is not supported yet: the fused computation reads each base weight inside the "
            f"LoRA layer, which has not been verified with the parameter gathering {engine} adds (DeepSpeed ZeRO-3 "
            f"gathers a module's weights only when that module itself is called). Train on one GPU, with plain data "
            f"parallelism or with FSDP2 (`fsdp_version: 2`) over an unquantized base, {turn_off}."
        )
    return problems
