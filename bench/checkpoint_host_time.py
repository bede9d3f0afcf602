"""The host's time for hellbender's activation checkpointing, per checkpointed layer, against the layer's forward.

A model of the W2 layout (16 Llama decoder layers; `--family gemma4`: Gemma-4-E2B's) at toy width, so that the step's
time is the host's (Python, autograd and the dispatcher; with CUDA, kernel launches) and not the kernels'. Each
setting trains the same step repeatedly: no checkpointing, the first N layers checkpointed, every layer. Printed per
setting: the median forward and backward times and the ATen operations each runs; then, fitted over the checkpointed
settings, the host time one checkpointed layer adds, its ratio to one layer's forward, and what it adds beyond that
forward (the replay's launches aside: packing, unpacking, the autograd graph built again). `hellbender plan` prices
that excess per checkpointed layer as measured on an H200 machine, `flops.CHECKPOINT_HOST_SECONDS` (docs/plan.md,
"Checkpointing's host work").

    python3 bench/checkpoint_host_time.py [--device cuda] [--family gemma4] [--lora] [--repeats 15] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

LAYERS = 16
SETTINGS: tuple[int, ...] = (0, 4, 8, 16)  # checkpointed layers (0: none)


class CountOperations(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def toy_model(layers: int, device: str, family: str = "llama") -> Any:
    """A decoder of `layers` layers at toy width (0: embedding, final norm, head and loss only): a Llama, or a Gemma 4
    text model laid out as Gemma-4-E2B (4 sliding-window layers to 1 full-attention layer, per-layer inputs, the
    upper layers reading shared keys and values)."""
    torch.manual_seed(0)
    if family == "gemma4":
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        config = Gemma4TextConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, global_head_dim=32, vocab_size=256, vocab_size_per_layer_input=256,
            hidden_size_per_layer_input=16, sliding_window=8, num_kv_shared_layers=layers * 4 // 7,
            layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)],
            tie_word_embeddings=True,
        )  # fmt: skip
        return Gemma4ForCausalLM(config).to(device=device, dtype=torch.bfloat16).train()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).train()


def build(checkpointed: int, device: str, family: str, lora: bool = False) -> Any:
    """The toy model, with `lora` PEFT's LoRA (r 16) on every linear layer of its decoder as hellbender applies it
    (before checkpointing), and its first `checkpointed` layers checkpointed."""
    from hellbender.models.activation_checkpointing import enable_activation_checkpointing

    model = toy_model(LAYERS, device, family)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    if checkpointed:
        enable_activation_checkpointing(model, layers=checkpointed)
    return model


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(model: Any, ids: torch.Tensor, repeats: int, device: str) -> tuple[float, float]:
    """Median forward and backward seconds over `repeats` steps (after one warm-up step)."""
    forwards, backwards = [], []
    for index in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        synchronize(device)
        middle = time.perf_counter()
        loss.backward()
        synchronize(device)
        if index:
            forwards.append(middle - start)
            backwards.append(time.perf_counter() - middle)
        model.zero_grad(set_to_none=True)
    return statistics.median(forwards), statistics.median(backwards)


def count_operations(model: Any, ids: torch.Tensor) -> tuple[int, int]:
    with CountOperations() as forward:
        loss = model(input_ids=ids, labels=ids).loss
    with CountOperations() as backward:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return forward.count, backward.count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--family", choices=("llama", "gemma4"), default="llama", help="the toy decoder's layout")
    parser.add_argument("--lora", action="store_true", help="LoRA r16 on every linear layer of the decoder")
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per setting and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the settings, interleaved")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # toy tensors: threads only add their own overhead
    ids = torch.zeros(1, 16, dtype=torch.long, device=args.device)
    models = {n: build(n, args.device, args.family, args.lora) for n in SETTINGS}
    times: dict[int, list[tuple[float, float]]] = {n: [] for n in SETTINGS}
    for _ in range(args.rounds):
        for n, model in models.items():
            times[n].append(time_steps(model, ids, args.repeats, args.device))
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU, one thread"
    print(
        f"device: {name}; torch {torch.__version__}; {LAYERS} {args.family} layers{' with LoRA' if args.lora else ''}, "
        f"medians of {args.repeats} steps x {args.rounds}"
    )
    print("| checkpointed layers | forward ms | backward ms | step ms | forward ops | backward ops |")
    print("|---|---|---|---|---|---|")
    step: dict[int, float] = {}
    forward: dict[int, float] = {}
    for n in SETTINGS:
        f = statistics.median(t[0] for t in times[n])
        b = statistics.median(t[1] for t in times[n])
        step[n], forward[n] = f + b, f
        ops = count_operations(models[n], ids)
        print(f"| {n} | {f * 1e3:.2f} | {b * 1e3:.2f} | {(f + b) * 1e3:.2f} | {ops[0]} | {ops[1]} |")
    # Least squares over the checkpointed settings: step = fixed + per_layer x n.
    counts = [n for n in SETTINGS if n]
    mean_n = statistics.mean(counts)
    mean_t = statistics.mean(step[n] - step[0] for n in counts)
    per_layer = sum((n - mean_n) * (step[n] - step[0] - mean_t) for n in counts) / sum(
        (n - mean_n) ** 2 for n in counts
    )
    fixed = mean_t - per_layer * mean_n
    # One layer's forward: the forward without checkpointing less what runs outside the layers (a model of none).
    outside = time_steps(toy_model(0, args.device, args.family), ids, args.repeats, args.device)[0]
    layer_forward = (forward[0] - outside) / LAYERS
    print(
        f"one checkpointed layer adds {per_layer * 1e3:.3f} ms (a fixed {fixed * 1e3:.2f} ms besides); one layer's "
        f"forward {layer_forward * 1e3:.3f} ms; ratio {per_layer / layer_forward:.2f}; beyond the forward "
        f"{(per_layer - layer_forward) * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    main()
