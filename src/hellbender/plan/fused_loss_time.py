"""The GPU time of Liger's fused linear cross-entropy (`liger_fused_linear_cross_entropy`) beyond its matmuls' FLOPs,
which `flops.py` counts with the output head's at the card's matmul share.

Liger runs the output head and the loss in the forward, a chunk of positions at a time, and keeps the gradients it
computes there for the backward (liger-kernel 0.8, `fused_linear_cross_entropy_forward`). A chunk holds the next power
of two of ceil(T / ceil(V / (C H))) positions (T positions, vocabulary V, hidden width H, C Liger's `chunk_mem_const`,
`fused_cross_entropy_chunk_scale`, 1 by default): about C H / V of the logits at once. Each chunk runs
- the logits (chunk x H times H x V) and the hidden states' gradient (chunk x V times V x H). Each reads the whole head
  weight; where that takes longer than the matmul's FLOPs, the excess counts. Such a matmul, few rows against a large
  weight, reads it at `WEIGHT_BOUND_BANDWIDTH_SHARE` of the card's bandwidth (the 8B's head: 1.05 GB per chunk of
  128 positions, 0.28 ms against 0.17 ms of FLOPs);
- the loss kernel over the chunk's logits: it reads them twice and writes their gradient in their place, at the
  share of the bandwidth inductor's fused kernels reach (`compiled_time.FUSED_BANDWIDTH_SHARE`);
- for a trained head, the weight's gradient added into one V x H buffer by a matmul whose inner dimension is only
  the chunk: it reads and writes the whole buffer each chunk, and that traffic comes on top of its FLOPs.

Profiled on the 1B full fine-tuning recipe (W2: 8,192 positions, 32 chunks of 256; H200, torch 2.11, liger-kernel
0.8.5; docs/plan.md, "Full fine-tuning's optimizer and the fused loss"): the accumulating matmul took 399.6 us a
chunk, where its FLOPs at the card's matmul share take 174 us and the buffer's 525 MB read and written 219 us; the
loss kernel 50.0 us over 66 MB of logits (54 us here); the two other matmuls 194.6 and 182.5 us against 174 us of
FLOPs (not counted: within the matmul share's spread).
"""

from __future__ import annotations

from hellbender.plan.cards import Card
from hellbender.plan.compiled_time import FUSED_BANDWIDTH_SHARE

# Fitted, not profiled: on the 8B LoRA recipe (frozen head, 4,096 positions, H200) chunks of 256 positions instead of
# 128 shortened the step by 6.6, 6.0 and 15.3 ms in three invocations (docs/benchmarks.md, "Fewer, larger chunks
# for the fused loss"), where reading the head at the full 4.8 TB/s accounts for 2.9; the median, 6.6 ms, is the 32
# chunks' two matmuls reading the head at 0.79 of it. The 1B recipe's chunks stay bound by their FLOPs at that share
# (measured 4.8-7.3 ms for 8 chunks instead of 32, planned 5.25 from its gradient buffer alone).
WEIGHT_BOUND_BANDWIDTH_SHARE = 0.79
LOSS_PASSES = 3  # the loss kernel reads each logit twice (the row's maximum and sum, then the gradient) and writes once


def chunk_positions(tokens: int, vocab: int, hidden: int, scale: int = 1) -> int:
    """Positions per chunk, as Liger sizes them: the next power of two of ceil(tokens / ceil(vocab / (scale x
    hidden))), at most `tokens` (`scale`: `fused_cross_entropy_chunk_scale`, Liger's `chunk_mem_const`)."""
    per_chunk = -(-tokens // -(-vocab // (scale * hidden)))
    return min(tokens, 1 << max(0, per_chunk - 1).bit_length())


def seconds(tokens: int, vocab: int, hidden: int, head_bytes: int, head_trainable: bool, card: Card,
            scale: int = 1) -> float:  # fmt: skip
    """One micro-batch of `tokens` positions: the head weight's reads beyond the FLOPs of the two matmuls that read
    it, the loss kernel, and a trained head's gradient buffer read and written once per chunk."""
    if not tokens or not head_bytes:
        return 0.0
    chunk = chunk_positions(tokens, vocab, hidden, scale)
    chunks = -(-tokens // chunk)
    element = head_bytes / (vocab * hidden)
    bandwidth = card.hbm_tb_s * 1e12
    matmul = 2 * chunk * hidden * vocab / (card.bf16_tflops * 1e12 * card.efficiency)
    weight_reads = 2 * max(0.0, head_bytes / (bandwidth * WEIGHT_BOUND_BANDWIDTH_SHARE) - matmul)
    loss = LOSS_PASSES * chunk * vocab * element / (bandwidth * FUSED_BANDWIDTH_SHARE)
    gradient_buffer = 2 * head_bytes / bandwidth if head_trainable else 0.0
    return chunks * (weight_reads + loss + gradient_buffer)
