"""One process of a two-process distillation run on CPU (gloo), started by tests/test_distillation_distributed.py
through torchrun: trains each config of a list in turn (DDP, as `hellbender train --nproc 2` trains), then loads the
online teacher as a FSDP2 run with `cpu_ram_efficient_loading` does and records its logits on a fixed batch.

Usage: kd_worker.py CONFIGS.json RESULT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hellbender.config import validate_config
from hellbender.train.run import train


def teacher_logits_under_fsdp_loading(raw: dict, result_dir: Path) -> None:
    """The teacher as each process loads it once accelerate's FSDP2 plugin has set its loading variables (the
    Trainer's arguments are built before the teacher is loaded): every process must hold the same teacher."""
    from hellbender.models.loading import load_tokenizer
    from hellbender.train.teacher import load_teacher

    cfg = validate_config(raw)
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    try:
        teacher = load_teacher(cfg, load_tokenizer(cfg))
    finally:
        for key in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
            os.environ.pop(key)
    ids = torch.arange(3, 35).reshape(2, 16)
    logits = teacher.logits({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    torch.save(logits, result_dir / f"teacher_logits_{dist.get_rank()}.pt")


def main(configs_path: str, result_dir: str) -> None:
    configs = json.loads(Path(configs_path).read_text())
    for raw in configs["train"]:
        train(validate_config(raw))
    teacher_logits_under_fsdp_loading(configs["teacher"], Path(result_dir))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
