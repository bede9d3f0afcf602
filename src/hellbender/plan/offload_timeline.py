"""How long the compute stream waits for offloaded layers' copies (`activation_offload_layers`), by stepping through
one micro-batch the way the offloader schedules them (models/activation_offload.py).

The copies run one after another on a side stream at the host link's rate. Forward: each offloaded layer's tensors
leave as soon as the layer has run; the compute stream does not wait for them. Backward runs the layers in reverse;
when a layer's backward begins, its own tensors and those of the `FETCH_AHEAD` nearest offloaded layers below it are
queued to come back (behind any copy still on the side stream, and not before the compute stream reaches that
point), and an offloaded layer's backward waits until its own have arrived. What the copies add to the step is that
wait; a uniform "copies take longer than the forward" bound misses both that copies out may run on into the
backward of the layers above, and that the fetches of the lowest layers must fit in the backward of the few layers
above them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hellbender.plan.memory import FETCH_AHEAD


def copy_wait_seconds(
    forward: Sequence[float],
    backward: Sequence[float],
    parked: Mapping[int, float],
    link_bytes_per_s: float,
    between: float = 0.0,
    fetch_ahead: int = FETCH_AHEAD,
) -> float:
    """Seconds the compute stream waits for fetches in one micro-batch. `forward[i]` / `backward[i]`: layer i's
    forward and backward on the GPU (a recomputed layer's backward includes its forward again); `parked`: bytes of
    each offloaded layer; `between`: the GPU's work after the last layer's forward and before its backward (the
    output head and the loss)."""
    if not parked:
        return 0.0
    clock, link_free = 0.0, 0.0
    for index, seconds in enumerate(forward):
        clock += seconds
        if index in parked:
            link_free = max(link_free, clock) + parked[index] / link_bytes_per_s
    clock += between
    below = sorted(parked)  # offloaded layers, lowest first
    arrives: dict[int, float] = {}
    waited = 0.0
    for index in reversed(range(len(forward))):
        # The layer's own tensors, then the nearest offloaded layers below it, each queued once.
        ahead = [i for i in reversed(below) if i < index][:fetch_ahead]
        for layer in ([index] if index in parked else []) + ahead:
            if layer not in arrives:
                link_free = max(link_free, clock) + parked[layer] / link_bytes_per_s
                arrives[layer] = link_free
        if index in parked and arrives[index] > clock:
            waited += arrives[index] - clock
            clock = arrives[index]
        clock += backward[index]
    return waited
