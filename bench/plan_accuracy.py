"""How close `hellbender plan` comes to what a run measures: predicted against measured peak allocated GPU memory and
median step time, for settings of W1 (Llama-3-8B shape, LoRA r16, seq 2048), W2 (Llama-3.2-1B shape, full
fine-tune), W3 (Gemma-4-E2B shape with its vision tower, LoRA) and W4 (the 8B shape, QLoRA, one long row per step),
on one GPU; and what the planner's `auto` chooses under a memory limit, against a sweep of hand-set settings run
beside it.

Groups of cases (`--cases` takes case or group names): `settings` (the first table: one workload at several
micro-batches, checkpointed layers, offloading and row lengths), `W3-layers` (W3 at more checkpointed layers), `W3-batches` (W3 at micro-batches 1 and 4, every layer checkpointed), `auto-W3-48` (W3 with
every plannable key `auto` under 48 GiB, and one hand-set setting beside the `W3-*` ones measured before), `offload-layers` (W1 with Liger's
kernels and 8 or 16 `activation_offload_layers`, beside the same checkpointing without), `compiled` (the W1 and W2
recipes' compiled layers at settings measured before, and `auto` under the W1 baseline's reserved memory),
`compiled-auto` (`auto` choosing the offloaded layers too, beside the recipe), `W4`
(W4's recipe at 32,768-98,304 tokens, and without `tiled_mlp`), `auto-19` and `auto-40` (W2 with every plannable key
`auto` under `gpu_memory_limit` 19.3 / 40 GiB, and hand-set W2 settings to compare with), `auto-W1-24` (W1 with
Liger's kernels, under 24 GiB) and `auto-W1-30` (W1 under 30 GiB). A W4 case runs `--w4-steps` steps at its one
length; the first is left out as warm-up. A setting fits a limit
when its measured peak *reserved* memory is within it: the limit is what the process may take, and the allocator
reserves more than it hands out (the planner adds its allocator margin for that).

Each setting is one `bench/throughput.py --variants hellbender` invocation (its own process, so no allocator state
carries over; its models, data and measurement conventions: peak from the start of training, median over the steady
steps). The prediction is made afterwards from the same config, on the meta device, for the card the run reported.

Run on a CUDA machine (see bench/README.md), about 4-5 minutes on one H100 (the 8B model is built once, about a
minute, and reused from `--workdir` by later invocations):

    python3 bench/plan_accuracy.py [--cases W1-ckpt-all,W2-ckpt] [--steps 8] [--warmup 3]

`--dry-run` needs no GPU: it writes the models' config.json only and prints the predictions (a check that the script
and the planner run; no measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "src"))

import throughput  # noqa: E402  (beside this script)


@dataclass(frozen=True)
class Case:
    name: str
    workload: str  # throughput.py's W1, W2, W3 or W4
    overrides: dict[str, Any] = field(default_factory=dict)
    seq: int | None = None  # W4: the one sequence length tried (one row per step)


AUTO = {"micro_batch_size": "auto", "gradient_checkpointing": "auto", "gradient_checkpointing_layers": "auto"}
NO_CKPT = {"gradient_checkpointing": False}
LIGER = {
    "liger_rope": True,
    "liger_rms_norm": True,
    "liger_glu_activation": True,
    "liger_fused_linear_cross_entropy": True,
}
# The fast recipes' levers: each decoder layer compiled, the loss fused.
COMPILED = {"torch_compile": True, "liger_fused_linear_cross_entropy": True}
# W4's recipe for long rows: 4-bit base, Liger, each layer's input offloaded, the MLP run in shards.
W4_RECIPE = {"load_in_4bit": True, **LIGER, "gradient_checkpointing": "offload", "tiled_mlp": True}

CASES: tuple[Case, ...] = (
    Case("W1-ckpt-all", "W1"),
    Case("W1-ckpt-28", "W1", {"gradient_checkpointing_layers": 28}),
    Case("W1-mb4-ckpt-all", "W1", {"micro_batch_size": 4}),
    Case("W1-offload", "W1", {"gradient_checkpointing": "offload"}),
    Case("W2-ckpt", "W2"),
    Case("W2-mb2-no-ckpt", "W2", {"micro_batch_size": 2, **NO_CKPT}),
    Case("W2-ckpt-8", "W2", {"gradient_checkpointing_layers": 8}),
    Case("W2-offload", "W2", {"gradient_checkpointing": "offload"}),
    # Two rows of 2,048 tokens packed into each row of 4,096.
    Case("W2-packed-4096-mb2", "W2", {"sequence_len": 4096, "sample_packing": True, "micro_batch_size": 2}),
    Case("W3-packed-mb2", "W3", {"sample_packing": True, "micro_batch_size": 2}),
    Case("W3-packed-mb4-ckpt-17", "W3", {"sample_packing": True, "gradient_checkpointing_layers": 17}),
    Case("W2-auto-19.3", "W2", {**AUTO, "gpu_memory_limit": 19.3}),
    Case("W2-mb1-no-ckpt", "W2", {"micro_batch_size": 1, **NO_CKPT}),
    Case("W2-mb2-ckpt-4", "W2", {"micro_batch_size": 2, "gradient_checkpointing_layers": 4}),
    Case("W2-mb2-ckpt-all", "W2", {"micro_batch_size": 2}),
    Case("W2-mb4-ckpt-12", "W2", {"gradient_checkpointing_layers": 12}),
    Case("W2-auto-40", "W2", {**AUTO, "gpu_memory_limit": 40}),
    Case("W2-mb8-ckpt-all", "W2", {"micro_batch_size": 8}),
    Case("W2-mb8-ckpt-4", "W2", {"micro_batch_size": 8, "gradient_checkpointing_layers": 4}),
    Case("W1-liger-auto-24", "W1", {**LIGER, **AUTO, "gpu_memory_limit": 24}),
    Case("W1-liger-ckpt-24", "W1", {**LIGER, "gradient_checkpointing_layers": 24}),
    Case("W1-liger-ckpt-20", "W1", {**LIGER, "gradient_checkpointing_layers": 20}),
    Case("W1-liger-mb4-ckpt-all", "W1", {**LIGER, "micro_batch_size": 4}),
    Case("W1-auto-30", "W1", {**AUTO, "gpu_memory_limit": 30}),
    Case("W1-ckpt-24", "W1", {"gradient_checkpointing_layers": 24}),
    Case("W1-ckpt-20", "W1", {"gradient_checkpointing_layers": 20}),
    Case("W4-32k", "W4", W4_RECIPE, seq=32_768),
    Case("W4-65k", "W4", W4_RECIPE, seq=65_536),
    Case("W4-98k", "W4", W4_RECIPE, seq=98_304),
    Case("W4-65k-untiled", "W4", {**W4_RECIPE, "tiled_mlp": False}, seq=65_536),
    Case("W4-49k-untiled", "W4", {**W4_RECIPE, "tiled_mlp": False}, seq=49_152),
    Case(
        "W3-packed-mb2-ckpt-17",
        "W3",
        {"sample_packing": True, "micro_batch_size": 2, "gradient_checkpointing_layers": 17},
    ),
    Case("W3-packed-mb4-ckpt-26", "W3", {"sample_packing": True, "gradient_checkpointing_layers": 26}),
    Case("W3-packed-mb1", "W3", {"sample_packing": True, "micro_batch_size": 1}),
    Case("W3-packed-mb4", "W3", {"sample_packing": True}),
    Case("W3-auto-48", "W3", {"sample_packing": True, **AUTO, "gpu_memory_limit": 48}),
    Case("W3-packed-mb4-ckpt-30", "W3", {"sample_packing": True, "gradient_checkpointing_layers": 30}),
    # `auto`'s choice under 48 GiB with the 8% margin, set by hand.
    Case("W3-packed-mb4-ckpt-31", "W3", {"sample_packing": True, "gradient_checkpointing_layers": 31}),
    Case(
        "W1-liger-ckpt-20-offload-8",
        "W1",
        {**LIGER, "gradient_checkpointing_layers": 20, "activation_offload_layers": 8},
    ),
    Case("W1-liger-offload-16", "W1", {**LIGER, "activation_offload_layers": 16}),
    # The fast recipes' compiled layers (memory and step time from the traced layer: compiled_layers.py, compiled_time.py).
    Case("W1-compiled-ckpt-22", "W1", {**COMPILED, "gradient_checkpointing_layers": 22}),
    Case(
        "W1-compiled-budget-0.8-ckpt-16-offload-10",
        "W1",
        {
            **COMPILED,
            "activation_memory_budget": 0.8,
            "gradient_checkpointing_layers": 16,
            "activation_offload_layers": 10,
        },
    ),
    Case(
        "W1-compiled-budget-0.4-ckpt-8",
        "W1",
        {**COMPILED, "activation_memory_budget": 0.4, "gradient_checkpointing_layers": 8},
    ),
    Case(
        "W1-compiled-auto-24.7",
        "W1",
        {
            **COMPILED,
            "activation_memory_budget": 0.8,
            "gradient_checkpointing_layers": "auto",
            "gpu_memory_limit": 24.7,
        },
    ),
    Case("W2-compiled-ckpt-1", "W2", {**COMPILED, "gradient_checkpointing_layers": 1}),
    # `auto` choosing the offloaded layers too (planned for an H200: 16 checkpointed, 12 offloaded).
    Case(
        "W1-compiled-auto-offload-24.7",
        "W1",
        {
            **COMPILED,
            "activation_memory_budget": 0.8,
            "gradient_checkpointing_layers": "auto",
            "activation_offload_layers": "auto",
            "gpu_memory_limit": 24.7,
        },
    ),
)
GROUPS: dict[str, tuple[str, ...]] = {
    "settings": (
        "W1-ckpt-all", "W1-ckpt-28", "W1-mb4-ckpt-all", "W1-offload", "W2-ckpt", "W2-mb2-no-ckpt", "W2-ckpt-8",
        "W2-offload", "W2-packed-4096-mb2", "W3-packed-mb2", "W3-packed-mb4-ckpt-17",
    ),
    "auto-19": ("W2-auto-19.3", "W2-mb1-no-ckpt", "W2-mb2-no-ckpt", "W2-mb2-ckpt-4", "W2-mb2-ckpt-all", "W2-ckpt",
                "W2-mb4-ckpt-12"),
    "auto-40": ("W2-auto-40", "W2-ckpt-8", "W2-mb8-ckpt-all", "W2-mb8-ckpt-4"),
    "auto-W1-24": ("W1-liger-auto-24", "W1-liger-ckpt-24", "W1-liger-ckpt-20", "W1-liger-mb4-ckpt-all"),
    "auto-W1-30": ("W1-auto-30", "W1-ckpt-24", "W1-ckpt-20"),
    "W4": ("W4-32k", "W4-65k", "W4-98k", "W4-65k-untiled", "W4-49k-untiled"),
    "W3-layers": ("W3-packed-mb2-ckpt-17", "W3-packed-mb4-ckpt-26"),
    "W3-batches": ("W3-packed-mb1", "W3-packed-mb4"),
    "auto-W3-48": ("W3-auto-48", "W3-packed-mb4-ckpt-30"),
    "offload-layers": ("W1-liger-ckpt-20-offload-8", "W1-liger-offload-16", "W1-liger-ckpt-20"),
    "compiled": ("W1-compiled-ckpt-22", "W1-compiled-budget-0.8-ckpt-16-offload-10", "W1-compiled-budget-0.4-ckpt-8",
                 "W1-compiled-auto-24.7", "W2-compiled-ckpt-1"),
    "compiled-auto": ("W1-compiled-auto-offload-24.7", "W1-compiled-budget-0.8-ckpt-16-offload-10"),
}  # fmt: skip


def job_for(case: Case, workdir: Path, steps: int) -> throughput.Job:
    w = throughput.workload(case.workload, tiny=False)
    paths = throughput.Paths(workdir)
    seq = case.seq or w.seq
    data = paths.vlm_rows(w) if w.family == "gemma4-vlm" else paths.causal_rows(seq, steps * w.micro_batch)
    return throughput.Job(w, "hellbender", paths, steps, seq, data, cuda=True)


def predict(case: Case, job: throughput.Job, card: str) -> dict[str, Any]:
    """The plan for the case's config on `card`; `auto` keys chosen for that card, as `train` chooses them."""
    from hellbender.config import validate_config
    from hellbender.plan.auto import choose
    from hellbender.plan.budget import plan_for
    from hellbender.plan.memory import GIB

    # Every `auto` case sets `gpu_memory_limit`; the choice is made for this machine's card, as `train` makes it
    # (on a machine without a GPU, `--dry-run`: an H100's speeds, whatever `--card` says).
    cfg = validate_config(throughput.hellbender_raw_config(job, case.overrides), choose_auto=choose)
    plan = plan_for(cfg, gpu=card)
    chosen = throughput.auto_choices(cfg, case.overrides)
    return {
        "peak_gib": plan.memory.peak / GIB,
        "needs_gib": plan.memory.needed / GIB,
        "step_s": plan.time.seconds,
        "card": plan.card.name,
        "chosen": chosen,
    }


def card_of(device: str) -> str:
    from hellbender.plan.cards import CARDS

    for card in sorted(CARDS, key=lambda c: -len(c.name)):
        if card.name.replace("-", " ") in device:
            return card.name
    return "H100"


def measure(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    out = args.workdir / "plan-accuracy" / f"{case.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    command = [sys.executable, str(BENCH / "throughput.py"), "--workloads", case.workload, "--variants", "hellbender"]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--workdir", str(args.workdir)]
    command += ["--json", str(out)]
    if case.seq:  # W4 searches lengths; pin it to the case's one
        seconds = str(args.case_timeout_s)
        command += ["--w4-start", str(case.seq), "--w4-max-seq", str(case.seq), "--w4-steps", str(args.w4_steps)]
        command += ["--w4-budget-s", seconds, "--w4-trial-timeout-s", seconds]
    for key, value in case.overrides.items():
        command += ["--hb-set", f"{key}={json.dumps(value)}"]
    subprocess.run(command, check=False, timeout=args.case_timeout_s)
    if not out.is_file():
        return {"ok": False}
    results = json.loads(out.read_text())["results"]
    return results[0] if results else {"ok": False}


def write_shapes(workdir: Path, cases: list[Case], steps: int) -> None:
    """For --dry-run: each model's config.json, its tokenizer (or processor) and the data, without weights."""
    from transformers import LlamaConfig

    from hellbender.models.tiny import build_tiny_tokenizer

    for case in cases:
        job = job_for(case, workdir, steps)
        w = job.workload
        if w.family == "gemma4-vlm":
            config, processor = throughput.gemma4_vlm_config(w)
            config.save_pretrained(job.model_dir)
            processor.save_pretrained(job.model_dir)
            throughput.vlm_rows(job.data, w.rows, w.image_px)
        else:
            LlamaConfig(**w.shape).save_pretrained(job.model_dir)
            build_tiny_tokenizer().save_pretrained(job.model_dir)
            throughput.pretokenized_rows(job.data, steps * w.micro_batch, job.seq)


def ratio(predicted: float | None, measured: float | None) -> str:
    return f"{predicted / measured:.2f}" if predicted and measured else "n/a"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="settings", help="comma-separated case or group names (default: settings)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hb-bench"))
    p.add_argument("--case-timeout-s", type=float, default=240)
    p.add_argument(
        "--w4-steps", type=int, default=2, help="W4 cases: steps at the case's length (the first is warm-up)"
    )
    p.add_argument(
        "--warm-up-first",
        action="store_true",
        help="run the first case once before the measured ones and discard it: on a freshly started machine the "
        "first W3 process ran at 0.63-0.72x the tokens/s of the same setting after it (docs/plan.md)",
    )
    p.add_argument("--dry-run", action="store_true", help="predictions only, no GPU (models' config.json only)")
    p.add_argument("--card", default="H100", help="--dry-run: the card to predict for (a measured run: its own)")
    args = p.parse_args()
    by_name = {c.name: c for c in CASES}
    names = [n for item in args.cases.split(",") for n in GROUPS.get(item, (item,))]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {', '.join([*GROUPS, *by_name])}")
    cases = [by_name[n] for n in names]
    if args.dry_run:
        args.workdir = Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
        os.environ.setdefault("HELLBENDER_CACHE", str(args.workdir / "hellbender-cache"))
        write_shapes(args.workdir, cases, args.steps)
    rows = [
        "| case | settings (chosen) | predicted peak GiB | measured peak GiB | ratio | predicted need GiB | measured "
        "reserved GiB | predicted step s | measured step s | ratio | measured tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    device = "none (dry run)"
    if args.warm_up_first and not args.dry_run:
        print(f"warm-up: {cases[0].name}, not reported", flush=True)
        measure(cases[0], args)
    for case in cases:
        measured = {} if args.dry_run else measure(case, args)
        device = measured.get("device", device)
        job = job_for(case, args.workdir, args.steps)
        if not args.dry_run and not measured.get("ok", True):
            rows.append(f"| {case.name} | {case.overrides or 'defaults'} | | failed |" + " |" * 7)
            continue
        predicted = predict(case, job, card_of(device) if not args.dry_run else args.card)
        peak, step = measured.get("peak_allocated_gib"), measured.get("step_s")
        reserved, speed = measured.get("peak_reserved_gib"), measured.get("tokens_per_s")
        settings = {k: v for k, v in case.overrides.items() if v != "auto"}
        settings_text = f"{settings or 'defaults'}" + (f" (chose {predicted['chosen']})" if predicted["chosen"] else "")
        rows.append(
            f"| {case.name} | {settings_text} | {predicted['peak_gib']:.1f} | {_num(peak, '.1f')} | "
            f"{ratio(predicted['peak_gib'], peak)} | {predicted['needs_gib']:.1f} | {_num(reserved, '.1f')} | "
            f"{predicted['step_s']:.3f} | {_num(step, '.3f')} | {ratio(predicted['step_s'], step)} | "
            f"{_num(speed, ',.0f')} |"
        )
        print(rows[-1], flush=True)
    print(f"\ndevice: {device}; predictions for {card_of(device) if not args.dry_run else args.card}\n")
    print("\n".join(rows))
    if args.dry_run:
        shutil.rmtree(args.workdir, ignore_errors=True)


def _num(value: float | None, spec: str) -> str:
    return format(value, spec) if value else "n/a"


if __name__ == "__main__":
    main()
