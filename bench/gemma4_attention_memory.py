"""Peak GPU memory and time of one Gemma 4 (E2B) attention call, forward + backward, for three SDPA routes.

Shapes are those of Gemma-4-E2B at `--seq` tokens (default 8192), batch 1, bf16: a full-attention layer has 8 query
heads, 1 K/V head and head_dim 512; a sliding layer has head_dim 256 and a 512-token sliding-window mask (passed as a
[1, 1, seq, seq] boolean tensor). Routes compared for each shape:

- "sdpa enable_gqa": `scaled_dot_product_attention(..., enable_gqa=True)`, what transformers <= 5.8 did for Gemma 4
  (no efficient kernel takes enable_gqa with head_dim > 256, so PyTorch falls back to the math kernel);
- "transformers sdpa (installed)": `transformers.integrations.sdpa_attention.sdpa_attention_forward`;
- "hellbender large_head_sdpa": `hellbender.models.attention.large_head_sdpa`.

Memory is the peak allocated during the call minus what was allocated before it (the inputs), so it counts the
attention's own working memory plus the input gradients. "runs without math kernel" repeats the call with only the
flash, memory-efficient and cuDNN backends enabled. Outputs are compared with the first route that succeeded.

Run on a CUDA machine: `python bench/gemma4_attention_memory.py [--seq 8192] [--json results.json]`.
Results are written up in docs/gemma4.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

MIB = 1024**2
QUERY_HEADS, KV_HEADS = 8, 1
FULL_HEAD_DIM, SLIDING_HEAD_DIM, SLIDING_WINDOW = 512, 256, 512
WARMUPS, REPEATS = 2, 5
NO_MATH = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

# (module, q, k, v, mask) -> output as [batch, seq, heads, head_dim]
AttentionCall = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class AttentionStub(torch.nn.Module):
    """The two attributes transformers' SDPA function reads from a Gemma 4 attention layer."""

    def __init__(self) -> None:
        super().__init__()
        self.num_key_value_groups = QUERY_HEADS // KV_HEADS
        self.is_causal = True


def sdpa_enable_gqa(module: torch.nn.Module, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    # SDPA refuses is_causal together with a mask; the sliding mask already holds causality.
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=1.0, enable_gqa=True
    )
    return out.transpose(1, 2)


def transformers_sdpa(module: torch.nn.Module, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, q, k, v, mask, scaling=1.0)[0]


def hellbender_sdpa(module: torch.nn.Module, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    from hellbender.models.attention import large_head_sdpa

    return large_head_sdpa(module, q, k, v, mask, scaling=1.0)[0]


VARIANTS: list[tuple[str, AttentionCall]] = [
    ("sdpa enable_gqa", sdpa_enable_gqa),
    ("transformers sdpa (installed)", transformers_sdpa),
    ("hellbender large_head_sdpa", hellbender_sdpa),
]


@dataclass
class Result:
    layer: str
    head_dim: int
    variant: str
    peak_mib: float | None = None
    time_ms: float | None = None
    runs_without_math: str = "n/a"
    max_abs_diff: float | None = None
    error: str | None = None


def make_inputs(seq: int, head_dim: int, sliding: bool) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device="cuda").manual_seed(0)

    def leaf(heads: int) -> torch.Tensor:
        # Scaled by head_dim**-0.25 so q.k has unit variance with scaling=1.0 (Gemma 4 normalises q and k instead
        # of scaling): a softmax that is not one-hot keeps the output comparison meaningful.
        x = torch.randn(1, heads, seq, head_dim, device="cuda", generator=generator) * head_dim**-0.25
        return x.to(torch.bfloat16).requires_grad_()

    q, k, v = leaf(QUERY_HEADS), leaf(KV_HEADS), leaf(KV_HEADS)
    mask = None
    if sliding:
        pos = torch.arange(seq, device="cuda")
        distance = pos[:, None] - pos[None, :]
        mask = ((distance >= 0) & (distance < SLIDING_WINDOW))[None, None]
    return q, k, v, mask


def fwd_bwd(call: AttentionCall, module: torch.nn.Module, q, k, v, mask) -> torch.Tensor:
    for t in (q, k, v):
        t.grad = None  # fresh gradients each call, so accumulation never adds to the measured memory
    out = call(module, q, k, v, mask)
    out.float().sum().backward()
    torch.cuda.synchronize()
    return out.detach()


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def measure(layer: str, head_dim: int, seq: int, name: str, call: AttentionCall) -> tuple[Result, torch.Tensor | None]:
    result = Result(layer, head_dim, name)
    module = AttentionStub()
    out = None
    try:
        q, k, v, mask = make_inputs(seq, head_dim, sliding=layer == "sliding")
        for _ in range(WARMUPS):
            fwd_bwd(call, module, q, k, v, mask)
        for t in (q, k, v):
            t.grad = None
        free_memory()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fwd_bwd(call, module, q, k, v, mask).cpu()
        result.peak_mib = (torch.cuda.max_memory_allocated() - before) / MIB
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            fwd_bwd(call, module, q, k, v, mask)
            times.append((time.perf_counter() - start) * 1000)
        result.time_ms = statistics.median(times)
        result.runs_without_math = runs_without_math(call, module, q, k, v, mask)
    except torch.cuda.OutOfMemoryError:
        result.error = "OOM"
    except Exception as exc:  # one failing route must not hide the others' numbers
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    finally:
        q = k = v = mask = None
        free_memory()
    return result, out


def runs_without_math(call: AttentionCall, module: torch.nn.Module, q, k, v, mask) -> str:
    try:
        with sdpa_kernel(NO_MATH):
            fwd_bwd(call, module, q, k, v, mask)
    except torch.cuda.OutOfMemoryError:
        return "OOM"
    except Exception:  # "No available kernel" (or hellbender's EnvironmentProblem wrapping it)
        return "no"
    return "yes"


def run_all(seq: int) -> list[Result]:
    results = []
    for layer, head_dim in (("full", FULL_HEAD_DIM), ("sliding", SLIDING_HEAD_DIM)):
        reference = None
        for name, call in VARIANTS:
            result, out = measure(layer, head_dim, seq, name, call)
            if out is not None:
                if reference is None:
                    reference = out
                result.max_abs_diff = (out.float() - reference.float()).abs().max().item()
            print(f"  {layer:7s} {name:30s} {result.error or f'{result.peak_mib:.0f} MiB, {result.time_ms:.1f} ms'}")
            results.append(result)
    return results


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(results: list[Result]) -> str:
    lines = [
        "| layer | head_dim | variant | peak MiB (fwd+bwd) | time ms | runs without math kernel | max abs diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        peak = r.error if r.error else fmt(r.peak_mib, ".0f")
        lines.append(
            f"| {r.layer} | {r.head_dim} | {r.variant} | {peak} | {fmt(r.time_ms, '.2f')} | "
            f"{r.runs_without_math} | {fmt(r.max_abs_diff, '.2e')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence (default 8192)")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("CUDA is not available: this benchmark measures GPU memory and needs a CUDA GPU.")

    import transformers

    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "seq": args.seq,
    }
    print(f"device: {env['device']}  torch {env['torch']}  transformers {env['transformers']}  seq {args.seq}")
    results = run_all(args.seq)
    print()
    print(markdown_table(results))
    if args.json:
        args.json.write_text(json.dumps({**env, "results": [asdict(r) for r in results]}, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
