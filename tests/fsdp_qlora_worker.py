"""One process of a two-process QLoRA + FSDP2 run on CPU (gloo), started by tests/test_fsdp_qlora.py through
torchrun; `train_steps` is also the single-process reference that test compares against.

bitsandbytes 0.50 quantizes and computes 4-bit weights on CPU, but hellbender loads a 4-bit base only where CUDA is
(its CPU kernels are slow), so both sides here load it with `bitsandbytes_config` directly. The model is otherwise
built as `hellbender train` builds it (`build_trainable_model`: adapter, activation checkpointing), readied with
`prepare_quantized_for_fsdp`, and sharded as accelerate shards a model with 4-bit weights: each decoder layer, then
the root, with the run's mixed-precision policy and no upcast of its own. It saves what the Trainer saves: the
adapter from the gathered full state dict (the final model), and a sharded adapter-only checkpoint in accelerate's
layout (`checkpoint-N/pytorch_model_fsdp_0/`, keys without the adapter's name) for `hellbender consolidate`, which
it also loads into a freshly sharded model as accelerate does when a run resumes.

Usage: fsdp_qlora_worker.py CONFIG.json RESULT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

STEPS = 3
BATCH, LENGTH = 4, 24


def quantization(cfg: Any) -> Any:
    """hellbender's 4-bit config, computing in float32 when the run is float32 (hellbender computes a float32 run's
    4-bit layers in bfloat16, whose rounding differs between a batch of four rows and two batches of two)."""
    from hellbender.config.precision import torch_dtype
    from hellbender.models.loading import bitsandbytes_config

    config = bitsandbytes_config(cfg)
    if torch_dtype(cfg) == torch.float32:
        config.bnb_4bit_compute_dtype = torch.float32
    return config


def build_model(cfg: Any) -> Any:
    """The QLoRA model of `cfg` on CPU, in training mode. (In eval mode, bitsandbytes repacks a CPU weight in place
    for its inference kernel on CPUs with AVX-512 BF16; under FSDP2 the next gather then meets a repacked state.)"""
    import pytest

    from hellbender.models import loading
    from hellbender.models.stack import build_trainable_model

    tokenizer, _ = loading.load_tokenizer_and_processor(cfg)
    with pytest.MonkeyPatch.context() as patch:  # no CUDA here; see the module's docstring
        patch.setattr(loading, "quantization_config", quantization)
        return build_trainable_model(cfg, tokenizer).train()


def batch() -> torch.Tensor:
    return torch.randint(3, 250, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A (possibly sharded) tensor whole, as float32 (every process must call this for a sharded one)."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float().clone()


def train_steps(model: Any, ids: torch.Tensor, mean_over_processes: bool = False) -> dict[str, Any]:
    """`STEPS` SGD steps on `ids`; the losses (averaged over processes) and the last step's gradients."""
    import torch.distributed as dist

    # Plain SGD: AdamW would magnify float32 rounding in near-zero gradients into whole-step differences.
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == STEPS - 1:  # LoRA B starts at zero, so only later steps give A a gradient
            grads = {name: full(p.grad) for name, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().float()
        if mean_over_processes:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(float(value))
    return {"losses": losses, "grads": grads}


def mean_loss(model: Any, ids: torch.Tensor) -> float:
    import torch.distributed as dist

    value = model(input_ids=ids, labels=ids).loss.detach().float()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def main(config_path: str, result_dir: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from hellbender.config import validate_config
    from hellbender.config.precision import torch_dtype
    from hellbender.storage import write_manifest
    from hellbender.train.fsdp import prepare_quantized_for_fsdp, quantized_weights

    dist.init_process_group("gloo")
    rank, processes = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (processes,))
    cfg = validate_config(json.loads(Path(config_path).read_text()))
    dtype = torch_dtype(cfg)
    # accelerate's policy: the run's dtype for gathering and reducing, none in float32.
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype != torch.float32 else None
    kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}

    def sharded_model() -> Any:
        model = build_model(cfg)
        prepare_quantized_for_fsdp(cfg, model)
        for layer in model.get_base_model().model.layers:
            fully_shard(layer, **kwargs)
        return fully_shard(model, **kwargs)

    unsharded = build_model(cfg)
    sharded_weights = prepare_quantized_for_fsdp(cfg, unsharded)
    quantized_names = list(quantized_weights(unsharded))
    del unsharded
    model = sharded_model()
    params = dict(model.named_parameters())
    quantized = [params[name] for name in quantized_names]  # DTensors now, each holding this process's slice
    local_storage = sorted({str(p.to_local().dtype) for p in quantized})
    local_share = sum(p.to_local().numel() for p in quantized) / sum(p.numel() for p in quantized)

    rows = BATCH // processes
    ids = batch()[rank * rows : (rank + 1) * rows]
    result = train_steps(model, ids, mean_over_processes=True)

    out = Path(result_dir)
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sharded = get_peft_model_state_dict(model)  # what accelerate saves for `adapter_only`, names without `default`
    checkpoint = out / "run" / f"checkpoint-{STEPS}"
    dcp.save({"model": sharded}, checkpoint_id=str(checkpoint / "pytorch_model_fsdp_0"))

    # Resuming, as accelerate loads an adapter-only sharded checkpoint into a freshly sharded model.
    resumed = sharded_model()
    loaded = {"model": get_peft_model_state_dict(resumed)}
    dcp.load(loaded, checkpoint_id=str(checkpoint / "pytorch_model_fsdp_0"))
    set_peft_model_state_dict(resumed, loaded["model"])
    with torch.no_grad():
        after = [mean_loss(m, ids) for m in (model, resumed)]

    if rank == 0:
        model.save_pretrained(str(out / "adapter"), state_dict=whole)  # as the Trainer saves the final adapter
        write_manifest(checkpoint)
        torch.save(result["grads"], out / "grads.pt")
        report = {
            "losses": result["losses"],
            "sharded_4bit_weights": sharded_weights,
            "storage": local_storage,
            "local_share": local_share,
            "loss_after_training": after[0],
            "loss_after_resuming": after[1],
        }
        (out / "report.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
