"""How close `hellbender plan` comes to what a run measures: predicted against measured peak allocated GPU memory and
median step time, for a few settings of W1 (Llama-3-8B shape, LoRA r16, seq 2048) and W2 (Llama-3.2-1B shape, full
fine-tune), on one GPU.

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
    workload: str  # throughput.py's W1 or W2
    overrides: dict[str, Any] = field(default_factory=dict)


CASES: tuple[Case, ...] = (
    Case("W1-ckpt-all", "W1"),
    Case("W1-ckpt-28", "W1", {"gradient_checkpointing_layers": 28}),
    Case("W1-mb4-ckpt-all", "W1", {"micro_batch_size": 4}),
    Case("W1-offload", "W1", {"gradient_checkpointing": "offload"}),
    Case("W2-ckpt", "W2"),
    Case("W2-mb2-no-ckpt", "W2", {"micro_batch_size": 2, "gradient_checkpointing": False}),
)


def job_for(case: Case, workdir: Path, steps: int) -> throughput.Job:
    w = throughput.workload(case.workload, tiny=False)
    paths = throughput.Paths(workdir)
    rows = steps * w.micro_batch
    return throughput.Job(w, "hellbender", paths, steps, w.seq, paths.causal_rows(w.seq, rows), cuda=True)


def predict(case: Case, job: throughput.Job, card: str) -> dict[str, float]:
    from hellbender.config import validate_config
    from hellbender.plan.budget import plan_for
    from hellbender.plan.memory import GIB

    cfg = validate_config(throughput.hellbender_raw_config(job, case.overrides))
    plan = plan_for(cfg, gpu=card)
    return {"peak_gib": plan.memory.peak / GIB, "step_s": plan.time.seconds, "card": plan.card.name}


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
    for key, value in case.overrides.items():
        command += ["--hb-set", f"{key}={json.dumps(value)}"]
    subprocess.run(command, check=False, timeout=args.case_timeout_s)
    if not out.is_file():
        return {"ok": False}
    results = json.loads(out.read_text())["results"]
    return results[0] if results else {"ok": False}


def write_shapes(workdir: Path, cases: list[Case], steps: int) -> None:
    """For --dry-run: each model's config.json, its tokenizer and the data file, without weights."""
    from transformers import LlamaConfig

    from hellbender.models.tiny import build_tiny_tokenizer

    for case in cases:
        job = job_for(case, workdir, steps)
        LlamaConfig(**job.workload.shape).save_pretrained(job.model_dir)
        build_tiny_tokenizer().save_pretrained(job.model_dir)
        throughput.pretokenized_rows(job.data, steps * job.workload.micro_batch, job.workload.seq)


def ratio(predicted: float | None, measured: float | None) -> str:
    return f"{predicted / measured:.2f}" if predicted and measured else "n/a"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hb-bench"))
    p.add_argument("--case-timeout-s", type=float, default=240)
    p.add_argument("--dry-run", action="store_true", help="predictions only, no GPU (models' config.json only)")
    args = p.parse_args()
    by_name = {c.name: c for c in CASES}
    unknown = [n for n in args.cases.split(",") if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {', '.join(by_name)}")
    cases = [by_name[n] for n in args.cases.split(",")]
    if args.dry_run:
        args.workdir = Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
        os.environ.setdefault("HELLBENDER_CACHE", str(args.workdir / "hellbender-cache"))
        write_shapes(args.workdir, cases, args.steps)
    rows = [
        "| case | settings | predicted peak GiB | measured peak GiB | ratio | predicted step s | measured step s | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    device = "none (dry run)"
    for case in cases:
        measured = {} if args.dry_run else measure(case, args)
        device = measured.get("device", device)
        job = job_for(case, args.workdir, args.steps)
        if not args.dry_run and not measured.get("ok", True):
            rows.append(f"| {case.name} | {case.overrides or 'defaults'} | | failed | | | | |")
            continue
        predicted = predict(case, job, card_of(device) if not args.dry_run else "H100")
        peak, step = measured.get("peak_allocated_gib"), measured.get("step_s")
        rows.append(
            f"| {case.name} | {case.overrides or 'defaults'} | {predicted['peak_gib']:.1f} | "
            f"{f'{peak:.1f}' if peak else 'n/a'} | {ratio(predicted['peak_gib'], peak)} | {predicted['step_s']:.3f} | "
            f"{f'{step:.3f}' if step else 'n/a'} | {ratio(predicted['step_s'], step)} |"
        )
        print(rows[-1], flush=True)
    print(f"\ndevice: {device}; predictions for {card_of(device) if not args.dry_run else 'H100'}\n")
    print("\n".join(rows))
    if args.dry_run:
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
