"""One process of a four-process FSDP2 run on CPU (gloo), started by tests/test_fsdp.py through torchrun: the same
LoRA model and batch trained with plain FSDP2 (one group sharded over all four processes) and with hybrid sharding
(`dp_replicate_size: 2` x `dp_shard_size: 2`, on the 2-D mesh hellbender's `parallelism_config` has accelerate
build, indexed as accelerate indexes it for `fully_shard`).

Usage: fsdp_hybrid_worker.py CONFIG.json RESULT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hellbender.config import validate_config
from hellbender.models.loading import load_tokenizer_and_processor
from hellbender.models.stack import build_trainable_model
from hellbender.train.fsdp import parallelism_config

ROWS, LENGTH, STEPS = 8, 24, 2


def run(cfg, mesh, rank: int, processes: int) -> dict:
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    model = build_trainable_model(cfg, tokenizer).train()
    for layer in model.get_base_model().model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(3, 250, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    rows = ROWS // processes
    ids = ids[rank * rows : (rank + 1) * rows]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == STEPS - 1:  # LoRA B starts at zero: the second step gives every LoRA weight a gradient
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / processes)
    return {"losses": losses, "grads": grads, "mesh": list(mesh.shape), "dims": list(mesh.mesh_dim_names or [])}


def main(config_path: str, result_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, processes = dist.get_rank(), dist.get_world_size()
    cfg = validate_config(json.loads(Path(config_path).read_text()))
    plain = run(cfg, init_device_mesh("cpu", (processes,)), rank, processes)
    hybrid_config = parallelism_config(cfg, processes)
    mesh = hybrid_config.build_device_mesh("cpu")
    hybrid = run(cfg, mesh[tuple(hybrid_config.fsdp_dim_names)], rank, processes)
    if rank == 0:
        out = Path(result_dir)
        torch.save({"plain": plain.pop("grads"), "hybrid": hybrid.pop("grads")}, out / "grads.pt")
        (out / "report.json").write_text(json.dumps({"plain": plain, "hybrid": hybrid}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
