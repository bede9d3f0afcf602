"""One process of a two-process distillation run on CPU (gloo), started by tests/test_distillation_distributed.py
through torchrun: trains each config of a list in turn (DDP, as `hellbender train --nproc 2` trains); loads the
online teacher as a FSDP2 run with `cpu_ram_efficient_loading` does and records its logits on a fixed batch; and
takes distillation steps with the student sharded by FSDP2 (`fully_shard`, as accelerate shards it: each decoder
layer, then the root; accelerate applies FSDP2 only on accelerators, so the Trainer cannot do it on CPU) beside a
whole teacher in each process, each process on its share of every global batch.

Usage: kd_worker.py CONFIGS.json RESULT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

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


def kd_steps(student: Any, teacher: Any, rank: int = 0, world: int = 1) -> list[list[float]]:
    """Three distillation steps (online targets, `kd_alpha` 0.7, `kd_ce_alpha` 0.3, T = 2) on fixed global batches of
    4 rows, this process taking rows `rank::world`: per step the (KD, cross-entropy) parts of the global batch. The
    loss is divided by the global batch's trained tokens and multiplied by `world` (FSDP2 averages the gradients
    over the processes), as the Trainer does with `average_tokens_across_devices`."""
    from hellbender.train.distillation_loss import DistillationLoss, distillation_loss

    settings = DistillationLoss(alpha=0.7, ce_alpha=0.3, temperature=2.0)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    parts = []
    for _ in range(3):
        ids = torch.randint(3, 250, (4, 20), generator=generator)
        labels = ids.clone()
        labels[:, :5] = -100  # a prompt
        trained = int((labels[:, 1:] != -100).sum())
        batch = {"input_ids": ids[rank::world], "attention_mask": torch.ones_like(ids[rank::world])}
        targets = teacher.targets(batch)
        logits = student(**batch).logits
        got = distillation_loss(logits, labels[rank::world], *targets.values(), settings, trained)
        (got.loss * world).backward()
        optimizer.step()
        optimizer.zero_grad()
        both = torch.stack([got.kd, got.ce])
        if world > 1:
            dist.all_reduce(both)  # each process's share of the global sums
        parts.append(both.tolist())
    return parts


def tiny_student_and_teacher(model_dir: str) -> tuple[Any, Any]:
    """The tiny model twice, as separate objects: a student in float32 and a teacher in inference mode."""
    from transformers import AutoModelForCausalLM

    from hellbender.train.teacher import Teacher

    student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    teacher_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)
    return student, Teacher(teacher_model, top_k=8, temperature=2.0, vocab=student.config.vocab_size)


def fsdp2_kd_steps(model_dir: str, result_dir: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    student, teacher = tiny_student_and_teacher(model_dir)
    for layer in student.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(student, mesh=mesh)
    parts = kd_steps(student, teacher, dist.get_rank(), dist.get_world_size())
    sharded = sum(1 for p in student.parameters() if type(p).__name__ == "DTensor")
    whole = sum(1 for p in teacher.model.parameters() if type(p).__name__ == "DTensor")
    if dist.get_rank() == 0:
        report = {"parts": parts, "sharded_student_parameters": sharded, "sharded_teacher_parameters": whole}
        (result_dir / "fsdp2.json").write_text(json.dumps(report))


def main(configs_path: str, result_dir: str) -> None:
    configs = json.loads(Path(configs_path).read_text())
    for raw in configs["train"]:
        train(validate_config(raw))
    teacher_logits_under_fsdp_loading(configs["teacher"], Path(result_dir))
    fsdp2_kd_steps(configs["teacher"]["kd_teacher_model"], Path(result_dir))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
