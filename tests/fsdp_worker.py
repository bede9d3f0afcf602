"""One process of a two-process FSDP2 run on CPU (gloo), started by tests/test_fsdp.py through torchrun.

accelerate applies FSDP2 only on accelerators, so on CPU this script shards the model the way accelerate does
(each decoder layer, then the root, with a bf16 mixed-precision policy) around hellbender's own pieces: the fp32
norm groups (`shard_norms_in_fp32`) and a sharded checkpoint in accelerate's layout (`{"model": state dict}` under
`checkpoint-N/pytorch_model_fsdp_0/`) for `hellbender consolidate`.

Usage: fsdp_worker.py CONFIG.json RESULT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hellbender.config import validate_config
from hellbender.models.adapters import apply_adapter
from hellbender.models.loading import load_model, load_tokenizer_and_processor
from hellbender.storage import write_manifest
from hellbender.train.fsdp import norm_modules, shard_norms_in_fp32


def local_bytes(tensors) -> int:
    """Bytes of the tensors' local parts (a sharded parameter's shard on this process)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors if torch.is_tensor(t))


def main(config_path: str, result_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    raw = json.loads(Path(config_path).read_text())
    cfg = validate_config(raw)
    torch.manual_seed(0)
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    model = apply_adapter(cfg, load_model(cfg, tokenizer))
    norms = norm_modules(model, cfg.fp32_norm_classes) if cfg.fp32_norms else []
    if cfg.fp32_norms:
        shard_norms_in_fp32(model, cfg.fp32_norm_classes, torch.bfloat16, mesh=mesh)
    for param in model.parameters():  # accelerate keeps float32 master weights of what is trained
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)

    compute_dtypes: dict[str, str] = {}

    def record(module: torch.nn.Module, _args: tuple) -> None:  # runs after FSDP gathered the module's parameters
        for name, param in module.named_parameters(recurse=False):
            compute_dtypes.setdefault(f"{type(module).__name__}.{name}", str(param.dtype))

    for module in model.modules():
        module.register_forward_pre_hook(record)

    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(2):
        ids = torch.randint(3, 250, (2, 24), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        gradient_bytes = local_bytes(p.grad for p in trained if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    # What this process holds between steps, its shards only (`hellbender plan`'s per-GPU parts: tests/test_fsdp.py).
    held = {
        "parameters": local_bytes(model.parameters()),
        "gradients": gradient_bytes,
        "optimizer_states": local_bytes(v for state in optimizer.state.values() for v in state.values()),
    }
    held_by_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(held_by_rank, held)
    compute_dtypes.clear()  # what the forward uses after the steps
    with torch.no_grad():
        model(input_ids=ids)

    out = Path(result_dir)
    checkpoint = out / "run" / "checkpoint-2"
    sharded = get_model_state_dict(model)
    if cfg.adapter:  # accelerate's FSDP2 checkpoints of a PEFT model leave the adapter's name out of its keys
        sharded = {key.replace(".default.", "."): tensor for key, tensor in sharded.items()}
    dcp.save({"model": sharded}, checkpoint_id=str(checkpoint / "pytorch_model_fsdp_0"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        write_manifest(checkpoint)
        torch.save(full, out / "reference_state_dict.pt")
        report = {
            "losses": losses,
            "norms": len(norms),
            "stored": {name: str(p.dtype) for name, p in model.named_parameters()},
            "compute": compute_dtypes,
            "fused_lora_layers": sum(bool(getattr(m, "fused", False)) for m in model.modules()),
            "held_bytes": held_by_rank,
        }
        (out / "report.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
