"""Loss and gradients with each Liger kernel against the unfused model, on CUDA in bf16; prints JSON.

Run in its own process by tests/test_gpu.py, which keeps Triton's compiled kernels and CUDA state out of the test
process. hellbender applies Liger to one model only (models/one_model_patch.py); the last model here, built after
every fused one, checks that on the GPU: it must be stock and compute the first (unfused) model's loss and
gradients.

    python tests/liger_numerics.py MODEL_DIR
    python tests/liger_numerics.py --accumulation WORK_DIR   # micro-batch 4 vs 2 x 2, fused loss on
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from hellbender.errors import ConfigError
from hellbender.models.kernels import LIGER_ARGUMENTS, apply_liger_kernels

BUILT_AFTERWARDS = "unfused, built after the fused models"


def loss_and_grads(path: str, keys: tuple[str, ...], ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().train()
    cfg = SimpleNamespace(**{key: key in keys for key in LIGER_ARGUMENTS}, fused_cross_entropy_chunk_scale=None)
    applied = apply_liger_kernels(cfg, model) if keys else []
    assert applied == list(keys), applied
    if not keys:  # no module of an unfused model has a forward of its own (Liger binds its kernels so)
        assert not [n for n, m in model.named_modules() if "forward" in vars(m)], "a model was fused by another"
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def accumulation(work: Path) -> None:
    from hellbender.config import validate_config
    from hellbender.train.run import train
    from tests.helpers import base_config, final_weights, logged_losses

    common = dict(adapter="lora", lora_target_linear=True, max_steps=1, learning_rate=1e-2, bf16=False)
    common.update(liger_fused_linear_cross_entropy=True, liger_rms_norm=True, liger_glu_activation=True)
    runs = [
        validate_config(base_config(work / "big", micro_batch_size=4, gradient_accumulation_steps=1, **common)),
        validate_config(base_config(work / "acc", micro_batch_size=2, gradient_accumulation_steps=2, **common)),
    ]
    for cfg in runs:
        train(cfg)
    a, b = (final_weights(cfg.output_dir) for cfg in runs)
    difference = max((a[k] - b[k]).abs().max().item() for k in a)
    losses = [logged_losses(cfg.output_dir)[1] for cfg in runs]
    print(json.dumps({"max_weight_difference": difference, "losses": losses}))


def main() -> None:
    if sys.argv[1] == "--accumulation":
        accumulation(Path(sys.argv[2]))
        return
    path = sys.argv[1]
    ids = torch.randint(10, 400, (2, 96), generator=torch.Generator().manual_seed(0)).cuda()
    reference_loss, reference = loss_and_grads(path, (), ids)  # built before Liger was imported
    model_type = AutoModelForCausalLM.from_pretrained(path).config.model_type
    import inspect

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    parameters = inspect.signature(MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]).parameters
    supported = [k for k, names in LIGER_ARGUMENTS.items() if any(n in parameters for n in names)]
    results: dict[str, dict[str, float]] = {}

    def run(name: str, keys: tuple[str, ...]) -> None:
        loss, grads = loss_and_grads(path, keys, ids)
        worst = max(
            ((grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in reference.items() if g.norm() > 0
        )
        results[name] = {"loss": loss, "reference_loss": reference_loss, "worst_relative_grad_error": worst}

    accepted, refused = [], {}
    for key in supported:
        try:
            run(key, (key,))
        except ConfigError as error:  # a key hellbender refuses for this family (Liger applies it as a no-op)
            refused[key] = str(error)
            continue
        accepted.append(key)
    together = tuple(k for k in accepted if k != "liger_layer_norm")
    run("+".join(together), together)
    run(BUILT_AFTERWARDS, ())
    print(json.dumps({"runs": results, "refused": refused}))


if __name__ == "__main__":
    main()
