"""Online distillation throughput and memory, with and without the chunked distillation loss (`kd_fused_loss`).

GPU command (one H100 or H200; `.whl/` carried along), both variants in one invocation, about 6 minutes with fresh
model builds:

    bash bench/setup_gpu.sh > /tmp/pythonpath && . /tmp/pythonpath && export PYTHONUNBUFFERED=1 &&
    python3 bench/distillation_throughput.py --json $OUT/kd.json 2>&1 | tee $OUT/kd.log

CPU smoke check (toy models): `python bench/distillation_throughput.py --tiny --workdir /tmp/SOMEWHERE`.

Workload: bench/throughput.py's W2 as the student (Llama-3.2-1B shape, full fine-tuning, AdamW, seq 2048,
micro-batch 4, hellbender's activation checkpointing, pre-tokenized rows) and W1's Llama-3-8B shape (random weights,
bf16, SDPA) as an online teacher (`kd_teacher_model`, top `--top-k` 64 per position, `kd_alpha` 0.9, `kd_ce_alpha`
0.1). Both share the tiny tokenizer, so the teacher's top-k comes from the tokenizer's 512 ids while the student's
softmax runs over its whole 128,256-token vocabulary. The two variants differ in one key only:
  unfused  `kd_fused_loss: false`: the student's forward returns its [tokens x 128,256] logits, the teacher's too.
  fused    `kd_fused_loss: true`: both stop at their last hidden states and project them a chunk at a time.
Each variant trains in its own subprocess of bench/throughput.py (its step recorder, its model builds under
`--workdir`, shared with throughput.py's W1 and W2), so no allocator state carries over.

Measurements are throughput.py's: tokens/s over the steady steps (student tokens; the teacher's forward on the same
tokens is part of the step time), peak allocated / reserved GPU memory from the first step to the last, and MFU of
the student's work alone (the teacher's forward, 2 x 8B FLOPs per token, is not credited).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import throughput as tp  # noqa: E402

VARIANTS = {"unfused": False, "fused": True}


def kd_keys(teacher: Path, top_k: int, fused: bool) -> list[str]:
    return [
        "kd_trainer=true",
        f"kd_teacher_model={teacher}",
        f"kd_online_topk={top_k}",
        "kd_alpha=0.9",
        "kd_ce_alpha=0.1",
        f"kd_fused_loss={str(fused).lower()}",
    ]


def runner_for(args: argparse.Namespace, paths: tp.Paths, hb_set: list[str]) -> tp.Runner:
    """A throughput.py runner whose children add `hb_set` to the student's hellbender config."""
    return tp.Runner.for_script(paths.workdir, args.tiny, args.peak_tflops, hb_set)


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| variant | tokens/s | step s | peak alloc GiB | peak reserved GiB | student MFU |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if not r.get("ok"):
            lines.append(f"| {name} | failed: {r.get('reason', '?')} | | | | |")
            continue
        lines.append(
            f"| {name} | {tp.fmt(r.get('tokens_per_s'), ',.0f')} | {tp.fmt(r.get('step_s'), '.3f')} | "
            f"{tp.fmt(r.get('peak_allocated_gib'), '.1f')} | {tp.fmt(r.get('peak_reserved_gib'), '.1f')} | "
            f"{tp.fmt(r.get('mfu'), '.1%')} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hb-bench"), help="models, data, runs (reused)")
    p.add_argument("--steps", type=int, help="optimizer steps per variant (default 25; --tiny: 6)")
    p.add_argument("--warmup", type=int, help="steps left out of the medians (default 5; --tiny: 2)")
    p.add_argument("--top-k", type=int, default=64, help="the teacher's targets per position")
    p.add_argument("--variants", default="unfused,fused", help="comma-separated, from unfused,fused")
    p.add_argument("--tiny", action="store_true", help="toy-sized models (CPU without a GPU)")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the card, if its name is not known")
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    p.add_argument("--child-timeout-s", type=float, default=600, help="wall-clock cap of one training subprocess")
    args = p.parse_args()
    steps = args.steps or (6 if args.tiny else 25)
    warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 5)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants takes {', '.join(VARIANTS)}")
    if not args.tiny and not tp.cuda_available():
        raise SystemExit("CUDA is not available: use --tiny for a CPU smoke check.")
    paths = tp.Paths(args.workdir)
    student, teacher = tp.workload("W2", args.tiny), tp.workload("W1", args.tiny)
    builder = runner_for(args, paths, [])
    if not (builder.ensure_model(teacher) and builder.ensure_model(student)):
        raise SystemExit("building the models failed (the output is above)")
    rows = steps * student.micro_batch
    data = tp.pretokenized_rows(paths.causal_rows(student.seq, rows), rows, student.seq)
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for name in variants:
        runner = runner_for(args, paths, kd_keys(paths.model(teacher), args.top_k, VARIANTS[name]))
        print(f"[{name}] student {student.title}, teacher {teacher.title.split(',')[0]}", flush=True)
        results[name] = runner.train(
            student, "hellbender", steps, warmup, student.seq, data, timeout=args.child_timeout_s
        )
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))
    env = tp.environment_of(list(results.values()))
    print(
        f"\ndevice: {env.get('device', '?')}; torch {env.get('torch', '?')}, transformers "
        f"{env.get('transformers', '?')}; {steps} steps, medians over steps {warmup + 1}..{steps}; online KD, "
        f"top-{args.top_k}{'; --tiny (toy models)' if args.tiny else ''}\n"
    )
    print(table(results))
    done = [r for r in results.values() if r.get("ok")]
    if len(done) == 2:
        unfused, fused = results["unfused"], results["fused"]
        print(
            f"\nfused / unfused: {fused['tokens_per_s'] / unfused['tokens_per_s']:.2f}x tokens/s, peak allocated "
            f"{fused['peak_allocated_gib'] - unfused['peak_allocated_gib']:+.1f} GiB"
            if unfused.get("tokens_per_s") and unfused.get("peak_allocated_gib") is not None
            else ""
        )
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0 if len(done) == len(variants) else 1


if __name__ == "__main__":
    sys.exit(main())
