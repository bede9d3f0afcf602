"""The longest row that trains: the Llama-3-8B shape (throughput.py's W1, random weights), LoRA r16 on the seven
projections, one row per step, activation checkpointing, bf16, on one GPU alone against `context_parallel_size: N`
over N GPUs of one machine (FSDP2), through `multi_gpu.py`'s runs.

Each probe is one short run (`--steps` steps) at one row length; a run that stops with CUDA's out-of-memory error
did not fit, any other failure stops the search. The first probe is predicted from the card's memory and the
per-token slope measured on two H200s (docs/multi-gpu.md: 1.694 GiB per 1,000 tokens on one GPU above 16.8 GiB, 0.845
above 8.8 GiB split over two); the search then steps by `--granularity` tokens until it has a length that fits next
to one that does not. Prints one markdown table of every probe.

Run on a machine with N >= 2 GPUs: `python3 bench/longest_row.py [--gpus 2] [--granularity 4096]`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import multi_gpu  # noqa: E402  (the runs)
import throughput as tp  # noqa: E402  (the model shape and the rows)

# Peak allocated GiB = fixed + per 1,000 tokens x thousands of tokens, measured on two H200s (docs/multi-gpu.md).
SLOPES = {"one GPU": (16.8, 1.694), "split": (8.8, 0.845)}
OUT_OF_MEMORY = ("OutOfMemoryError", "CUDA out of memory")


def card_gib() -> float:
    """The first GPU's memory, read without a CUDA context in this process (it would take memory from rank 0)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip()) / 1024


def probe(args: argparse.Namespace, setting: str, seq: int, model: Path) -> dict[str, Any]:
    gpus = 1 if setting == "one GPU" else args.gpus
    variant = "ddp-lora" if setting == "one GPU" else "cp-lora"
    run_args = argparse.Namespace(
        gpus=gpus, steps=args.steps, warmup=args.warmup, micro_batch=1, workdir=args.workdir, timeout_s=args.timeout_s
    )
    data = tp.pretokenized_rows(tp.Paths(args.workdir).causal_rows(seq, args.steps * gpus), args.steps * gpus, seq)
    log = args.workdir / "results" / f"longest-{variant}-{gpus}gpu-{seq}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{setting}] {seq:,} tokens per row ...", flush=True)
    result = multi_gpu.run_variant(run_args, variant, model, data, seq, log=log)
    output = log.read_text(errors="replace")
    if not result["ok"] and not any(marker in output for marker in OUT_OF_MEMORY):
        print(output[-4000:])
        raise SystemExit(f"[{setting}] {seq} tokens failed without running out of memory: see {log}")
    return {"setting": setting, "gpus": gpus, "seq": seq, **result}


def search(args: argparse.Namespace, setting: str, model: Path, memory: float) -> list[dict[str, Any]]:
    fixed, per_thousand = SLOPES[setting]
    step = args.granularity
    seq = args.start or max(step, int((memory - fixed) / per_thousand * 1000) // step * step)
    probes = [probe(args, setting, seq, model)]
    direction = step if probes[0]["ok"] else -step
    while len(probes) < args.max_probes and seq + direction > 0:
        seq += direction
        probes.append(probe(args, setting, seq, model))
        if probes[-1]["ok"] != probes[-2]["ok"]:
            break
    return probes


def table(probes: list[dict[str, Any]], memory: float) -> str:
    lines = [
        f"card memory {memory:.1f} GiB",
        "| setting | GPUs | tokens per row | trained | tokens/s per GPU | peak allocated GiB per GPU |",
        "|---|---|---|---|---|---|",
    ]
    for p in probes:
        speed = f"{p['tokens_per_s']:,.0f}" if p["ok"] else ""
        peak = f"{p['peak_allocated_gib']:.1f}" if p["ok"] else ""
        lines.append(
            f"| {p['setting']} | {p['gpus']} | {p['seq']:,} | {'yes' if p['ok'] else 'out of memory'} | {speed} | {peak} |"
        )
    for setting in SLOPES:
        fits = [p["seq"] for p in probes if p["setting"] == setting and p["ok"]]
        lines.append(f"longest that trained, {setting}: {max(fits):,} tokens" if fits else f"{setting}: none fitted")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="context_parallel_size (the GPUs of the split runs)")
    p.add_argument("--granularity", type=int, default=4096, help="tokens between probes (a multiple of 2 x --gpus)")
    p.add_argument("--max-probes", type=int, default=3, help="probes per setting")
    p.add_argument("--start", type=int, help="the first probe's tokens per row (default: predicted from the card)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--settings", default="one GPU,split", help="comma-separated: 'one GPU', 'split'")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hb-bench"))
    p.add_argument("--timeout-s", type=float, default=600)
    args = p.parse_args()
    w = tp.workload("W1", tiny=False)
    runner = tp.Runner.for_script(args.workdir)
    if not runner.ensure_model(w):
        raise SystemExit("building the model failed")
    memory = card_gib()
    probes = [
        found
        for setting in args.settings.split(",")
        for found in search(args, setting, tp.Paths(args.workdir).model(w), memory)
    ]
    print(table(probes, memory))


if __name__ == "__main__":
    main()
