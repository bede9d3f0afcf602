"""Where GRPO's generation time and memory go: one `generate` call of W6's shape (bench/grpo_throughput.py), timed
with each way hellbender or TRL can decode, on the same model, prompts and sampling settings.

GPU command (one H100 or H200; `.whl/` carried along for Liger, which the `--liger` children import), about 7 minutes
with the compilations:

    bash bench/setup_gpu.sh > /tmp/pythonpath && . /tmp/pythonpath && export PYTHONUNBUFFERED=1 &&
    python3 bench/grpo_generation.py 2>&1 | tee $OUT/generation.log

The model is W2's Llama-3.2-1B shape (bench/throughput.py) with random bf16 weights, built on the GPU, with PEFT LoRA
r16 alpha 32 on every linear layer (`lora_B` drawn at std 0.02, so the adapter is not a no-op), in training mode as TRL
generates with it. `--rows` (64) prompts of `--prompt-len` (256) random token ids each generate exactly `--new` (256)
tokens (`min_new_tokens`), sampled at temperature 1.0 (TRL's defaults: top_p 1.0, top_k 0). Each variant generates
once to warm up (and compile), then `--repeats` (2) times; the table gives the median seconds per call, milliseconds
per new token, and the peak allocated memory during the timed calls above what was allocated before them.

Variants, in one process (`--liger` empty):
  eager              TRL's default: dynamic cache, no compilation (the baseline of W6)
  eager, merged      the same with the adapter merged into the base weights (PEFT's `merge_adapter`): what PEFT's
                     per-projection LoRA layers cost; not offered by hellbender (in bf16, merging rounds the adapter's
                     small update away, so the sampling policy would not be the trained one)
  compiled           static cache and transformers' compiled decoding step (torch.compile, CUDA graphs)
  compiled, chunked  the same with the prompts read into the cache `PREFILL_CHUNK_TOKENS` positions at a time:
                     hellbender's `trl.compile_generation`
Then each `--liger` set (default `rope` and `rms_norm,swiglu`) in a child process of its own (Liger patches the model
classes for the whole process): eager and compiled, with those Liger kernels applied.

`--profile` instead times only hellbender's decoding (compiled, chunked prefill) at each `--rows` value given
(comma-separated, one child each: every shape compiles anew) and `--shape` (`1b`, or `8b` for W1's Llama-3-8B
shape), and profiles one timed call: the GPU's kernel time per new token (the union of the kernels' intervals) against
the wall time per token, the kernels launched per token, and the kernels that took the most time. What the planner's
model of generation is fitted to (docs/plan.md, "Online RL").
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

GIB = 2**30


def build(liger: list[str], shape: str = "1b") -> Any:
    import throughput as tp
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(
            rope="rope" in liger, rms_norm="rms_norm" in liger, swiglu="swiglu" in liger, cross_entropy=False,
            fused_linear_cross_entropy=False,
        )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(**(tp.LLAMA32_1B if shape == "1b" else tp.LLAMA3_8B)),
            dtype=torch.bfloat16,
            attn_implementation="sdpa",
        )
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.02)
    return model.train()


def measure(name: str, generate: Callable[[], Any], repeats: int, new_tokens: int) -> dict[str, Any]:
    import torch

    generate()  # warm-up; compiles where the variant compiles
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        generate()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds)
    row = dict(
        variant=name, s=median, ms_per_token=1000 * median / new_tokens,
        peak_gib=(torch.cuda.max_memory_allocated() - before) / GIB,
    )  # fmt: skip
    print(f"| {name} | {median:.2f} | {row['ms_per_token']:.1f} | {row['peak_gib']:.2f} |", flush=True)
    return row


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import GenerationConfig

    from hellbender.config.rl import PREFILL_CHUNK_TOKENS

    liger = [k for k in args.liger.split(",") if k]
    model = build(liger, args.shape)
    prompts = torch.randint(0, 128_000, (args.rows, args.prompt_len), device="cuda")
    mask = torch.ones_like(prompts)
    sampling = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=True, temperature=1.0, top_p=1.0,
                    top_k=0, pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
    eager = GenerationConfig(**sampling, disable_compile=True)
    compiled = GenerationConfig(**sampling, cache_implementation="static", disable_compile=False)
    chunked = GenerationConfig(
        **sampling, cache_implementation="static", disable_compile=False, prefill_chunk_size=PREFILL_CHUNK_TOKENS
    )

    def generate(config: Any) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return model.generate(input_ids=prompts, attention_mask=mask, generation_config=config)

        return call

    if args.profile:
        profile_decoding(generate(chunked), args)
        return
    suffix = f", Liger {'+'.join(liger)}" if liger else ""
    measure("eager" + suffix, generate(eager), args.repeats, args.new)
    if not liger:
        model.merge_adapter()
        measure("eager, merged", generate(eager), args.repeats, args.new)
        model.unmerge_adapter()
    measure("compiled" + suffix, generate(compiled), args.repeats, args.new)
    if not liger:
        measure(f"compiled, chunked prefill ({PREFILL_CHUNK_TOKENS})", generate(chunked), args.repeats, args.new)


def profile_decoding(generate: Callable[[], Any], args: argparse.Namespace) -> None:
    """One timed `generate` under the profiler after a warm-up: wall and GPU kernel time per new token, kernels per
    token and the top kernels by total time."""
    import throughput as tp
    import torch

    generate()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        generate()
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    peak = (torch.cuda.max_memory_allocated() - before) / GIB
    kernels = [
        e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0
    ]
    busy = tp.busy_time(sorted((e.time_range.start, e.time_range.end) for e in kernels))
    totals: dict[str, list[float]] = {}
    for e in kernels:
        totals.setdefault(e.name, []).append(e.time_range.elapsed_us())
    print(
        f"| {args.shape} | {args.rows} | {args.prompt_len} + {args.new} | {1000 * wall / args.new:.2f} | "
        f"{busy / 1000 / args.new:.2f} | {len(kernels) / args.new:.0f} | {peak:.2f} |",
        flush=True,
    )
    for name, times in sorted(totals.items(), key=lambda item: -sum(item[1]))[:8]:
        print(f"  {sum(times) / 1000 / args.new:7.3f} ms/token  {len(times) / args.new:5.1f}/token  {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--liger", default=None, help="in a child: the Liger kernels to apply (comma-separated)")
    parser.add_argument("--shape", default="1b", choices=("1b", "8b"))
    parser.add_argument("--profile", action="store_true", help="profile hellbender's decoding (see above)")
    parser.add_argument("--rows-list", default=None, help="with --profile: the --rows values, comma-separated")
    parser.add_argument("--liger-sets", default="rope;rms_norm,swiglu", help="the Liger sets, each its own child")
    args = parser.parse_args()
    if args.liger is not None:
        child(args)
        return
    import torch

    if args.profile:
        print(f"{torch.cuda.get_device_name()}; hellbender's decoding (compiled, chunked prefill), one profiled call")
        print(
            "| shape | rows | prompt + new | wall ms/token | GPU busy ms/token | kernels/token | peak above before, GiB |"
        )
        print("|---|---|---|---|---|---|---|", flush=True)
        for rows in (args.rows_list or str(args.rows)).split(","):
            common = ["--rows", rows, "--prompt-len", str(args.prompt_len), "--new", str(args.new)]
            subprocess.run([sys.executable, __file__, *common, "--shape", args.shape, "--profile", "--liger", ""],
                           check=True)  # fmt: skip
        return
    print(f"{torch.cuda.get_device_name()}; {args.rows} rows x {args.prompt_len} prompt tokens, {args.new} new tokens")
    print("| variant | s per generate | ms per new token | peak above before, GiB |\n|---|---|---|---|", flush=True)
    common = ["--rows", str(args.rows), "--prompt-len", str(args.prompt_len), "--new", str(args.new)]
    for liger in ["", *[s for s in args.liger_sets.split(";") if s]]:
        subprocess.run(
            [sys.executable, __file__, *common, "--repeats", str(args.repeats), "--liger", liger], check=True
        )


if __name__ == "__main__":
    main()
