"""Training throughput and memory on several GPUs of one machine: DDP and FSDP2 side by side, through
`hellbender.train.run.train` under torchrun, on the Llama-3.2-1B shape of `throughput.py`'s W2 (random weights,
pre-tokenized random rows of 2048 tokens, micro-batch 4 per GPU, activation checkpointing, bf16).

Variants (`--variants`, default all):
  ddp-full              full fine-tune, DDP (every GPU holds the whole model and optimizer state)
  fsdp2-full            full fine-tune, FSDP2 sharded by decoder layer
  fsdp2-full-fp32-norms the same with `fp32_norms: true`
  ddp-lora              LoRA r16 on the seven projections, DDP
  fsdp2-lora            the same LoRA, FSDP2
  cp-lora               the same LoRA, FSDP2 with context parallelism over all the GPUs (each row split over them)
  cp-lora-packed        the same with `sample_packing` (each row one document): hellbender's split attention
                        (gathered keys and values) in place of PyTorch's ring attention
  zero2-full            full fine-tune, DeepSpeed ZeRO-2 (examples/deepspeed/zero2.json; needs the deepspeed package)
  zero3-full            full fine-tune, DeepSpeed ZeRO-3 (examples/deepspeed/zero3.json)

Each variant is one `torchrun --nproc-per-node N` of this script in worker mode; every rank times its own steps
with `throughput.StepRecorder` (steps 1..warm-up left out), rank 0 writes the JSON. tokens/s is per GPU (each
rank's own tokens), peak memory is rank 0's, beside what `hellbender plan` predicts per GPU for the same config on
that card. The parent prints one markdown table.

Run on a machine with N >= 2 GPUs (see bench/README.md): `python3 bench/multi_gpu.py [--gpus 2] [--steps 20]`;
long rows: `--shape W1 --seq 32768 --micro-batch 1 --variants cp-lora` (and `--gpus 1 --variants ddp-lora` for one GPU).
`--tiny --variants ddp-full,ddp-lora` is a CPU smoke check (FSDP2 needs GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import throughput as tp  # noqa: E402  (the sibling benchmark: shapes, model building, step timing)

LORA = dict(adapter="lora", lora_r=16, lora_alpha=32, lora_dropout=0.0, lora_target_modules=list(tp.LORA_TARGETS))
FSDP2 = dict(fsdp_version=2, fsdp_config={"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"})
DEEPSPEED_EXAMPLES = HERE.parent / "examples" / "deepspeed"
VARIANTS: dict[str, dict[str, Any]] = {
    "ddp-full": {},
    "fsdp2-full": FSDP2,
    "fsdp2-full-fp32-norms": {**FSDP2, "fp32_norms": True},
    "ddp-lora": LORA,
    "fsdp2-lora": {**FSDP2, **LORA},
    # context parallelism over all the run's GPUs (`context_parallel_size` set to `--gpus` when the config is made)
    "cp-lora": {**FSDP2, **LORA, "sample_packing": False},
    "cp-lora-packed": {**FSDP2, **LORA, "sample_packing": True},
    "zero2-full": {"deepspeed": str(DEEPSPEED_EXAMPLES / "zero2.json")},
    "zero3-full": {"deepspeed": str(DEEPSPEED_EXAMPLES / "zero3.json")},
}
MICRO_BATCH, ROWS = 4, 1200


def config(
    model: Path, data: Path, workdir: Path, variant: str, steps: int, seq: int, gpus: int, micro_batch: int
) -> dict[str, Any]:
    split = {"context_parallel_size": gpus} if variant.startswith("cp-") else {}
    return {
        "base_model": str(model),
        "datasets": [{"path": str(data), "type": "pretokenized", "ds_type": "jsonl"}],
        "sequence_len": seq,
        "excess_length_strategy": "raise",
        "micro_batch_size": micro_batch,
        "max_steps": steps,
        "learning_rate": 2e-5 if "lora" not in variant else 1e-4,
        "lr_scheduler": "constant",
        "gradient_checkpointing": True,
        "bf16": "auto",
        "save_steps": steps + 1000,
        "logging_steps": steps + 1000,
        "memory_watchdog": "off",
        "seed": tp.SEED,
        "output_dir": str(run_dir(workdir, variant, gpus, seq)),
        "dataset_prepared_path": str(workdir / "prepared"),
        **VARIANTS[variant],
        **split,
    }


def run_dir(workdir: Path, variant: str, gpus: int, seq: int) -> Path:
    """Each setting trains into its own directory, emptied first: hellbender refuses to write over another run."""
    return workdir / "runs" / f"multi-{variant}-{gpus}gpu-{seq}"


def worker(args: argparse.Namespace) -> None:
    """One rank of one variant."""
    import torch

    from hellbender.config import validate_config
    from hellbender.plan.budget import plan_for
    from hellbender.train.run import train

    cfg = validate_config(json.loads(Path(args._config).read_text()))
    rank = int(os.environ.get("RANK", "0"))
    planned = plan_for(cfg, gpus=int(os.environ["WORLD_SIZE"])).memory.peak / tp.GIB if rank == 0 else None
    env = tp.environment()
    recorder = tp.StepRecorder(
        args._variant if rank == 0 else f"{args._variant} rank {rank}",
        args.steps,
        args.warmup,
        tp.peak_tflops(env["device"], None),
        {},
    )
    train(cfg, callbacks=[recorder.callback()])
    if rank == 0:
        result = {"variant": args._variant, "gpus": int(os.environ["WORLD_SIZE"]), **env, **recorder.summary()}
        result["planned_peak_gib"] = planned
        if torch.cuda.is_available():
            result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / tp.GIB
        Path(args._result).write_text(json.dumps(result, indent=1))


def run_variant(
    args: argparse.Namespace, variant: str, model: Path, data: Path, seq: int, log: Path | None = None
) -> dict[str, Any]:
    """One variant's torchrun; its output goes to the console, or to `log` when given."""
    workdir: Path = args.workdir
    config_file = workdir / "results" / f"multi-{variant}.config.json"
    result_file = workdir / "results" / f"multi-{variant}.json"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text(
        json.dumps(config(model, data, workdir, variant, args.steps, seq, args.gpus, args.micro_batch))
    )
    result_file.unlink(missing_ok=True)
    shutil.rmtree(run_dir(workdir, variant, args.gpus, seq), ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.gpus),
        str(Path(__file__).resolve()),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--_variant",
        variant,
        "--_config",
        str(config_file),
        "--_result",
        str(result_file),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    started = time.perf_counter()
    if log is None:
        done = subprocess.run(command, env=env, timeout=args.timeout_s, check=False)
    else:
        with log.open("w") as output:
            done = subprocess.run(command, env=env, timeout=args.timeout_s, check=False, stdout=output, stderr=output)
    if done.returncode != 0 or not result_file.is_file():
        print(f"[{variant}] failed with exit code {done.returncode} (its output is {log or 'above'})", flush=True)
        return {"variant": variant, "ok": False, "wall_s": time.perf_counter() - started}
    return {"ok": True, **json.loads(result_file.read_text()), "wall_s": time.perf_counter() - started}


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | GPUs | tokens/s per GPU | tokens/s total | peak allocated GiB (rank 0) | peak reserved GiB | MFU "
        "| planned peak GiB per GPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.get("ok"):
            lines.append(f"| {r['variant']} | | failed | | | | | |")
            continue
        per_gpu = r["tokens_per_s"]
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
        allocated, reserved = (r.get(k) for k in ("peak_allocated_gib", "peak_reserved_gib"))
        memory = f"{allocated:.1f} | {reserved:.1f}" if allocated is not None else "n/a | n/a"
        planned = r.get("planned_peak_gib")
        lines.append(
            f"| {r['variant']} | {r['gpus']} | {per_gpu:,.0f} | {per_gpu * r['gpus']:,.0f} | {memory} | {mfu} "
            f"| {f'{planned:.1f}' if planned is not None else 'n/a'} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ",".join(VARIANTS))
    p.add_argument("--gpus", type=int, default=2, help="processes (GPUs) per run")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hb-bench"))
    p.add_argument("--timeout-s", type=float, default=600, help="cap of one variant's run")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--tiny", action="store_true", help="toy model and seq 128: a CPU smoke check of the DDP variants")
    p.add_argument("--shape", default="W2", choices=("W1", "W2"), help="throughput.py's model shape (W1: 8B)")
    p.add_argument("--seq", type=int, help="tokens per row (default: the shape's)")
    p.add_argument("--micro-batch", type=int, default=MICRO_BATCH, help="rows per GPU per step")
    for hidden in ("--_variant", "--_config", "--_result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._variant:
        worker(args)
        return
    w = tp.workload(args.shape, tiny=args.tiny)
    seq = args.seq or w.seq
    runner = tp.Runner.for_script(args.workdir, args.tiny)
    if not runner.ensure_model(w):
        raise SystemExit("building the model failed")
    rows = max(ROWS if seq <= 4096 else 0, args.steps * args.micro_batch * args.gpus)
    data = tp.pretokenized_rows(tp.Paths(args.workdir).causal_rows(seq, rows), rows, seq)
    results = [run_variant(args, v, tp.Paths(args.workdir).model(w), data, seq) for v in args.variants.split(",")]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(
        f"\n{results[0].get('device', '?') if results else ''}, torch {results[0].get('torch', '?') if results else ''}"
    )
    print(table(results))


if __name__ == "__main__":
    main()
