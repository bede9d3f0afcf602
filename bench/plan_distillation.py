"""`hellbender plan`'s predictions for the online distillation runs of docs/benchmarks.md against what they measured.

The runs (`bench/distillation_throughput.py`; one NVIDIA H200, 2026-11-29, the loss without its per-chunk host
waits) trained W2's student (Llama-3.2-1B shape, full fine-tuning, AdamW, seq 2048, micro-batch 4, every layer
checkpointed, bf16) from W1's Llama-3-8B shape as `kd_teacher_model` (top 64, `kd_alpha` 0.9, `kd_ce_alpha` 0.1),
with `kd_fused_loss` false and true. Their
measurements are recorded below; the predictions are made here from the same configs on the meta device (the models'
config.json files only), so this needs no GPU:

    python3 bench/plan_distillation.py [--gpu H200]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "src"))

import distillation_throughput as kd  # noqa: E402  (the runs' distillation keys)
import throughput  # noqa: E402  (the shapes and the student's config)

# (`kd_fused_loss`, measured seconds per step, measured peak allocated GiB), docs/benchmarks.md
MEASURED = ((False, 0.490, 42.1), (True, 0.488, 26.4))
TOP_K = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="H200", help="the card to plan for (the runs': H200)")
    args = parser.parse_args()

    from transformers import LlamaConfig

    from hellbender.config import validate_config
    from hellbender.models.tiny import build_tiny_tokenizer
    from hellbender.plan.budget import plan_for
    from hellbender.plan.memory import GIB

    paths = throughput.Paths(Path(tempfile.mkdtemp(prefix="plan-distillation-")))
    student, teacher = throughput.workload("W2", tiny=False), throughput.workload("W1", tiny=False)
    for workload in (student, teacher):  # the shapes, no weights; both with the runs' tiny tokenizer
        LlamaConfig(**workload.shape).save_pretrained(paths.model(workload))
        build_tiny_tokenizer().save_pretrained(paths.model(workload))
    data = paths.causal_rows(student.seq, 1)
    data.parent.mkdir(parents=True)
    data.write_text('{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}\n')
    job = throughput.Job(student, "hellbender", paths, steps=15, seq=student.seq, data=data, cuda=True)
    print(f"Predicted on {args.gpu} against the measured run on one H200:\n")
    print("| variant | peak GiB predicted / measured | ratio | step s predicted / measured | ratio | peak at |")
    print("|---|---|---|---|---|---|")
    for fused, seconds, peak in MEASURED:
        keys = throughput.parse_overrides(kd.kd_keys(paths.model(teacher), TOP_K, fused))
        cfg = validate_config(throughput.hellbender_raw_config(job, keys))
        plan = plan_for(cfg, gpu=args.gpu)
        predicted_peak, predicted_seconds = plan.memory.peak / GIB, plan.time.seconds
        print(
            f"| `kd_fused_loss: {str(fused).lower()}` | {predicted_peak:.1f} / {peak} | {predicted_peak / peak:.2f} | "
            f"{predicted_seconds:.3f} / {seconds:.3f} | {predicted_seconds / seconds:.2f} | {plan.memory.peak_phase} |"
        )


if __name__ == "__main__":
    main()
