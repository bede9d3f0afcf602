"""The knobs of a run that move its memory and speed, read from the config once, so that the planner can try other
values (a smaller micro-batch, more checkpointed layers) without touching the config."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hellbender.config import HellbenderConfig
from hellbender.plan.method import SUPERVISED, MethodShape, method_shape

if TYPE_CHECKING:
    from hellbender.plan.model_facts import ModelFacts


@dataclass(frozen=True)
class PlanSettings:
    micro_batch_size: int
    sequence_len: int
    checkpointing: bool
    offload: bool  # checkpointed layers' inputs wait in pinned host memory (`gradient_checkpointing: offload`)
    checkpointed_layers: int | None  # None: all decoder layers
    fused_loss: bool  # Liger's fused linear cross-entropy: no full logits
    liger_rms_norm: bool
    liger_glu: bool
    eager_attention: bool  # attention scores are materialised (s^2 per head)
    optimizer: str
    quantized_bits: int | None
    gpus: int
    sharding: str  # "none" (one GPU or DDP), "fsdp2", "zero1", "zero2", "zero3"
    offload_optimizer: bool = False  # DeepSpeed / FSDP2 keep optimizer states (and ZeRO-3 / FSDP2 the params) on host
    method: MethodShape = SUPERVISED  # what one micro-batch runs (rows, reference forwards, the head)
    liger_rope: bool = False
    clips_gradients: bool = True  # `max_grad_norm` > 0: a norm over every gradient before the optimizer step
    context_parallel: int = 1  # `context_parallel_size`: each GPU holds 1/N of every row's tokens
    tiled_mlp: bool = False  # `tiled_mlp`: each MLP saves only its input and runs in shards along the sequence
    tiled_mlp_shards: int | None = None  # `tiled_mlp_num_shards` (None: about one per `hidden_size` tokens)
    attention: str = "sdpa"  # `attn_implementation`
    packed: bool = False  # `sample_packing`: several documents share a row
    offloaded_layers: int = 0  # `activation_offload_layers`: checkpointed layers run once, all they save on the host
    shard_group: int = 0  # GPUs the sharded state is split over: one replica's under hybrid sharding (0: `gpus`)
    live_parameters: int = 0  # ZeRO-3: `stage3_max_live_parameters`, the gathered weights it may keep resident
    loss_chunk_scale: int = 1  # `fused_cross_entropy_chunk_scale`: Liger's `chunk_mem_const`

    @property
    def rows(self) -> int:
        """Rows through the policy with gradients per micro-batch."""
        return self.method.rows(self.micro_batch_size)

    @property
    def row_len(self) -> int:
        return self.method.row_len(self.sequence_len)

    @property
    def tokens(self) -> int:
        """Tokens through the policy with gradients per micro-batch, on one GPU (its slice of the rows under context
        parallelism; each of them still attends to its whole row: `context`)."""
        return -(-self.method.tokens(self.micro_batch_size, self.sequence_len) // self.context_parallel)

    @property
    def scored_tokens(self) -> int:
        """Tokens the output head projects per micro-batch, on one GPU."""
        return -(-self.method.scored_tokens(self.micro_batch_size, self.sequence_len) // self.context_parallel)

    def context(self, window: int | None) -> float:
        """Keys whose scores a query's attention computes, on average, in a layer with attention `window` (None: full
        attention). Eager attention, and SDPA given a mask (packed rows' documents, a sliding window), compute the
        whole row and mask it afterwards; causal kernels skip the keys after the query, windowed ones those outside
        the window."""
        if self.attention == "eager" or (self.attention == "sdpa" and (self.packed or window)):
            return self.row_len
        full = self.method.mean_context(self.sequence_len)
        return min(self.row_len, window) if window else full

    def checkpointed(self, layers: int) -> int:
        """How many of `layers` decoder layers are checkpointed."""
        if not self.checkpointing:
            return 0
        return layers if self.checkpointed_layers is None else min(self.checkpointed_layers, layers)

    def offloaded(self, layers: int) -> frozenset[int]:
        """The indices of the layers `activation_offload_layers` runs once with everything they save on the host."""
        from hellbender.models.activation_checkpointing import offloaded_layer_indices

        checkpointed = self.checkpointed(layers)
        count = min(self.offloaded_layers, checkpointed)
        return frozenset(offloaded_layer_indices(checkpointed, count)) if count else frozenset()

    def recomputed(self, layers: int) -> list[bool]:
        """Per decoder layer, whether backward recomputes its forward (checkpointed and not offloaded)."""
        checkpointed, offloaded = self.checkpointed(layers), self.offloaded(layers)
        return [index < checkpointed and index not in offloaded for index in range(layers)]

    def but(self, **changes: object) -> PlanSettings:
        return replace(self, **changes)


def plan_settings(cfg: HellbenderConfig, gpus: int = 1, facts: ModelFacts | None = None) -> PlanSettings:
    """The settings `cfg` runs with on `gpus` GPUs (`facts`: of its model, where they are at hand)."""
    sharding, offload_optimizer, live_parameters = _sharding(cfg)
    context_parallel = min(cfg.context_parallel_size or 1, gpus)
    optimizer = cfg.optimizer if cfg.optimizer != "auto" else "adamw_torch_fused"  # the planner plans for a GPU
    method = method_shape(cfg, facts)
    sequence_len = cfg.sequence_len
    if method.rollout is not None:  # a prompt of at least one token, and a completion as long as it may be
        sequence_len = method.prompt(sequence_len) + method.rollout.completion_len
    return PlanSettings(
        micro_batch_size=cfg.micro_batch_size,
        sequence_len=sequence_len,
        checkpointing=cfg.checkpoints_activations,
        offload=cfg.gradient_checkpointing == "offload",
        checkpointed_layers=cfg.gradient_checkpointing_layers,
        fused_loss=cfg.fuses_the_loss,
        loss_chunk_scale=cfg.fused_cross_entropy_chunk_scale or 1,
        liger_rms_norm=cfg.liger_rms_norm,
        liger_glu=cfg.liger_glu_activation,
        eager_attention=cfg.attn_implementation == "eager",
        optimizer=optimizer,
        quantized_bits=cfg.quantized_bits,
        gpus=gpus,
        sharding=sharding if gpus > 1 else "none",
        offload_optimizer=offload_optimizer,
        method=method,
        liger_rope=cfg.liger_rope,
        clips_gradients=bool(cfg.max_grad_norm),
        context_parallel=context_parallel,
        tiled_mlp=cfg.tiled_mlp,
        tiled_mlp_shards=cfg.tiled_mlp_num_shards,
        attention=cfg.attn_implementation or "sdpa",
        offloaded_layers=cfg.activation_offload_layers,
        packed=cfg.sample_packing,
        shard_group=_shard_group(cfg, gpus, context_parallel),
        live_parameters=live_parameters,
    )


def _shard_group(cfg: HellbenderConfig, gpus: int, context_parallel: int) -> int:
    """The GPUs FSDP2 splits the weights, gradients and optimizer states over: all of them, or under hybrid sharding
    (`dp_replicate_size` > 1) each replica's group, which holds a whole copy. 0: all of them."""
    from hellbender.config.hybrid_sharding import hybrid_shape

    shape = hybrid_shape(cfg, gpus // context_parallel) if gpus > 1 else None
    return gpus // shape[0] if shape else 0


# DeepSpeed's default `stage3_max_live_parameters`: gathered weights ZeRO-3 may keep resident before releasing them.
DEEPSPEED_LIVE_PARAMETERS = 10**9


def _sharding(cfg: HellbenderConfig) -> tuple[str, bool, int]:
    """The sharding, whether the optimizer states (and FSDP2's parameters) are offloaded, and ZeRO-3's live
    parameters."""
    if cfg.uses_fsdp2:
        return "fsdp2", bool(getattr(cfg.fsdp_settings, "offload_params", False)), 0
    if cfg.deepspeed:
        from hellbender.config.deepspeed import read_deepspeed_json, zero_stage

        settings = read_deepspeed_json(cfg.deepspeed)
        stage = zero_stage(settings) or 0
        zero = settings.get("zero_optimization") or {}
        offloaded = isinstance(zero.get("offload_optimizer"), dict) and zero["offload_optimizer"].get("device") == "cpu"
        live = zero.get("stage3_max_live_parameters", DEEPSPEED_LIVE_PARAMETERS)
        live = int(float(live)) if isinstance(live, (int, float)) else DEEPSPEED_LIVE_PARAMETERS  # "auto": default
        return (f"zero{stage}" if stage else "none"), offloaded, live if stage == 3 else 0
    return "none", False, 0
