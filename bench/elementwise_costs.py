"""What a training step's memory-bound work costs per element on this GPU: the costs the planner's step time adds to
its matmul FLOPs (src/hellbender/plan/kernel_costs.py holds them).

Each op runs forward alone and forward + backward, in bf16, over `--tokens` tokens, the way transformers and PEFT run
it in training (their own modules and functions, not re-implementations): an unfused RMSNorm (Llama's and Gemma 4's),
Liger's fused one, the rotary embedding (transformers' and Liger's), the MLP's gated product (SiLU and tanh-GELU,
unfused, and Liger's SwiGLU), a residual sum, PEFT's LoRA on a frozen linear layer (what it adds to the base
matmul: its two small matmuls, the float32 cast, the scaling and the sum), the loss over the logits (float32 cross
entropy from bf16 logits, with and without Gemma's final soft-capping; a distillation teacher's top-64 targets and
hellbender's distillation loss), and
SDPA's attention kernels by head size, causal and under a block-diagonal mask of packed documents. Each line prints
picoseconds per element (an element: one token times one unit of the op's width; a logit for the loss), forward and
forward + backward: the GPU's kernel time per run (the union of its kernels' spans under the profiler, over
`--repeats` runs), not wall time. Attention prints TFLOP/s counted as the planner counts it (4 T c d forward, c the
keys per query: half the row causal, the whole row under a mask; backward twice the forward).

Run on a CUDA machine: `python3 bench/elementwise_costs.py` (about a minute on an H200)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import busy_time  # noqa: E402  (beside this script: the union of kernel spans)

Op = Callable[[], torch.Tensor]
DEVICE = "cuda"  # --device cpu: a quick check of the script itself, not a measurement


def timed(fn: Op, backward: bool, repeats: int) -> float:
    """Seconds the GPU spends running `fn` (and the backward of its output) once: the union of its kernels' spans
    under the profiler, over `repeats` runs after warm-up. Kernel time, not wall time: in a training step the host
    queues kernels ahead of the GPU, so launching them costs no GPU time (the planner counts launches apart). On the
    CPU (`--device cpu`, a check of the script): wall time."""

    def once() -> None:
        out = fn()
        if backward:
            out.backward(torch.ones_like(out))

    for _ in range(3):
        once()
    synchronize()
    if DEVICE != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            once()
        return (time.perf_counter() - start) / repeats
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            once()
        synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    return busy_time(spans) / 1e6 / repeats  # microseconds


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def leaf(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_()


def per_element(name: str, fn: Op, elements: int, repeats: int, rows: list[str]) -> None:
    forward = timed(lambda: fn().detach(), False, repeats)
    both = timed(fn, True, repeats)
    rows.append(f"| {name} | {elements:,} | {forward / elements * 1e12:.1f} | {both / elements * 1e12:.1f} |")
    print(rows[-1], flush=True)


def liger_available() -> bool:
    """Liger's kernels are Triton kernels: on the GPU, where the package is installed."""
    import importlib.util

    return DEVICE == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def norms(t: int, repeats: int, rows: list[str]) -> None:
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for width in (1536, 4096):
        x = leaf(t, width)
        llama = LlamaRMSNorm(width).to(DEVICE).to(torch.bfloat16)
        gemma = Gemma4RMSNorm(width).to(DEVICE).to(torch.bfloat16)
        per_element(f"RMSNorm, Llama's, width {width}", lambda m=llama, x=x: m(x), t * width, repeats, rows)
        per_element(f"RMSNorm, Gemma 4's, width {width}", lambda m=gemma, x=x: m(x), t * width, repeats, rows)
        if not liger_available():
            continue
        from liger_kernel.transformers.rms_norm import LigerRMSNorm

        liger = LigerRMSNorm(width).to(DEVICE).to(torch.bfloat16)
        per_element(f"RMSNorm, Liger's, width {width}", lambda m=liger, x=x: m(x), t * width, repeats, rows)
    heads = leaf(t, 8, 256)  # a per-head norm (Gemma 4's query norm): 8 rows of 256 per token
    per_head = Gemma4RMSNorm(256).to(DEVICE).to(torch.bfloat16)
    per_element("RMSNorm, Gemma 4's, 8 heads of 256", lambda: per_head(heads), t * 2048, repeats, rows)


def rotary(t: int, repeats: int, rows: list[str]) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    heads, kv_heads, dim = 32, 8, 128
    q, k = leaf(1, heads, t, dim), leaf(1, kv_heads, t, dim)
    angles = torch.randn(1, t, dim, device=DEVICE, dtype=torch.bfloat16)
    cos, sin = angles.cos(), angles.sin()
    elements = t * (heads + kv_heads) * dim

    def unfused() -> torch.Tensor:
        a, b = apply_rotary_pos_emb(q, k, cos, sin)
        return torch.cat([a.flatten(), b.flatten()])

    per_element("rotary embedding, transformers' (q and k)", unfused, elements, repeats, rows)
    if not liger_available():
        return
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    def fused() -> torch.Tensor:
        a, b = liger_rotary_pos_emb(q, k, cos, sin)
        return torch.cat([a.flatten(), b.flatten()])

    per_element("rotary embedding, Liger's (q and k)", fused, elements, repeats, rows)


def gated(t: int, repeats: int, rows: list[str]) -> None:
    inner = 8192
    gate, up = leaf(t, inner), leaf(t, inner)
    per_element("gated product, SiLU", lambda: F.silu(gate) * up, t * inner, repeats, rows)
    per_element("gated product, tanh-GELU", lambda: F.gelu(gate, approximate="tanh") * up, t * inner, repeats, rows)
    if liger_available():
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        per_element(
            "gated product, Liger's SwiGLU", lambda: LigerSiLUMulFunction.apply(gate, up), t * inner, repeats, rows
        )
    x, y = leaf(t, 4096), leaf(t, 4096)
    per_element("residual sum", lambda: x + y, t * 4096, repeats, rows)


def lora(t: int, repeats: int, rows: list[str]) -> None:
    from peft import LoraConfig, get_peft_model

    for d_in, d_out in ((4096, 4096), (4096, 14336), (1536, 6144)):
        x = leaf(t, d_in)
        base = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, bias=False)).to(DEVICE).to(torch.bfloat16)
        base.requires_grad_(False)
        base_time = (
            timed(lambda m=base, x=x: m(x), True, repeats),
            timed(lambda m=base, x=x: m(x).detach(), False, repeats),
        )
        wrapped = get_peft_model(
            torch.nn.Sequential(torch.nn.Linear(d_in, d_out, bias=False)).to(DEVICE).to(torch.bfloat16),
            LoraConfig(r=16, lora_alpha=32, target_modules=["0"], lora_dropout=0.0),
        )
        both = timed(lambda m=wrapped, x=x: m(x), True, repeats) - base_time[0]
        forward = timed(lambda m=wrapped, x=x: m(x).detach(), False, repeats) - base_time[1]
        elements = t * (d_in + d_out)
        matmul = 2 * t * d_in * d_out  # the frozen base: forward, and the input's gradient in backward
        rows.append(
            f"| LoRA r16 over the base matmul, {d_in} -> {d_out} (per token x (in + out); the base alone: "
            f"{matmul / base_time[1] / 1e12:.0f} / {2 * matmul / base_time[0] / 1e12:.0f} TFLOP/s) | {elements:,} | "
            f"{forward / elements * 1e12:.1f} | {both / elements * 1e12:.1f} |"
        )
        print(rows[-1], flush=True)


def loss(repeats: int, rows: list[str]) -> None:
    cap = 30.0  # Gemma's final_logit_softcapping
    for t, vocab in ((4096, 128_256), (2048, 262_144)):
        logits = leaf(t, vocab)
        labels = torch.randint(0, vocab, (t,), device=DEVICE)

        def plain(logits: torch.Tensor = logits, labels: torch.Tensor = labels) -> torch.Tensor:
            return F.cross_entropy(logits.float(), labels)

        def capped(logits: torch.Tensor = logits, labels: torch.Tensor = labels) -> torch.Tensor:
            return F.cross_entropy((torch.tanh(logits / cap) * cap).float(), labels)

        per_element(f"loss over {vocab:,} logits per token", plain, t * vocab, repeats, rows)
        per_element(f"loss with soft-capping, {vocab:,} logits", capped, t * vocab, repeats, rows)
        teacher = logits.detach()
        with torch.no_grad():  # online distillation's targets: the teacher's logits in float32, their top 64
            forward = timed(lambda teacher=teacher: teacher.float().topk(64, dim=-1).values, False, repeats)
        rows.append(f"| a teacher's top-64 targets over {vocab:,} logits (no gradients) | {t * vocab:,} | "
                    f"{forward / (t * vocab) * 1e12:.1f} | |")  # fmt: skip
        print(rows[-1], flush=True)
        distillation(logits, labels, repeats, rows)


def distillation(logits: torch.Tensor, labels: torch.Tensor, repeats: int, rows: list[str]) -> None:
    """hellbender's distillation loss over the logits (train/distillation_loss.py: every position trained, 64
    targets each), with and without the cross-entropy's gradient (`kd_ce_alpha` 0.1 and 0)."""
    from hellbender.train.distillation_loss import DistillationLoss, distillation_loss

    t, vocab = logits.shape
    ids = torch.randint(0, vocab, (1, t, 64), device=DEVICE)
    logprobs = torch.log_softmax(torch.randn(1, t, 64, device=DEVICE), -1)
    mask = torch.ones(1, t, 64, device=DEVICE, dtype=torch.bool)
    per_token = torch.cat([labels[:1], labels[:-1]])[None]  # position i predicts token i + 1: the last one nothing
    for ce_alpha in (0.1, 0.0):
        settings = DistillationLoss(alpha=0.9, ce_alpha=ce_alpha)

        def run(settings: DistillationLoss = settings) -> torch.Tensor:
            return distillation_loss(logits[None], per_token, ids, logprobs, mask, settings).loss

        label = f"distillation loss, top 64, kd_ce_alpha {ce_alpha}, {vocab:,} logits"
        per_element(label, run, (t - 1) * vocab, repeats, rows)


def attention(t: int, repeats: int, rows: list[str]) -> None:
    rows.append("")
    rows.append(
        "| attention (SDPA), rows of 2,048, 4 documents under the mask | forward TFLOP/s | forward + backward |"
    )
    rows.append("|---|---|---|")
    print(rows[-2], flush=True)
    length, documents = 2048, 4
    batch = t // length
    document = torch.arange(length, device=DEVICE) // (length // documents)
    block = (document[:, None] == document[None, :]) & torch.ones(
        length, length, device=DEVICE, dtype=torch.bool
    ).tril()
    for heads, kv_heads, dim in ((32, 8, 128), (8, 1, 256), (8, 1, 512)):
        q = leaf(batch, heads, length, dim)
        k, v = leaf(batch, kv_heads, length, dim), leaf(batch, kv_heads, length, dim)
        for masked in (False, True):
            keys = length if masked else length / 2
            flops = 4 * batch * length * keys * heads * dim

            mask = {"attn_mask": block} if masked else {"is_causal": True}

            def run(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, mask: dict = mask) -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **mask)

            forward = timed(lambda: run().detach(), False, repeats)
            both = timed(run, True, repeats)
            label = f"{heads} heads of {dim} ({kv_heads} key-value), {'block mask' if masked else 'causal'}"
            rows.append(f"| {label} | {flops / forward / 1e12:.0f} | {3 * flops / both / 1e12:.0f} |")
            print(rows[-1], flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--sections", default="norms,rotary,gated,lora,loss,attention", help="comma-separated, in order")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.manual_seed(0)
    rows = ["| op | elements | forward ps/element | forward + backward ps/element |", "|---|---|---|---|"]
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    sections = {
        "norms": lambda: norms(args.tokens, args.repeats, rows),
        "rotary": lambda: rotary(args.tokens, args.repeats, rows),
        "gated": lambda: gated(args.tokens, args.repeats, rows),
        "lora": lambda: lora(args.tokens, args.repeats, rows),
        "loss": lambda: loss(args.repeats, rows),
        "attention": lambda: attention(args.tokens, args.repeats, rows),
    }
    for name in args.sections.split(","):
        sections[name]()
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
