"""What the GPU spends on a step's work besides its large matmuls, from costs measured one op at a time
(`bench/elementwise_costs.py`, one H200, torch 2.11, transformers 5.17, peft 0.21, liger-kernel 0.8.5; docs/plan.md,
"Memory-bound work and attention kernels").

A narrow model's step is not bound by its matmuls. In an uncompiled layer every norm, rotary embedding, gated
product, residual sum and LoRA adapter reads and writes whole activations, and a norm computes in float32; the loss
makes float32 copies of every logit. Their cost is per element, not per FLOP: on Gemma-4-E2B (1,536 wide, seven
norms a layer, 262,144 logits a token) it is as large as the matmuls', on an 8B Llama a tenth of them. Attention's
kernel depends on the head size and the mask: heads wider than 256 fall to PyTorch's memory-efficient kernel, at a
twentieth of the rate of heads of 128.

Costs are picoseconds per element on an H200, forward alone and forward + backward, the GPU's kernel time (launches
are the host's, counted apart); on another card they scale with its memory bandwidth (`bandwidth_scale`), attention's
rates with its peak."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    """Picoseconds per element on an H200: one forward, and one forward + backward."""

    forward: float
    both: float

    def of(self, elements: float, backward: bool) -> float:
        return elements * (self.both if backward else self.forward) * 1e-12


# A norm in float32 (Llama's and Gemma 4's alike, at widths 1,536 and 4,096 and per head of 256: within 10%).
NORM = Cost(13.5, 47.0)  # per element normalised
LIGER_NORM = Cost(1.2, 7.2)
ROTARY = Cost(12.8, 27.5)  # per element of the rotated queries and keys
LIGER_ROTARY = Cost(7.1, 14.6)
GATED_PRODUCT = Cost(2.5, 10.1)  # per element of the MLP's inner width (SiLU and tanh-GELU alike)
LIGER_GATED_PRODUCT = Cost(1.4, 7.2)  # Liger's SwiGLU
RESIDUAL = Cost(1.4, 4.9)  # per element summed
LORA = Cost(7.9, 17.3)  # per element of a LoRA-wrapped layer's input and output (r 16, dropout 0, float32 adapters)
LOSS = Cost(6.7, 14.3)  # per logit: float32 cross-entropy from bf16 logits
SOFTCAPPED_LOSS = Cost(9.6, 20.4)  # with Gemma's final soft-capping before it
# Per logit: a distillation teacher's logits to float32 and their top 64 (no gradients: forward only).
TEACHER_TARGETS = Cost(14.0, 14.0)
# Per logit: hellbender's distillation loss (train/distillation_loss.py, 64 targets a position, from bf16 logits:
# the trained positions' copy, the divergence's float32 logits and `logsumexp`, the cross-entropy's own copy), with the
# cross-entropy's gradient (`kd_ce_alpha` > 0) and without it (its value is still computed, for the log). At
# vocabularies of 128,256 and 262,144 alike (within 1%), at temperature 1 (another divides the logits once more).
DISTILLATION_LOSS = Cost(17.5, 47.4)
DISTILLATION_LOSS_NO_CE_GRADIENT = Cost(17.5, 39.7)
# Per element of a trained output layer, per chunk of the chunked distillation loss: its float32 gradient accumulator
# read and written and the chunk's gradient read (one `add_`). Measured inside the W2 distillation step (0.964 ms a
# chunk for the 1B's 262.7M-element head, H200 profiler trace), so `IN_MODEL_SHARE` does not apply to it.
HEAD_GRADIENT_ACCUMULATION_PS = 3.67

# Inside a model these ops took 0.85 of what they take alone (fitted with the matmuls' share, cards.py, to 35 measured
# steps of W1-W4 on one H200, docs/plan.md; likely the activations a layer's ops pass on still sitting in L2).
IN_MODEL_SHARE = 0.85
H200_HBM_TB_S = 4.8
# On another card the costs scale with the square root of the bandwidth ratio, not the ratio: fitted to W1 and W2 on an
# H100 (3.35 TB/s), where the full ratio put W1 1.2-1.3x too slow; these ops are partly bound by latency, not bytes.
BANDWIDTH_EXPONENT = 0.5
H200_PEAK_TFLOPS = 989.0


def bandwidth_scale(hbm_tb_s: float) -> float:
    """How much longer a memory-bound op takes on a card of `hbm_tb_s` than on the H200 the costs were measured on."""
    return (H200_HBM_TB_S / hbm_tb_s) ** BANDWIDTH_EXPONENT


def _in_model(seconds: float, hbm_tb_s: float) -> float:
    """Seconds measured alone on an H200, as the op takes them inside a model on a card of `hbm_tb_s`."""
    return seconds * IN_MODEL_SHARE * bandwidth_scale(hbm_tb_s)


@dataclass(frozen=True)
class AttentionRate:
    """TFLOP/s of SDPA's kernel on an H200, counted as the planner counts attention (4 T c d forward, c the keys per
    query, backward twice the forward), for rows of 2,048 tokens."""

    forward: float
    both: float


# (largest head size, under a mask) -> rate. Heads up to 256 run flash or cuDNN kernels; wider ones the memory-
# efficient kernel, which computes every key of a causal row (hence its lower "causal" rate, counted at half).
ATTENTION_RATES: dict[tuple[int, bool], AttentionRate] = {
    # Heads of 64 (the 1B Llama's 32, 8 key-value), causal: profiled in the W2 recipe's steps (cuDNN: 200.5 us
    # forward, 654 us backward a layer); under a mask not measured: the 128 rate scaled by the causal ratio.
    (64, False): AttentionRate(343, 241),
    (64, True): AttentionRate(223, 177),
    (128, False): AttentionRate(544, 343),
    (128, True): AttentionRate(354, 252),
    (256, False): AttentionRate(485, 270),
    (256, True): AttentionRate(272, 182),
    (1 << 30, False): AttentionRate(18, 21),
    (1 << 30, True): AttentionRate(35, 41),
}
HEAD_SIZES = sorted({size for size, _ in ATTENTION_RATES})
MEASURED_ROW = 2048
# Longer rows reach more of the card (each query block's fixed work weighs less). Rate at row length L: the 2,048-token
# rate x (L / (L + L0)) / (2048 / (2048 + L0)); L0 fitted to W4's 8B runs of rows of 32,768-98,304 tokens
# (docs/plan.md), where attention is half the step.
ROW_OVERHEAD_TOKENS = 1024


def attention_rate(head_dim: int, masked: bool, row: int, backward: bool, peak_tflops: float) -> float:
    """FLOP/s of one layer's attention for heads of `head_dim` over rows of `row` tokens on a card of that peak."""
    size = next(size for size in HEAD_SIZES if head_dim <= size)
    rate = ATTENTION_RATES[(size, masked)]
    at_row = (row / (row + ROW_OVERHEAD_TOKENS)) / (MEASURED_ROW / (MEASURED_ROW + ROW_OVERHEAD_TOKENS))
    return (rate.both if backward else rate.forward) * 1e12 * at_row * peak_tflops / H200_PEAK_TFLOPS


@dataclass(frozen=True)
class LayerTraffic:
    """Per token, what one decoder layer's forward runs outside its matmuls (counted by model_facts.py)."""

    norms: int  # elements its norms normalise
    rotary: int  # query and key elements rotated
    gated: int  # the MLP's inner width
    residual: int  # elements of its residual sums
    lora: int  # input + output widths of its LoRA-wrapped linear layers


def layer_seconds(t: LayerTraffic, tokens: float, backward: bool, liger: tuple[bool, bool, bool],
                  hbm_tb_s: float) -> float:  # fmt: skip
    """Seconds one layer's memory-bound work takes over `tokens`: forward, or forward + backward. `liger`: whether
    Liger's norm, rotary embedding and SwiGLU replace transformers' ops."""
    norm, rotary, gated = liger
    seconds = (
        (LIGER_NORM if norm else NORM).of(t.norms, backward)
        + (LIGER_ROTARY if rotary else ROTARY).of(t.rotary, backward)
        + (LIGER_GATED_PRODUCT if gated else GATED_PRODUCT).of(t.gated, backward)
        + RESIDUAL.of(t.residual, backward)
        + LORA.of(t.lora, backward)
    )
    return _in_model(tokens * seconds, hbm_tb_s)


def loss_seconds(tokens: float, vocab: int, softcapped: bool, hbm_tb_s: float) -> float:
    """The unfused loss over `tokens` positions' logits, forward and backward."""
    cost = SOFTCAPPED_LOSS if softcapped else LOSS
    return _in_model(cost.of(tokens * vocab, True), hbm_tb_s)


def teacher_targets_seconds(logits: float, hbm_tb_s: float) -> float:
    """Online distillation's targets: the teacher's `logits` in float32 and their top-k, once per micro-batch."""
    return _in_model(TEACHER_TARGETS.of(logits, False), hbm_tb_s)


def eager_scores_seconds(scores: float, backward: bool, hbm_tb_s: float) -> float:
    """Eager attention's float32 softmax over `scores` (query, key) pairs, priced as the loss's softmax per logit (not
    measured apart)."""
    return _in_model(LOSS.of(scores, backward), hbm_tb_s)


def distillation_loss_seconds(tokens: float, vocab: int, ce_gradient: bool, hbm_tb_s: float) -> float:
    """The distillation loss over `tokens` positions' logits, forward and backward (whole or a chunk at a time: the
    chunked loss runs the same ops on each chunk, less the trained positions' copy, which is not taken apart)."""
    cost = DISTILLATION_LOSS if ce_gradient else DISTILLATION_LOSS_NO_CE_GRADIENT
    return _in_model(cost.of(tokens * vocab, True), hbm_tb_s)


def head_gradient_accumulation_seconds(head_numel: int, chunks: int, hbm_tb_s: float) -> float:
    """The chunked distillation loss's float32 accumulator of a trained output layer's gradient, added to per chunk."""
    return chunks * head_numel * HEAD_GRADIENT_ACCUMULATION_PS * 1e-12 * bandwidth_scale(hbm_tb_s)
