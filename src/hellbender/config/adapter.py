"""Config keys for LoRA / QLoRA adapters. No `adapter` means full fine-tuning."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hellbender.config.values import Float, Int, Name


class LoftQSettings(BaseModel):
    """`peft.loftq_config:` — LoftQ's initialisation of the LoRA matrices (PEFT's `LoftQConfig`)."""

    model_config = ConfigDict(extra="forbid")

    loftq_bits: Literal[4, 8] = Field(
        4, description="Bits of the quantization whose error the adapter starts out correcting: 4 (NF4) or 8 (int8)."
    )
    loftq_iter: Int = Field(
        1, gt=0, description="Alternations of quantizing and fitting the low-rank residual (PEFT's default 1)."
    )


class PeftSettings(BaseModel):
    """`peft:` — settings passed to PEFT beyond the `lora_*` keys."""

    model_config = ConfigDict(extra="forbid")

    loftq_config: LoftQSettings | None = Field(
        None,
        description="Start the adapter with LoftQ: each adapted weight W is replaced by its quantized-then-"
        "dequantized copy Q(W) and the LoRA matrices by the best rank-`lora_r` fit of W - Q(W), so base + adapter "
        "starts near W. Needs `adapter: lora` on an unquantized base, bitsandbytes and a CUDA GPU.",
    )


class AdapterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    adapter: Literal["lora", "qlora"] | None = Field(
        None, description="`lora`, `qlora` (4-bit base, CUDA + bitsandbytes), or unset for full fine-tuning."
    )
    lora_r: Int = Field(8, gt=0, description="LoRA rank.")
    lora_alpha: Int = Field(16, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: Float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    lora_target_modules: list[Name] | Name | None = Field(
        None, description="Module names (or a regex string) to adapt. Default: the attention and MLP projections."
    )
    lora_target_linear: bool = Field(
        False,
        description="Adapt every linear layer except the output head; on a mixture-of-experts model whose experts are "
        "stored as 3-D parameters (transformers 5), the expert weights too.",
    )
    lora_target_parameters: list[Name] = Field(
        default_factory=list,
        description="Parameters to adapt directly (PEFT's `target_parameters`), by full name or a suffix after a dot: "
        "the fused expert weights of a mixture-of-experts model, e.g. `mlp.experts.gate_up_proj`, "
        "`mlp.experts.down_proj`. When set, exactly these expert weights are adapted. Needs `lora_dropout: 0`.",
    )
    lora_modules_to_save: list[Name] = Field(
        default_factory=list, description="Modules trained in full and saved beside the adapter (e.g. `embed_tokens`)."
    )
    peft: PeftSettings | None = Field(
        None, description="PEFT settings beyond the `lora_*` keys: `loftq_config` (LoftQ's initialisation)."
    )
    peft_use_dora: bool = Field(False, description="Use DoRA (weight-decomposed LoRA).")
    peft_use_rslora: bool = Field(
        False, description="Rank-stabilised LoRA: scale the update by alpha / sqrt(r) instead of alpha / r."
    )
    lora_qkv_kernel: bool = Field(
        False,
        description="Compute LoRA on the attention's `q_proj`, `k_proj` and `v_proj` as one autograd function per "
        "projection: the low-rank product is written first and the base matmul accumulates into it, forward and "
        "backward (docs/benchmarks.md: 1.24x on an 8B bf16 LoRA run uncompiled; over QLoRA's 4-bit base 0.96x, no gain). "
        "Same result and adapter files as PEFT's layers. Needs LoRA on an unquantized or QLoRA's 4-bit base (not "
        "`load_in_8bit`), `lora_dropout: 0` and no DoRA.",
    )
    lora_o_kernel: bool = Field(
        False, description="The same fused LoRA computation for the attention's output projection `o_proj`."
    )
    lora_mlp_kernel: bool = Field(
        False, description="The same fused LoRA computation for the MLP's `gate_proj`, `up_proj` and `down_proj`."
    )
    unfrozen_parameters: list[Name] = Field(
        default_factory=list,
        description="Full fine-tuning: train only the parameters whose names match one of these regular expressions "
        "(matched from the start of the name, e.g. `^lm_head.weight$`, `model.layers.1[0-9].mlp`); the rest are frozen. "
        "With an adapter: only the adapted layers whose weights match get adapter matrices (base weights stay "
        "frozen; `lora_modules_to_save` trains modules in full).",
    )

    @property
    def lora_kernels(self) -> list[str]:
        """The `lora_*_kernel` keys switched on."""
        return [k for k in ("lora_qkv_kernel", "lora_o_kernel", "lora_mlp_kernel") if getattr(self, k)]

    @property
    def loftq(self) -> LoftQSettings | None:
        return self.peft.loftq_config if self.peft else None

    @field_validator("unfrozen_parameters")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"`{pattern}` is not a regular expression ({exc})") from None
        return patterns
