"""Attention over packed rows on one GPU: what transformers' SDPA path costs when a row holds several documents,
against the same row as one document, torch's varlen kernel over the documents and flex attention.

W1's attention shape (2 rows of 2,048 tokens, 32 query heads, 8 key-value heads, head size 128, bf16), forward +
backward, median of `--iters`:
- `sdpa, one document per row`: transformers' SDPA function without a mask (`is_causal`), what W1 measures;
- `sdpa, block mask`: the same function given the [rows, 1, T, T] block-diagonal causal mask transformers builds
  from restarting position ids (its kernel computes every block, and the key-value heads are repeated for it);
- `varlen`: torch's varlen kernel over the documents (`cu_seqlens`), causal within each;
- `flex`: compiled flex attention with a document-causal block mask (`attn_implementation: flex_attention`), which
  skips the blocks no query may read.

    python3 bench/packed_attention.py [--iters 30] [--documents 256-1024]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

ROWS, LENGTH, HEADS, KV_HEADS, DIM = 2, 2048, 32, 8, 128


def document_lengths(low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(ROWS):
        lengths, left = [], LENGTH
        while left > 0:
            n = min(rng.randint(low, high), left)
            lengths.append(n)
            left -= n
        rows.append(lengths)
    return rows


def block_mask(rows: list[list[int]]) -> torch.Tensor:
    mask = torch.zeros(ROWS, 1, LENGTH, LENGTH, dtype=torch.bool, device="cuda")
    for r, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            mask[r, 0, start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
            start += n
    return mask


def timed(run: Any, iters: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--documents", default="256-1024", help="document lengths drawn uniformly from LOW-HIGH")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hellbender.train.shared_prompt import causal_varlen

    low, high = map(int, args.documents.split("-"))
    rows = document_lengths(low, high)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; documents per row {rows}")
    torch.manual_seed(0)
    q = torch.randn(ROWS, HEADS, LENGTH, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(ROWS, KV_HEADS, LENGTH, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn(ROWS, LENGTH, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True, training=True)
    mask = block_mask(rows)
    starts = torch.tensor([0] + [n for r in rows for n in r], device="cuda").cumsum(0, dtype=torch.int32)
    longest = max(n for r in rows for n in r)

    def sdpa(attention_mask: torch.Tensor | None) -> torch.Tensor:
        return sdpa_attention_forward(module, q, k, v, attention_mask, scaling=DIM**-0.5)[0]

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    document = torch.tensor([[d for d, n in enumerate(r) for _ in range(n)] for r in rows], device="cuda")

    def same_document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (document[b, q_idx] == document[b, kv_idx]) & (kv_idx <= q_idx)

    blocks = create_block_mask(same_document_causal, ROWS, None, LENGTH, LENGTH, device="cuda")
    compiled_flex = torch.compile(flex_attention)

    def flex() -> torch.Tensor:
        out = compiled_flex(q, k, v, block_mask=blocks, scale=DIM**-0.5, enable_gqa=True)
        return out.transpose(1, 2)

    def varlen() -> torch.Tensor:
        flat = [t.transpose(1, 2).reshape(ROWS * LENGTH, t.shape[1], DIM) for t in (q, k, v)]
        out = causal_varlen(*flat, (starts, starts), (longest, longest), DIM**-0.5)
        return out.view(ROWS, LENGTH, HEADS, DIM)

    cases = {
        "sdpa, one document per row": lambda: sdpa(None),
        "sdpa, block mask": lambda: sdpa(mask),
        "varlen": varlen,
        "flex": flex,
    }
    outputs, grads = {}, {}
    for name, call in cases.items():
        out = call()
        out.backward(grad)
        outputs[name], grads[name] = out.detach().float(), q.grad.detach().float()
        q.grad = k.grad = v.grad = None
    for name in ("varlen", "flex"):
        difference = (outputs[name] - outputs["sdpa, block mask"]).abs().max().item()
        grad_difference = (grads[name] - grads["sdpa, block mask"]).abs().max().item()
        print(
            f"{name} against the block mask: output max |difference| {difference:.1e}, query grad {grad_difference:.1e}"
        )
    print("| attention | ms forward + backward | forward ms | peak MiB above inputs |")
    print("|---|---|---|---|")
    for name, call in cases.items():

        def both(call: Any = call) -> None:
            call().backward(grad)

        def forward_only(call: Any = call) -> None:
            with torch.no_grad():
                call()

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        floor = torch.cuda.memory_allocated()
        ms = timed(both, args.iters)
        peak = (torch.cuda.max_memory_allocated() - floor) / 2**20
        print(f"| {name} | {ms:.3f} | {timed(forward_only, args.iters):.3f} | {peak:.0f} |", flush=True)
        q.grad = k.grad = v.grad = None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
