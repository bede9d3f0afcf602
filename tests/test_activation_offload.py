"""Offloaded checkpointing: saved layer inputs go through host slabs and come back bit-identical, a tensor saved by
several layers is stored once, slab space is reused from step to step, and a stale tensor is refused. On CPU the
offloader is told to copy host tensors too, so the same code path runs as on a GPU (minus the side stream)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hellbender.models.activation_checkpointing import enable_activation_checkpointing, offloader_of
from hellbender.models.activation_offload import ActivationOffloader
from hellbender.models.tiny import tiny_model_dir

SLAB = 4096  # bytes: small, so the tiny model's hidden states span several slabs


def host_offloader(**kwargs) -> ActivationOffloader:
    return ActivationOffloader(slab_bytes=SLAB, min_bytes=0, offload_host_tensors=True, **kwargs)


def test_a_tensor_spanning_slabs_comes_back_identical():
    offloader = host_offloader()
    tensor = torch.randn(7, 300)  # 8,400 bytes: three slabs
    packed = offloader.pack(tensor)
    assert len(packed.pieces) == 3 and offloader.host_bytes == 3 * SLAB
    tensor_copy = tensor.clone()
    tensor.zero_()  # the host copy is independent of the original
    torch.testing.assert_close(offloader.unpack(packed), tensor_copy, atol=0, rtol=0)


def test_a_non_contiguous_tensor_comes_back_with_its_values():
    offloader = host_offloader()
    tensor = torch.randn(40, 30).t()
    torch.testing.assert_close(offloader.unpack(offloader.pack(tensor)), tensor, atol=0, rtol=0)


def test_small_tensors_and_parameters_are_left_where_they_are():
    offloader = ActivationOffloader(slab_bytes=SLAB, min_bytes=1024, offload_host_tensors=True)
    small = torch.randn(4)
    parameter = torch.nn.Parameter(torch.randn(1000))
    assert offloader.pack(small) is small
    assert offloader.pack(parameter) is parameter
    assert offloader.host_bytes == 0
    # On a GPU machine tensors already in host memory are never copied.
    assert ActivationOffloader(min_bytes=0).pack(small) is small


def test_a_tensor_saved_twice_is_stored_once():
    offloader = host_offloader()
    shared = torch.randn(64, 64)  # 16 KiB
    first, second = offloader.pack(shared), offloader.pack(shared)
    assert first is second and first.packed == 2
    assert offloader.host_bytes == 4 * SLAB
    for packed in (first, second):
        torch.testing.assert_close(offloader.unpack(packed), shared, atol=0, rtol=0)


def test_a_tensor_from_a_finished_step_is_refused():
    offloader = host_offloader()
    packed = offloader.pack(torch.randn(100))
    offloader.new_step()
    with pytest.raises(RuntimeError, match="host memory has been reused"):
        offloader.unpack(packed)


def _llama(offload: bool | None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("hellbender/tiny-llama"), dtype=torch.float32)
    model.train()
    if offload is not None:
        enable_activation_checkpointing(model, offload=offload)
        if offload:
            offloader = offloader_of(model)
            offloader.slab_bytes, offloader.min_bytes, offloader.offload_host_tensors = SLAB, 0, True
    return model


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(10, 200, (2, 48), generator=torch.Generator().manual_seed(seed))


def test_offloaded_checkpointing_trains_exactly_like_plain_checkpointing():
    models = {"checkpointed": _llama(False), "offloaded": _llama(True)}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.1) for name, model in models.items()}
    offloader = offloader_of(models["offloaded"])
    layers = models["offloaded"].config.num_hidden_layers
    host_bytes = []
    for step in range(3):
        losses = {}
        for name, model in models.items():
            loss = model(input_ids=_batch(step), labels=_batch(step)).loss
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            losses[name] = loss.item()
        assert losses["offloaded"] == losses["checkpointed"], step
        assert len(offloader._order) == layers  # each layer's input went through the slabs
        host_bytes.append(offloader.host_bytes)
    assert host_bytes[0] > 0 and host_bytes == [host_bytes[0]] * 3  # the same slabs, step after step
    for (name, ours), theirs in zip(
        models["offloaded"].named_parameters(), models["checkpointed"].parameters(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0, msg=name)


def test_backward_after_the_next_forward_is_refused():
    model = _llama(True)
    loss = model(input_ids=_batch(0), labels=_batch(0)).loss
    model(input_ids=_batch(1), labels=_batch(1))
    with pytest.raises(RuntimeError, match="started another forward"):
        loss.backward()
