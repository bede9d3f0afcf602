"""Activations parked in host memory between the forward and the backward: the inputs each checkpointed layer saves
for its replay (`gradient_checkpointing: offload`), and everything a layer saves for backward where it is offloaded
instead of recomputed (`activation_offload_layers`).

Three things make this cheaper than wrapping the layers in `torch.autograd.graph.save_on_cpu`:

- Host memory comes from fixed-size pinned slabs kept from step to step. torch's pinned-memory allocator rounds
  every request up to a power of two, so per-tensor pinned buffers of 2.7 GiB (an 8B model's hidden states at
  350k tokens) would take 4 GiB each, and 32 layers of them more host memory than the machine has.
- Tensors are copied on a side stream, so the forward does not wait for each copy. Each layer call is a group; when
  a group's backward begins, the nearest offloaded groups below it are fetched (two: with one, a layer whose
  backward is shorter than its neighbour's copy would leave the link idle and then wait for it), so their copies run
  while the layers between compute their backward.
- A tensor saved by several layers is stored once, and small tensors (under 1 MiB) stay on the GPU.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

SLAB_BYTES = 256 * 2**20  # a power of two, so the pinned allocator wastes nothing
MIN_OFFLOAD_BYTES = 2**20  # smaller saved tensors are not worth a copy
FETCH_AHEAD = 2  # offloaded groups below the one whose backward runs that are fetched already
ALIGNMENT = 512


@dataclass(eq=False)
class _Group:
    """The tensors one layer call saved (one `hooks()` context): parked in host slabs, or kept on the device."""

    generation: int  # the step it belongs to
    index: int
    offloaded: bool
    entries: list[_Offloaded] = field(default_factory=list)
    started: bool = False  # its backward has begun


@dataclass(eq=False)
class _InGroup:
    """What a layer call saved that is not its own entry in host slabs: a tensor kept on the device, or an entry an
    earlier call parked (a tensor both saved). Unpacking it tells the offloader which layer's backward has begun."""

    saved: torch.Tensor | _Offloaded
    group: _Group


@dataclass(eq=False)
class _Offloaded:
    """One saved tensor parked in host slabs: where its bytes are, and how to rebuild it."""

    generation: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    pieces: list[tuple[int, int, int]]  # (slab, offset in slab, length), in byte order of the tensor
    packed: int = 1  # how many saves share it
    unpacked: int = 0
    fetched: torch.Tensor | None = None  # on the device, once fetched
    ready: Any = None  # CUDA event recorded after the fetch's copies
    owner: Any = field(default=None, repr=False)  # the original tensor, weakly (to recognise a second save)
    group: _Group | None = field(default=None, repr=False)  # the layer call that parked it


class ActivationOffloader:
    """Saved-tensor hooks that park tensors in pinned host slabs. Use `hooks()` around each layer call (with
    `offload=False` for a layer whose tensors stay on the device, so its backward still starts the prefetch of the
    offloaded layer below it), and call `new_step()` before each forward: a step's slab space is reused by the next
    step.

    `offload_host_tensors` copies tensors that are already in host memory too (for tests on CPU)."""

    def __init__(
        self,
        slab_bytes: int = SLAB_BYTES,
        min_bytes: int = MIN_OFFLOAD_BYTES,
        offload_host_tensors: bool = False,
        fetch_ahead: int = FETCH_AHEAD,
    ) -> None:
        self.slab_bytes, self.min_bytes, self.fetch_ahead = slab_bytes, min_bytes, fetch_ahead
        self.offload_host_tensors = offload_host_tensors
        self.slabs: list[torch.Tensor] = []
        self.generation = 0
        self._used = 0  # bytes of slab space taken this step (bump allocation)
        self._by_owner: dict[int, _Offloaded] = {}
        self._groups: list[_Group] = []  # this step's layer calls that saved something, in forward order
        self._group: _Group | None = None  # the current call's, once it saves a tensor
        self._offload_group = True
        self._stream: Any = None

    @contextlib.contextmanager
    def hooks(self, offload: bool = True) -> Iterator[None]:
        """Saved-tensor hooks for one layer call: its tensors go to host slabs, or with `offload=False` stay put."""
        self._group, self._offload_group = None, offload
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._group, self._offload_group = None, True

    @property
    def host_bytes(self) -> int:
        return len(self.slabs) * self.slab_bytes

    def new_step(self) -> None:
        """Forget the previous step's tensors; their slab space is reused from here on."""
        self.generation += 1
        self._used = 0
        self._by_owner.clear()
        self._groups.clear()
        self._group = None

    # -- packing (forward) --------------------------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> Any:
        if not self._worth_offloading(tensor):
            return tensor
        group = self._current_group()
        if not group.offloaded:
            return _InGroup(tensor, group)
        known = self._by_owner.get(id(tensor))
        if known is not None and known.owner() is tensor:
            known.packed += 1
            return known if known.group is group else _InGroup(known, group)
        source = _storage_span(tensor.detach()).view(torch.uint8)
        entry = _Offloaded(
            self.generation,
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
            tensor.device,
            source.numel(),
            [],
        )
        entry.owner, entry.group = weakref.ref(tensor), group
        entry.pieces = self._reserve(entry.nbytes)
        with self._copy_stream(tensor.device) as stream:
            for (slab, offset, length), start in zip(entry.pieces, _starts(entry.pieces), strict=True):
                self.slabs[slab][offset : offset + length].copy_(source[start : start + length], non_blocking=True)
            if stream is not None:
                source.record_stream(stream)  # keep the device memory until the copy has run
        group.entries.append(entry)
        self._by_owner[id(tensor)] = entry
        return entry

    def _current_group(self) -> _Group:
        if self._group is None:  # outside `hooks()` (a direct call) every pack is a group of its own
            self._group = _Group(self.generation, len(self._groups), self._offload_group)
            self._groups.append(self._group)
        return self._group

    def _worth_offloading(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, torch.nn.Parameter) or tensor.layout != torch.strided or not _fills_its_span(tensor):
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
        try:
            return torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        except RuntimeError as exc:  # pinned (page-locked) memory is limited by the machine, not by the GPU
            from hellbender.errors import EnvironmentProblem

            raise EnvironmentProblem(
                f"Offloaded activations need more pinned host memory than this machine gives: "
                f"{self.host_bytes / 2**30:.1f} GiB were in use when {self.slab_bytes / 2**20:.0f} MiB more could not "
                f"be allocated ({str(exc).splitlines()[0]}). Offload fewer layers (`activation_offload_layers`), "
                "checkpoint without offloading (`gradient_checkpointing: true` instead of `offload`), shorten the "
                "rows, or train on a machine with more memory (`hellbender plan` lists the host memory a config needs)."
            ) from None

    # -- unpacking (backward) -----------------------------------------------------------------------------------

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _InGroup):
            self._begin_backward(packed.group)
            packed = packed.saved
        elif isinstance(packed, _Offloaded):
            self._begin_backward(packed.group)
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
        packed.unpacked += 1
        if packed.unpacked >= packed.packed:
            packed.fetched, packed.ready = None, None  # the last save that shares it has it now
        return tensor

    def _fetch(self, entry: _Offloaded) -> torch.Tensor:
        if entry.fetched is not None:
            return entry.fetched
        # Allocated on the compute stream, which uses and frees it: memory the side stream allocated would stay in
        # the side stream's own pool, out of reach of the layers' allocations.
        fetched = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype, device=entry.device)
        target = _storage_span(fetched).view(torch.uint8)
        with self._copy_stream(entry.device) as stream:
            for (slab, offset, length), start in zip(entry.pieces, _starts(entry.pieces), strict=True):
                target[start : start + length].copy_(self.slabs[slab][offset : offset + length], non_blocking=True)
            if stream is not None:
                entry.ready = stream.record_event()
        entry.fetched = fetched
        return fetched

    def _begin_backward(self, group: _Group) -> None:
        """When `group`'s backward begins (once): queue the copies of its own entries not fetched yet, then of the
        `fetch_ahead` nearest offloaded groups below it, which backward reaches next (it runs the layers in reverse)."""
        if group.started or group.generation != self.generation:  # a finished step's: nothing of it is fetched
            return
        group.started = True
        below = [g for g in reversed(self._groups[: group.index]) if g.offloaded and g.entries][: self.fetch_ahead]
        for entry in group.entries + [e for g in below for e in g.entries]:
            if entry.unpacked < entry.packed:
                self._fetch(entry)

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


def _fills_its_span(tensor: torch.Tensor) -> bool:
    """Its elements fill their stretch of storage exactly, in some order of its dimensions (a contiguous tensor, or a
    transposed or permuted one): then those bytes, put back in the same layout, give the same tensor with the same
    strides, which compiled backward code checks."""
    expected = 1
    for stride, size in sorted((t, s) for s, t in zip(tensor.shape, tensor.stride(), strict=True) if s > 1):
        if stride != expected:
            return False
        expected *= size
    return tensor.numel() > 0


def _storage_span(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that `_fills_its_span`, as the flat run of storage it occupies."""
    return tensor.as_strided((tensor.numel(),), (1,))


def _starts(pieces: list[tuple[int, int, int]]) -> list[int]:
    starts, position = [], 0
    for _, _, length in pieces:
        starts.append(position)
        position += length
    return starts
