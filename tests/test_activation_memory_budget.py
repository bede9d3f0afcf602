"""`activation_memory_budget`: the compiled layers keep less for backward and recompute it, with the same losses and
gradients; the setting holds while `train` runs and only then. On CPU with the `aot_eager_decomp_partition` backend:
torch's min-cut partitioner, the part that reads the budget, without inductor's C++ builds (the inductor run on
CUDA is in tests/test_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch._functorch.config as functorch_config
from transformers import TrainerCallback

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.models.activation_checkpointing import enable_activation_checkpointing
from hellbender.models.compile_settings import compile_settings
from hellbender.train.run import train
from tests.helpers import base_config, logged_losses
from tests.test_torch_compile import BATCHES, tiny_llama

BACKEND = "aot_eager_decomp_partition"


def saved_bytes_and_gradients(budget: float | None) -> tuple[int, list[dict[str, torch.Tensor]]]:
    """Bytes the compiled model's forward on the first batch keeps for backward (weights aside), and the gradients of
    each batch; every decoder layer left unchecked and compiled as a module."""
    torch._dynamo.reset()
    model = tiny_llama(adapter=True)
    enable_activation_checkpointing(model, layers=0, compile_options={"backend": BACKEND})
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    gradients = []
    with compile_settings(SimpleNamespace(activation_memory_budget=budget)):
        for i, ids in enumerate(BATCHES):
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            with hooks if i == 0 else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            gradients.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            model.zero_grad()
    return sum(kept.values()), gradients


def test_a_budget_keeps_less_for_backward_and_gives_the_same_gradients():
    """At 0.5 the compiled layers keep at most two thirds of what they keep by default (measured: 0.59), and
    every LoRA gradient of both batches (the second a dynamic-shape recompile) equals the default's."""
    default_bytes, expected = saved_bytes_and_gradients(None)
    budget_bytes, got = saved_bytes_and_gradients(0.5)
    assert functorch_config.activation_memory_budget == 1.0  # given back after the context
    assert budget_bytes < default_bytes * 2 / 3, (budget_bytes, default_bytes)
    for batch_got, batch_expected in zip(got, expected, strict=True):
        assert batch_got.keys() == batch_expected.keys() and batch_got
        for name, grad in batch_expected.items():
            torch.testing.assert_close(batch_got[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_train_holds_the_budget_while_it_trains_and_gives_it_back(tmp_path):
    """The setting is what the partitioner reads at each compile inside the training loop, and the process has its
    own back when `train` returns; the losses are the run's without a budget."""
    common = dict(adapter="lora", lora_target_linear=True, lora_dropout=0.0, max_steps=3, gradient_checkpointing=True,
                  gradient_checkpointing_layers=1, torch_compile=True, torch_compile_backend=BACKEND)  # fmt: skip
    seen = []

    class Inspect(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            seen.append(functorch_config.activation_memory_budget)

    default = validate_config(base_config(tmp_path / "default", **common))
    budget = validate_config(base_config(tmp_path / "budget", activation_memory_budget=0.3, **common))
    train(default)
    torch._dynamo.reset()
    train(budget, callbacks=[Inspect()])
    assert seen == [0.3, 0.3, 0.3]
    assert functorch_config.activation_memory_budget == 1.0
    expected, got = logged_losses(default.output_dir), logged_losses(budget.output_dir)
    assert expected.keys() == got.keys() == {1, 2, 3}
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (step, got, expected)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({}, r"`activation_memory_budget: 0.5` needs `torch_compile: true`"),
        ({"torch_compile": True, "torch_compile_backend": "aot_eager"}, r"`torch_compile_backend: aot_eager`: only"),
    ],
)
def test_a_budget_that_would_do_nothing_is_refused(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(base_config(tmp_path, activation_memory_budget=0.5, **keys))


@pytest.mark.parametrize("budget", [0, -0.1, 1.5])
def test_a_budget_outside_0_to_1_is_refused(tmp_path, budget):
    with pytest.raises(ConfigError, match="`activation_memory_budget`"):
        validate_config(base_config(tmp_path, activation_memory_budget=budget, torch_compile=True))
