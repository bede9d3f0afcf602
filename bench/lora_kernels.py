"""One decoder layer of the Llama-3-8B shape with LoRA r16 on its seven projections: PEFT's layers against
hellbender's fused LoRA computation (`lora_*_kernel`, src/hellbender/models/fused_lora.py), forward and backward
on one GPU, eager and as hellbender runs it with `torch_compile` (the checkpointed layer compiled).

What it prints, per mode: milliseconds per forward + backward of the layer (median of `--iters`), the fused / PEFT
ratio, the peak memory above the layer's weights, the memory the forward leaves for backward, and how far the fused gradients are from PEFT's (max |difference|
over max |value|, per tensor kind; both in bf16 under autocast, with float32 adapter weights as PEFT keeps them).

    python3 bench/lora_kernels.py [--tokens 4096] [--iters 30] [--modes eager,compiled checkpointed]

Compiled, the fused layers run PEFT's ops (see fused_lora.py), so the compiled rows check that nothing changed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KEYS = ["lora_qkv_kernel", "lora_o_kernel", "lora_mlp_kernel"]
MODES = ("eager", "eager checkpointed", "compiled", "compiled checkpointed")


def build_layer(fused: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from hellbender.models.fused_lora import enable_lora_kernels, register_fused_lora

    config = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16)
        rotary = LlamaRotaryEmbedding(config)

    class Holder(torch.nn.Module):  # PEFT adapts a model; the layer is its only child
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=PROJECTIONS, init_lora_weights=False)
    if fused:
        register_fused_lora(lora)
    torch.manual_seed(1)
    model = get_peft_model(Holder(), lora)  # the adapter in float32, as PEFT keeps it over a bf16 base
    if fused:
        enable_lora_kernels(model, KEYS)
    return model.base_model.model.layer, rotary


def step_function(layer: torch.nn.Module, rotary: torch.nn.Module, tokens: int, mode: str,
                  compile_mode: str | None = None) -> Any:  # fmt: skip
    from torch.utils.checkpoint import checkpoint

    rows = tokens // 2048
    positions = torch.arange(2048, device="cuda")[None].expand(rows, -1)
    probe = torch.empty(rows, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    embeddings = rotary(probe, positions)

    def run(hidden: torch.Tensor) -> torch.Tensor:
        if not mode.endswith("checkpointed"):
            return layer(hidden, position_embeddings=embeddings)
        return checkpoint(layer, hidden, position_embeddings=embeddings, use_reentrant=False)

    return torch.compile(run, mode=compile_mode) if mode.startswith("compiled") else run


def measure(fused: bool, mode: str, tokens: int, iters: int, compile_mode: str | None = None) -> dict[str, Any]:
    """`compile_mode`: torch.compile's mode for the compiled modes (None: its default)."""
    layer, rotary = build_layer(fused)
    call = step_function(layer, rotary, tokens, mode, compile_mode)
    torch.manual_seed(2)
    hidden = torch.randn(tokens // 2048, 2048, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randn_like(hidden)

    def once() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = call(hidden)
        (out.float() * target.float()).mean().backward()

    for _ in range(3):
        once()
    saved = saved_between_forward_and_backward(call, hidden)
    layer.zero_grad(set_to_none=True)
    hidden.grad = None
    once()  # the gradients compared below: one step from zero
    grads = {"input": hidden.grad.detach().clone()}
    for name, p in layer.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.detach().clone()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    floor = torch.cuda.memory_allocated()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - floor) / 2**30
    return {"ms": statistics.median(times), "peak_gib": peak, "saved_gib": saved, "grads": grads}


def saved_between_forward_and_backward(call: Any, hidden: torch.Tensor) -> float:
    """GiB the forward leaves allocated for backward (its output aside): what each such layer holds in a model."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = call(hidden)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    out.float().mean().backward()
    return held / 2**30


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], kind: str) -> float:
    names = [n for n in a if (kind in n if kind != "input" else n == "input")]
    worst = 0.0
    for n in names:
        scale = b[n].float().abs().max().item() or 1.0
        worst = max(worst, (a[n].float() - b[n].float()).abs().max().item() / scale)
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step (rows of 2,048); W1: 4,096")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; {args.tokens} tokens per step")
    print(
        "| mode | PEFT ms | fused ms | fused / PEFT time | PEFT peak GiB | fused peak GiB | PEFT saved GiB "
        "| fused saved GiB | grad diff A / B / input |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        peft = measure(False, mode, args.tokens, args.iters)
        torch.cuda.empty_cache()
        fused = measure(True, mode, args.tokens, args.iters)
        torch.cuda.empty_cache()
        diffs = " / ".join(
            f"{relative_difference(fused['grads'], peft['grads'], kind):.1e}" for kind in ("lora_A", "lora_B", "input")
        )
        print(
            f"| {mode} | {peft['ms']:.2f} | {fused['ms']:.2f} | {fused['ms'] / peft['ms']:.3f} "
            f"| {peft['peak_gib']:.2f} | {fused['peak_gib']:.2f} | {peft['saved_gib']:.3f} | {fused['saved_gib']:.3f} "
            f"| {diffs} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
