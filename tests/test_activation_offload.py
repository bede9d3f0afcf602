"""Offloaded checkpointing: saved layer inputs go through host slabs and come back bit-identical, a tensor saved by
several layers is stored once, slab space is reused from step to step, and a stale tensor is refused. On CPU the
offloader is told to copy host tensors too, so the same code path runs as on a GPU (minus the side stream)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hellbender.models import activation_offload
from hellbender.models.activation_checkpointing import (
    enable_activation_checkpointing,
    offloaded_layer_indices,
    offloader_of,
)
from hellbender.models.activation_offload import ActivationOffloader
from hellbender.models.tiny import tiny_model_dir
from hellbender.plan import memory as plan_memory

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


@pytest.mark.parametrize(
    "tensor",
    [torch.randn(40, 30).t(), torch.randn(2, 6, 1, 5, 4).permute(0, 3, 2, 1, 4), torch.randn(60, 9)[10:40]],
    ids=["transposed", "permuted", "a slice of rows"],
)
def test_a_permuted_tensor_comes_back_with_its_values_and_strides(tensor):
    """Compiled backward code checks the strides of what it saved (attention's outputs are transposed views)."""
    offloader = host_offloader()
    packed = offloader.pack(tensor)
    assert offloader.host_bytes > 0
    back = offloader.unpack(packed)
    assert back.stride() == tensor.stride()
    torch.testing.assert_close(back, tensor, atol=0, rtol=0)


def test_a_tensor_with_gaps_in_its_storage_stays_where_it_is():
    offloader = host_offloader()
    tensor = torch.randn(40, 30)[:, :20]
    assert offloader.pack(tensor) is tensor and offloader.host_bytes == 0


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


def test_running_out_of_pinned_host_memory_is_reported_with_what_to_do(monkeypatch):
    from hellbender.errors import EnvironmentProblem

    offloader = host_offloader()
    offloader.pack(torch.randn(1000))  # one slab taken
    real_empty = torch.empty

    def no_more_memory(*args, **kwargs):
        if kwargs.get("dtype") is torch.uint8:
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_more_memory)
    with pytest.raises(EnvironmentProblem, match=r"pinned host memory .* in use when .*`activation_offload_layers`"):
        offloader.pack(torch.randn(1000))


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
        assert sum(len(g.entries) for g in offloader._groups) == layers  # each layer's input went through the slabs
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


def test_offloaded_layers_run_once_and_train_exactly_like_checkpointed_ones():
    """`activation_offload_layers: 2` of the tiny Llama's layers: those two run their forward once a step (the
    checkpointed ones twice: forward and replay), everything they save goes through the slabs, and the losses and
    weights stay bit-identical to checkpointing every layer."""
    reference = _llama(False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("hellbender/tiny-llama"), dtype=torch.float32).train()
    enable_activation_checkpointing(model, offload_layers=2)
    offloader = offloader_of(model)
    offloader.slab_bytes, offloader.min_bytes, offloader.offload_host_tensors = SLAB, 0, True
    layers = model.model.layers
    offloaded = offloaded_layer_indices(len(layers), 2)
    calls = [0] * len(layers)
    for index, layer in enumerate(layers):
        layer.self_attn.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step in range(3):
        calls[:] = [0] * len(layers)
        losses = []
        for m, optimizer in zip((reference, model), optimizers, strict=True):
            loss = m(input_ids=_batch(step), labels=_batch(step)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1], step
        assert calls == [1 if i in offloaded else 2 for i in range(len(layers))], calls
        groups = offloader._groups
        assert [g.offloaded for g in groups] == [i in offloaded for i in range(len(layers))]
        # An offloaded layer parks many tensors (its whole forward's); a checkpointed one only its inputs, on the device.
        assert all(len(g.entries) > 4 for g in groups if g.offloaded)
        assert all(not g.entries for g in groups if not g.offloaded)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0, msg=name)


def test_offloaded_layers_are_spread_over_the_checkpointed_ones():
    assert offloaded_layer_indices(22, 8) == [0, 2, 5, 8, 11, 13, 16, 19]
    assert offloaded_layer_indices(4, 4) == [0, 1, 2, 3]
    assert offloaded_layer_indices(32, 1) == [0]


def test_each_layers_backward_fetches_the_two_offloaded_layers_below_it_first():
    """Groups as layers 0-4 would be: offloaded, offloaded, kept, offloaded, kept. When a group's backward begins,
    its own tensors are fetched, then the two nearest offloaded groups' below it, each once."""
    offloader = host_offloader()
    fetched: list[int] = []  # entries, in packing order, as their copies start
    copy = offloader._fetch

    def fetch_and_record(entry):
        if entry.fetched is None:
            fetched.append([e for g in offloader._groups for e in g.entries].index(entry))
        return copy(entry)

    offloader._fetch = fetch_and_record
    saved = []
    for offload in (True, True, False, True, False):
        with offloader.hooks(offload):
            saved.append([offloader.pack(torch.randn(8, 8)) for _ in range(2)])
    fetched_when_begun = []
    for group in reversed(saved):
        offloader.unpack(group[0])
        fetched_when_begun.append(list(fetched))
        offloader.unpack(group[1])
    # Entries 0-1 are group 0's, 2-3 group 1's, 4-5 group 3's. Group 4 starts groups 3 and 1, group 3 has nothing
    # left to start but group 0 (two below it), and the rest were fetched ahead.
    assert fetched_when_begun == [[4, 5, 2, 3], [4, 5, 2, 3, 0, 1]] + [[4, 5, 2, 3, 0, 1]] * 3


def test_the_planner_plans_the_offloaders_slabs_and_fetches():
    assert plan_memory.SLAB_BYTES == activation_offload.SLAB_BYTES
    assert plan_memory.FETCH_AHEAD == activation_offload.FETCH_AHEAD
