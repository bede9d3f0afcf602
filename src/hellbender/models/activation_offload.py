"""Offloaded activation checkpointing (`gradient_checkpointing: offload`): the inputs each checkpointed layer saves
for its replay wait in host memory between the forward and the backward.

Three things make this cheaper than wrapping the layers in `torch.autograd.graph.save_on_cpu`:

- Host memory comes from fixed-size pinned slabs kept from step to step. torch's pinned-memory allocator rounds
  every request up to a power of two, so per-tensor pinned buffers of 2.7 GiB (an 8B model's hidden states at
  350k tokens) would take 4 GiB each, and 32 layers of them more host memory than the machine has.
- Tensors are copied on a side stream, so the forward does not wait for each copy, and in backward the next layer's
  inputs are fetched while the current one recomputes.
- A tensor saved by several layers is stored once, and small tensors (under 1 MiB) stay on the GPU.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

SLAB_BYTES = 256 * 2**20  # a power of two, so the pinned allocator wastes nothing
MIN_OFFLOAD_BYTES = 2**20  # smaller saved tensors are not worth a copy
ALIGNMENT = 512


@dataclass(eq=False)
class _Offloaded:
    """One saved tensor parked in host slabs: where its bytes are, and how to rebuild it."""

    generation: int
    index: int  # order of packing within the step
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    pieces: list[tuple[int, int, int]]  # (slab, offset in slab, length), in byte order of the tensor
    packed: int = 1  # how many saves share it
    unpacked: int = 0
    fetched: torch.Tensor | None = None  # on the device, once fetched
    ready: Any = None  # CUDA event recorded after the fetch's copies
    owner: Any = field(default=None, repr=False)  # the original tensor, weakly (to recognise a second save)


class ActivationOffloader:
    """Saved-tensor hooks that park tensors in pinned host slabs. Use `hooks()` around a checkpointed call, and
    call `new_step()` before each forward: a step's slab space is reused by the next step.

    `offload_host_tensors` copies tensors that are already in host memory too (for tests on CPU)."""

    def __init__(
        self,
        slab_bytes: int = SLAB_BYTES,
        min_bytes: int = MIN_OFFLOAD_BYTES,
        offload_host_tensors: bool = False,
    ) -> None:
        self.slab_bytes, self.min_bytes = slab_bytes, min_bytes
        self.offload_host_tensors = offload_host_tensors
        self.slabs: list[torch.Tensor] = []
        self.generation = 0
        self._used = 0  # bytes of slab space taken this step (bump allocation)
        self._order: list[_Offloaded] = []  # this step's entries, in packing order
        self._by_owner: dict[int, _Offloaded] = {}
        self._stream: Any = None

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    @property
    def host_bytes(self) -> int:
        return len(self.slabs) * self.slab_bytes

    def new_step(self) -> None:
        """Forget the previous step's tensors; their slab space is reused from here on."""
        self.generation += 1
        self._used = 0
        self._order.clear()
        self._by_owner.clear()

    # -- packing (forward) --------------------------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> Any:
        if not self._worth_offloading(tensor):
            return tensor
        known = self._by_owner.get(id(tensor))
        if known is not None and known.owner() is tensor:
            known.packed += 1
            return known
        source = tensor.detach().contiguous().view(-1).view(torch.uint8)
        entry = _Offloaded(
            self.generation, len(self._order), tensor.shape, tensor.dtype, tensor.device, source.numel(), []
        )
        entry.owner = weakref.ref(tensor)
        entry.pieces = self._reserve(entry.nbytes)
        with self._copy_stream(tensor.device) as stream:
            for (slab, offset, length), start in zip(entry.pieces, _starts(entry.pieces), strict=True):
                self.slabs[slab][offset : offset + length].copy_(source[start : start + length], non_blocking=True)
            if stream is not None:
                source.record_stream(stream)  # keep the device memory until the copy has run
        self._order.append(entry)
        self._by_owner[id(tensor)] = entry
        return entry

    def _worth_offloading(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
            return False
        if tensor.device.type == "cpu" and not self.offload_host_tensors:
            return False
        return tensor.numel() * tensor.element_size() >= self.min_bytes

    def _reserve(self, nbytes: int) -> list[tuple[int, int, int]]:
        pieces, left = [], nbytes
        while left:
            slab, offset = divmod(self._used, self.slab_bytes)
            if slab == len(self.slabs):
                self.slabs.append(self._new_slab())
            length = min(left, self.slab_bytes - offset)
            pieces.append((slab, offset, length))
            self._used += length
            left -= length
        self._used = -(-self._used // ALIGNMENT) * ALIGNMENT
        return pieces

    def _new_slab(self) -> torch.Tensor:
        return torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    # -- unpacking (backward) -----------------------------------------------------------------------------------

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.generation != self.generation:
            raise RuntimeError(
                "An offloaded activation was needed in backward after its model started another forward, so its "
                "host memory has been reused. Run backward before the model's next forward, or set "
                "`gradient_checkpointing: true` instead of `offload` for this use."
            )
        tensor = self._fetch(packed)
        if packed.ready is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.ready)
            tensor.record_stream(torch.cuda.current_stream(packed.device))
        self._prefetch_before(packed)
        packed.unpacked += 1
        if packed.unpacked >= packed.packed:
            packed.fetched, packed.ready = None, None  # the last save that shares it has it now
        return tensor

    def _fetch(self, entry: _Offloaded) -> torch.Tensor:
        if entry.fetched is not None:
            return entry.fetched
        with self._copy_stream(entry.device) as stream:
            target = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)
            for (slab, offset, length), start in zip(entry.pieces, _starts(entry.pieces), strict=True):
                target[start : start + length].copy_(self.slabs[slab][offset : offset + length], non_blocking=True)
            if stream is not None:
                entry.ready = stream.record_event()
        entry.fetched = target.view(entry.dtype).view(entry.shape)
        return entry.fetched

    def _prefetch_before(self, entry: _Offloaded) -> None:
        """Start copying back the tensor packed just before `entry` (backward runs the layers in reverse)."""
        if entry.device.type == "cuda" and entry.index > 0:
            previous = self._order[entry.index - 1]
            if previous.unpacked < previous.packed:
                self._fetch(previous)

    def _copy_stream(self, device: torch.device) -> _OnCopyStream:
        if device.type != "cuda":
            return _OnCopyStream(None)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return _OnCopyStream(self._stream)


class _OnCopyStream:
    """Runs copies on the side stream, after the work already queued on the current stream."""

    def __init__(self, stream: Any) -> None:
        self.stream, self._context = stream, None

    def __enter__(self) -> Any:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._context = torch.cuda.stream(self.stream)
            self._context.__enter__()
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)


def _starts(pieces: list[tuple[int, int, int]]) -> list[int]:
    starts, position = [], 0
    for _, _, length in pieces:
        starts.append(position)
        position += length
    return starts
