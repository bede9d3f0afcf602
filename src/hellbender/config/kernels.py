"""Config keys for fused kernels (Liger) and compilation: speed and memory, never a change in what is computed."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hellbender.config.values import Float, Int, Name

# The `torch.compile` backends that split a compiled graph into forward and backward with torch's min-cut
# partitioner, the part that honours `activation_memory_budget` (`aot_eager_decomp_partition` runs it without
# generating kernels: tests on CPU).
PARTITIONING_BACKENDS = ("inductor", "aot_eager_decomp_partition")


class KernelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    liger_rope: bool = Field(False, description="Liger's fused rotary embedding (needs `liger-kernel` and CUDA).")
    liger_rms_norm: bool = Field(False, description="Liger's fused RMSNorm.")
    liger_rms_norm_gated: bool = Field(
        False,
        description="hellbender's fused RMSNorm + SiLU gate (a Triton kernel; needs CUDA) for the gated norms of "
        "Qwen3.5's linear-attention layers and Nemotron-H's Mamba2 mixers; refused for a model without them.",
    )
    liger_glu_activation: bool = Field(False, description="Liger's fused SwiGLU / GeGLU MLP activation.")
    liger_layer_norm: bool = Field(False, description="Liger's fused LayerNorm (families that have one).")
    liger_fused_linear_cross_entropy: bool = Field(
        False,
        description="Liger's fused LM head + cross-entropy: the [tokens x vocab] logits are never materialised.",
    )
    fused_cross_entropy_chunk_scale: Int | None = Field(
        None,
        ge=1,
        description="With `liger_fused_linear_cross_entropy`: Liger's `chunk_mem_const`, how many times the hidden "
        "states' size of logits one chunk of the fused loss may hold (Liger's default 1). Each chunk reads the whole "
        "output head and, where the head trains, reads and writes its whole gradient, so fewer, larger chunks "
        "move less memory for more transient logits (`hellbender plan` counts both). For Llama and Gemma 4 models "
        "(whose Liger forward is checked to pass it on). On an H200: 8 on the 1B full fine-tuning recipe 1.05x, 2 on "
        "the 8B LoRA recipe 1.02x, the peak unchanged (docs/benchmarks.md).",
    )
    cut_cross_entropy: bool | None = Field(
        None,
        description="Axolotl's fused LM head + loss (its CutCrossEntropyPlugin): the same computation as "
        "`liger_fused_linear_cross_entropy`, which it turns on. Default: on when the plugin is listed in `plugins`.",
    )
    tiled_mlp: bool = Field(
        False,
        description="Run each decoder layer's MLP over the sequence in shards, forward and backward, so its wide "
        "activations exist for one shard at a time: for very long sequences on one GPU (not with several processes).",
    )
    tiled_mlp_num_shards: Int | None = Field(
        None, gt=0, description="Shards per MLP call with `tiled_mlp`; default about one per `hidden_size` tokens."
    )
    torch_compile: bool = Field(
        False,
        description="Compile the model with `torch.compile` (the first steps are slower while it compiles; needs "
        "a GPU to pay off). With activation checkpointing each decoder layer is compiled, its checkpoint included "
        "(regional compilation); without it the Trainer compiles the whole model.",
    )
    torch_compile_backend: Name | None = Field(None, description="`torch.compile` backend; default `inductor`.")
    activation_memory_budget: Float | None = Field(
        None,
        gt=0,
        le=1,
        description="With `torch_compile`: how much of what the compiled layers would keep for backward they may keep "
        "(torch's partitioner setting; 1.0 is the compiler's default). Below 1 the compiler recomputes in backward "
        "what is cheapest to recompute per byte, elementwise work first, matmuls last. On the 8B LoRA benchmark "
        "(H200) 0.8 keeps 0.33 of a layer's 0.54 GiB for 3% more layer time, where checkpointing the layer costs "
        "37%; what that buys a whole run varied between runs (docs/benchmarks.md).",
    )
    torch_compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = (
        Field(
            None,
            description="`torch.compile` mode; default `default`. `max-autotune-no-cudagraphs` times Triton's matmul "
            "templates against cuBLAS for each shape (the 8B LoRA recipe: 1.5% faster on an H200, after about "
            "three minutes of autotuning on a machine's first run). The CUDA-graph modes (`reduce-overhead`, "
            "`max-autotune`) are refused with host offloading (`gradient_checkpointing: offload`, "
            "`activation_offload_layers`): graph replays reuse memory the offloader still copies.",
        )
    )
