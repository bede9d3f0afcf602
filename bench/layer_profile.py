"""Where one compiled decoder layer of the W1 recipe spends its GPU time: the Llama-3-8B shape with PEFT's LoRA r16
on its seven projections, compiled as hellbender runs it with `torch_compile`, forward + backward on 4,096 tokens.

It prints, per mode (the layer keeping its activations, and checkpointed), the kernels' time per forward + backward
grouped by kind: the base weights' matmuls (GEMM kernels of 100 us or more), the small matmuls (LoRA's and other
GEMM kernels under 100 us), attention, the compiler's fused kernels, and the rest; then the top kernels by time.
Beside it, the ceiling: the same base matmuls (forward, and the input gradient of backward) timed alone with cuBLAS,
back to back, in TFLOP/s. The gap between the two says how much faster the layer could run at most.

    python3 bench/layer_profile.py [--tokens 4096] [--iters 10]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_kernels import build_layer, step_function  # noqa: E402  (beside this script)

HIDDEN, INTERMEDIATE, KV = 4096, 14336, 1024
# (out_features, in_features) of q, k, v, o, gate, up, down
PROJECTION_SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)] + [(INTERMEDIATE, HIDDEN)] * 2
PROJECTION_SHAPES.append((HIDDEN, INTERMEDIATE))
LARGE_GEMM_US = 100.0


def kind_of(name: str, duration_us: float) -> str:
    lowered = name.lower()
    if "flash" in lowered or "fmha" in lowered or "attention" in lowered:
        return "attention"
    if any(tag in lowered for tag in ("gemm", "nvjet", "xmma", "cutlass", "sm90", "ampere_bf16")):
        return "base matmuls" if duration_us >= LARGE_GEMM_US else "small matmuls (LoRA, ...)"
    if lowered.startswith("triton"):
        return "compiler's fused kernels"
    return "other"


def profile_layer(mode: str, tokens: int, iters: int) -> tuple[dict[str, float], list[tuple[str, float, int]], float]:
    layer, rotary = build_layer(False)
    call = step_function(layer, rotary, tokens, mode)
    hidden = torch.randn(tokens // 2048, 2048, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def once() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = call(hidden)
        out.float().mean().backward()

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(iters):
            once()
        end.record()
        torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / iters
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        duration = event.time_range.end - event.time_range.start  # us
        by_kind[kind_of(event.name, duration)] += duration / 1e3 / iters
        by_name[event.name].append(duration)
    top = sorted(((n, sum(d) / 1e3 / iters, len(d) // iters) for n, d in by_name.items()), key=lambda t: -t[1])
    return dict(by_kind), top[:15], wall_ms


def gemm_ceiling(tokens: int, iters: int) -> tuple[float, float]:
    """ms and TFLOP/s of the base matmuls alone: forward and the input gradient, per projection, back to back."""
    x = {k: torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)}
    g = {n: torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16) for n in (HIDDEN, KV, INTERMEDIATE)}
    weights = [torch.randn(o, i, device="cuda", dtype=torch.bfloat16) for o, i in PROJECTION_SHAPES]

    def once() -> None:
        for w in weights:
            torch.nn.functional.linear(x[w.shape[1]], w)  # forward
            g[w.shape[0]] @ w  # input gradient

    for _ in range(3):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        once()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    flops = sum(2 * 2 * tokens * o * i for o, i in PROJECTION_SHAPES)
    return ms, flops / ms / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step (rows of 2,048); W1: 4,096")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; {args.tokens} tokens per step")
    ceiling_ms, ceiling_tflops = gemm_ceiling(args.tokens, 50)
    print(
        f"ceiling: the base matmuls alone (forward + input gradient) {ceiling_ms:.2f} ms, {ceiling_tflops:.0f} TFLOP/s"
    )
    kinds = ["base matmuls", "small matmuls (LoRA, ...)", "attention", "compiler's fused kernels", "other"]
    for mode in ("compiled", "compiled checkpointed"):
        torch._dynamo.reset()
        by_kind, top, wall = profile_layer(mode, args.tokens, args.iters)
        print(f"\n{mode}: {wall:.2f} ms per forward + backward (wall, under the profiler)")
        print("| kernels | ms | share of kernel time |")
        print("|---|---|---|")
        total = sum(by_kind.values())
        for kind in kinds:
            print(f"| {kind} | {by_kind.get(kind, 0.0):.2f} | {by_kind.get(kind, 0.0) / total:.0%} |")
        print(f"| all | {total:.2f} | GPU idle {max(wall - total, 0):.2f} ms |")
        print("| top kernel | ms | launches |")
        print("|---|---|---|")
        for name, ms, count in top:
            print(f"| {name[:90]} | {ms:.3f} | {count} |")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
