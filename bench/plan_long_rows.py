"""`hellbender plan`'s predictions for the long-row runs of docs/multi-gpu.md against what those runs measured.

The runs (`bench/multi_gpu.py --shape W1 --micro-batch 1`, `bench/longest_row.py`; two NVIDIA H200s, 2026-11-27/28)
trained the Llama-3-8B shape with LoRA r16 on the seven projections, one row per step, every layer checkpointed, bf16,
on one GPU or with `context_parallel_size: 2` over two. Their measurements are recorded below; the predictions are
made here from the same configs on the meta device, so this needs no GPU:

    python3 bench/plan_long_rows.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "src"))

import multi_gpu  # noqa: E402  (the runs' configs)
import throughput  # noqa: E402  (the model shape)

# (variant, GPUs, tokens per row, measured tokens/s per GPU, measured peak allocated GiB per GPU); None: out of memory
MEASURED = (
    ("ddp-lora", 1, 32_768, 5_232, 71.0),
    ("cp-lora", 2, 32_768, 5_000, 36.5),
    ("ddp-lora", 1, 65_536, 3_865, 126.5),
    ("cp-lora", 2, 65_536, 3_768, 64.2),
    ("ddp-lora", 1, 69_632, 3_702, 133.4),
    ("cp-lora", 2, 143_360, 2_343, 130.1),
    ("ddp-lora", 1, 73_728, None, None),
    ("cp-lora", 2, 147_456, None, None),
)


def ratio(predicted: float, measured: float | None) -> str:
    return f"{predicted / measured:.2f}" if measured else "n/a"


def main() -> None:
    from transformers import LlamaConfig

    from hellbender.config import validate_config
    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.plan.budget import plan_for
    from hellbender.plan.memory import GIB

    workdir = Path(tempfile.mkdtemp(prefix="plan-long-rows-"))
    model, data = workdir / "llama3-8b", workdir / "rows.jsonl"
    LlamaConfig(**throughput.workload("W1", tiny=False).shape).save_pretrained(model)  # the shape, no weights
    build_tiny_tokenizer().save_pretrained(model)
    data.write_text('{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}\n')
    print(
        "| setting | tokens per row | peak GiB predicted / measured | ratio | tokens/s per GPU predicted / measured |",
        end="",
    )
    print(" ratio | plan: fits an H200 | trained |")
    print("|---|---|---|---|---|---|---|---|")
    for variant, gpus, seq, speed, peak in MEASURED:
        cfg = validate_config(multi_gpu.config(model, data, workdir, variant, 4, seq, gpus, 1))
        plan = plan_for(cfg, gpu="H200", gpus=gpus)
        predicted_peak, predicted_speed = plan.memory.peak / GIB, plan.time.tokens_per_second
        setting = "one GPU" if gpus == 1 else f"`context_parallel_size: {gpus}`"
        print(
            f"| {setting} | {seq:,} | {predicted_peak:.1f} / {peak or '-'} | {ratio(predicted_peak, peak)} | "
            f"{predicted_speed:,.0f} / {f'{speed:,}' if speed else '-'} | {ratio(predicted_speed, speed)} | "
            f"{'yes' if plan.fits else 'no'} | {'yes' if peak else 'out of memory'} |"
        )


if __name__ == "__main__":
    main()
