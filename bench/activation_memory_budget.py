"""One compiled decoder layer of the Llama-3-8B shape with LoRA r16 on its seven projections (PEFT's layers, as
hellbender runs them with `torch_compile`), at several `activation_memory_budget`s: what the forward leaves for
backward and what forward + backward cost, against the same layer checkpointed.

The budget is torch's partitioner setting (`torch._functorch.config.activation_memory_budget`): 1.0 keeps what the
compiler keeps by default; below it, the compiler recomputes in backward the tensors that are cheapest to recompute
per byte (elementwise work first, matmuls last) until the saved tensors fit that fraction of the way from "recompute
everything" to the default. Full checkpointing frees a layer's activations by recomputing its whole forward; the
question is how much a budget frees for how much less time.

    python3 bench/activation_memory_budget.py [--tokens 4096] [--iters 20] [--budgets 1.0,0.9,0.8,0.7,0.6,0.5]

Prints, per setting: milliseconds per forward + backward (median of `--iters`), GiB the forward leaves allocated for
backward, GiB freed against budget 1.0 and milliseconds paid per GiB freed, and the largest gradient difference
against budget 1.0 (max |difference| over max |value|: recomputation in bf16 may round differently).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch._functorch.config as functorch_config

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_kernels import measure, relative_difference  # noqa: E402  (beside this script)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step (rows of 2,048); W1: 4,096")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budgets", default="1.0,0.9,0.8,0.7,0.6,0.5")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; {args.tokens} tokens per step")
    settings = [(f"budget {b}", "compiled", float(b)) for b in args.budgets.split(",")]
    settings.append(("checkpointed", "compiled checkpointed", 1.0))
    results = {}
    for name, mode, budget in settings:
        torch._dynamo.reset()  # each setting compiles afresh under its own budget
        with functorch_config.patch(activation_memory_budget=budget):
            results[name] = measure(False, mode, args.tokens, args.iters)
        torch.cuda.empty_cache()
    reference = results[settings[0][0]]
    print(
        "| setting | ms forward + backward | saved GiB | freed GiB | ms paid per GiB freed | grad diff A / B / input |"
    )
    print("|---|---|---|---|---|---|")
    for name, _, _ in settings:
        r = results[name]
        freed = reference["saved_gib"] - r["saved_gib"]
        paid = (r["ms"] - reference["ms"]) / freed if freed > 0.005 else float("nan")
        diffs = " / ".join(
            f"{relative_difference(r['grads'], reference['grads'], kind):.1e}" for kind in ("lora_A", "lora_B", "input")
        )
        print(f"| {name} | {r['ms']:.2f} | {r['saved_gib']:.3f} | {freed:.3f} | {paid:.1f} | {diffs} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
