"""The fused gated RMSNorm (`liger_rms_norm_gated`) against transformers' own gated-norm modules, shared by the
CPU tests (Triton's interpreter, in a subprocess: `TRITON_INTERPRET=1` must be set before Triton is imported) and
the GPU tests. As a script it prints one JSON line:

    TRITON_INTERPRET=1 python tests/gated_norm_checks.py
"""

from __future__ import annotations

import functools
import json
import types
from typing import Any

import torch

IDS = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(0))


def norm_cases() -> dict[str, tuple[Any, int, bool, tuple[int, ...]]]:
    """label -> (module with a random weight, group size, norm before gate, input shape). The sizes are no powers
    of two, so the kernel's masked lanes are exercised; Nemotron-H's has several groups per row."""
    from hellbender.models.gated_norms import KINDS, installed_class

    qwen3_5, qwen3_5_moe, nemotron_h = (installed_class(kind) for kind in KINDS)
    torch.manual_seed(0)
    cases = {
        "qwen3_5": (qwen3_5 and qwen3_5(40, eps=1e-6), 40, True, (6, 7, 40)),
        "qwen3_5_moe": (qwen3_5_moe and qwen3_5_moe(24, eps=1e-6), 24, True, (37, 24)),
        "nemotron_h": (nemotron_h and nemotron_h(60, group_size=20, eps=1e-5), 20, False, (2, 9, 60)),
    }
    cases = {label: case for label, case in cases.items() if case[0] is not None}  # families this release has
    for module, *_ in cases.values():
        with torch.no_grad():
            module.weight.normal_(1.0, 0.5)
    return cases


def exact_gated_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int, norm_before_gate: bool
) -> torch.Tensor:
    """What the gated norms compute, without rounding (for float64 inputs)."""
    silu = torch.nn.functional.silu(gate)
    if norm_before_gate:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * silu
    grouped = (x * silu).unflatten(-1, (-1, group_size))
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.flatten(-2)


def outputs_and_grads(
    forward: Any, weight: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, dy: torch.Tensor
) -> list[torch.Tensor]:
    x, gate = x.detach().requires_grad_(), gate.detach().requires_grad_()
    weight.grad = None
    y = forward(x, gate)
    y.backward(dy)
    return [y.detach(), x.grad, gate.grad, weight.grad.clone()]


def compare_norms(dtype: torch.dtype, device: str, weight_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """For each gated-norm class: the fused kernel's and the module's output, input, gate and weight gradients on
        random inputs in `dtype`, each also against the exact answer (`exact_gated_norm` in float64: the modules
    themselves compute in float32 whatever the input's dtype). Returns, per class,
        `fused_vs_module` and the relative errors of each against float64 (norm of the difference / norm)."""
    results = {}
    for label, (module, group_size, norm_before_gate, shape) in norm_cases().items():
        module = module.to(device=device, dtype=weight_dtype or dtype)
        generator = torch.Generator(device).manual_seed(1)
        x = torch.randn(shape, generator=generator, device=device).to(dtype) * 3
        gate = torch.randn(shape, generator=generator, device=device).to(dtype) * 2
        y = module(x, gate)
        dy = torch.randn(y.shape, generator=generator, device=device).to(y.dtype)

        eps = module.variance_epsilon
        fused = functools.partial(_fused, weight=module.weight, eps=eps, group_size=group_size, nbg=norm_before_gate)
        eager = outputs_and_grads(module, module.weight, x, gate, dy)
        ours = outputs_and_grads(fused, module.weight, x, gate, dy)
        exact_weight = module.weight.detach().double().requires_grad_()
        exact_forward = functools.partial(
            exact_gated_norm, weight=exact_weight, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate
        )
        exact = outputs_and_grads(exact_forward, exact_weight, x.double(), gate.double(), dy.double())
        names = ("output", "input_grad", "gate_grad", "weight_grad")
        results[label] = {
            "dtypes_match": [a.dtype == b.dtype for a, b in zip(ours, eager, strict=True)],
            "output_scale": eager[0].abs().max().item(),
            "fused_vs_module": {n: _max_difference(a, b) for n, a, b in zip(names, ours, eager, strict=True)},
            "fused_error": {n: _relative(a, e) for n, a, e in zip(names, ours, exact, strict=True)},
            "module_error": {n: _relative(a, e) for n, a, e in zip(names, eager, exact, strict=True)},
        }
    return results


def _fused(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int, nbg: bool) -> Any:
    from hellbender.models.gated_rms_norm_kernel import gated_rms_norm

    return gated_rms_norm(x, gate, weight, eps, group_size, nbg)


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _relative(a: torch.Tensor, exact: torch.Tensor) -> float:
    return ((a.double() - exact).norm() / exact.norm().clamp_min(1e-30)).item()


def tiny_models() -> dict[str, Any]:
    """A tiny Qwen3.5 (one linear-attention and one full-attention layer) and a tiny Nemotron-H (a Mamba2 mixer
    with two norm groups, an attention and an MLP layer), randomly initialised with a fixed seed."""
    from transformers import NemotronHConfig, NemotronHForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    qwen = Qwen3_5TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    nemotron = NemotronHConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=8, expand=1,
        layers_block_type=["linear_attention", "full_attention", "mlp"],
    )  # fmt: skip
    models = {"qwen3_5": Qwen3_5ForCausalLM(qwen), "nemotron_h": NemotronHForCausalLM(nemotron)}
    for model in models.values():
        with torch.no_grad():  # gated-norm weights start at one: make them matter
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.normal_(1.0, 0.5)
    return models


def loss_and_grads(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return output.logits.detach(), output.loss.detach(), grads


def compare_models(device: str = "cpu") -> dict[str, Any]:
    """Each tiny model's logits, loss and parameter gradients before and after `fuse_gated_norms`, and what the fusing
    changed on its modules (and on a second model of the same class, built before it and left alone)."""
    from hellbender.models.gated_norms import fuse_gated_norms

    results = {}
    for label, model in tiny_models().items():
        bystander = type(model)(model.config).train()
        model.to(device).train()  # the Mamba2 mixers take their training path (mamba-ssm is absent: the module's norm)
        logits, loss, grads = loss_and_grads(model, IDS.to(device))
        before = {name: dict(vars(module)) for name, module in model.named_modules()}
        fused = fuse_gated_norms(model)
        changed = sorted(
            f"{name}.{key}"
            for name, module in model.named_modules()
            for key in set(before[name]) | set(vars(module))
            if before[name].get(key) is not vars(module).get(key)
        )
        fused_logits, fused_loss, fused_grads = loss_and_grads(model, IDS.to(device))
        gated = sorted(n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNormGated"))
        results[label] = {
            "fused": fused,
            "gated_norms": gated,
            "changed": changed,
            "forwards_are_bound_methods": all(
                isinstance(vars(model.get_submodule(n))["forward"], types.MethodType) for n in fused
            ),
            "bystander_forwards": sorted(n for n, m in bystander.named_modules() if "forward" in vars(m)),
            "logits_difference": _max_difference(fused_logits, logits),
            "logits_scale": logits.abs().max().item(),
            "loss_difference": abs(fused_loss.item() - loss.item()),
            "worst_grad_difference": max(_max_difference(fused_grads[n], g) for n, g in grads.items()),
            "same_gradient_names": sorted(fused_grads) == sorted(grads),
        }
    return results


def main() -> None:
    print(json.dumps({"norms": compare_norms(torch.float32, "cpu"), "models": compare_models()}))


if __name__ == "__main__":
    main()
