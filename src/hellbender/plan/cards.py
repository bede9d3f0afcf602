"""GPUs the planner knows: memory, dense bf16 peak, memory bandwidth, and the share of the peak the step's matmuls
reach.

Memory is the vendor's capacity in GiB less what the driver keeps (torch's `total_memory` on an H100 80GB: 79.2
GiB). Peaks are the vendors' dense (no sparsity) bf16 tensor-core numbers from their datasheets, as in
bench/throughput.py. `efficiency` is the share of that peak a step's linear layers reach (their matmuls alone: the
memory-bound work between them and attention are kernel_costs.py's). On the H200, 0.78: the base matmuls of W1's
and W3's shapes measured 770-813 TFLOP/s forward and backward (`bench/elementwise_costs.py`), and it fits 35
measured steps of W1-W4 with `kernel_costs.IN_MODEL_SHARE` (docs/plan.md). On the H100, 0.70, fitted to W1 and W2
measured there (docs/plan.md). The other cards' efficiencies are not measured: they assume 0.70. Treat their step
times as rough. The host link is pinned-memory copy speed in one direction, as training's copies reach it: on the
H200 machines 50 GB/s, what the offloaded layers' copies (a layer's saved tensors, 0.35 GB) moved beside compute in
the 8B recipe's profile (3.53 GB in 70 ms each way), where single 1 GiB copies reach 55 GB/s, alone or beside bf16
matmuls (`bench/host_link.py`); the other cards' are PCIe figures, not measured here."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hellbender.errors import ConfigError


@dataclass(frozen=True)
class Card:
    name: str
    memory_gib: float
    bf16_tflops: float
    hbm_tb_s: float
    host_link_gb_s: float  # pinned host <-> GPU copies, one direction (PCIe)
    efficiency: float
    measured: bool
    launch_seconds: float = 0.0  # the host's time per GPU kernel launched (launches.py); 0: LAUNCH_SECONDS


# The host's time per kernel launched, fitted in docs/plan.md to launch-bound steps measured on H200 machines
# (W3's VLM steps and W6's decoding steps). It is the host's cost, not the card's: the other cards assume it.
LAUNCH_SECONDS = 47e-6
# Hosts differ: the host-bound steps measured on H200 machines took this range of the host time planned with the
# constants above (docs/plan.md, "Hosts differ"): 0.61 (the 1B shape at micro-batch 1, 0.059 s) to 1.13 (W3 packed at
# micro-batch 2, 0.809 s). The report gives a launch-bound step's time over it.
MEASURED_HOST_SHARES = (0.61, 1.13)


CARDS: tuple[Card, ...] = (
    Card("H100", 79.2, 989.0, 3.35, 25.0, 0.70, True),
    Card("H100-PCIe", 79.2, 756.0, 2.0, 25.0, 0.70, False),
    Card("H200", 139.8, 989.0, 4.8, 50.0, 0.78, True),
    Card("B200", 178.4, 2250.0, 8.0, 25.0, 0.70, False),
    Card("A100", 79.2, 312.0, 2.0, 12.0, 0.70, False),
    Card("A100-40GB", 39.4, 312.0, 1.6, 12.0, 0.70, False),
    Card("L40S", 44.4, 362.0, 0.86, 12.0, 0.70, False),
    Card("A10G", 22.0, 125.0, 0.6, 6.0, 0.70, False),
    Card("L4", 22.0, 121.0, 0.3, 6.0, 0.70, False),
)


def card_named(name: str) -> Card:
    wanted = name.upper().replace(" ", "-")
    for card in CARDS:
        if card.name.upper() == wanted:
            return card
    known = ", ".join(c.name for c in CARDS)
    raise ConfigError(f"`--gpu {name}` is not a card the planner knows ({known}). Give its memory with `--gpu-memory`.")


def this_card() -> Card | None:
    """The card of this machine's first GPU, when the planner knows it."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.cuda.get_device_name(0)
    memory = torch.cuda.get_device_properties(0).total_memory / 1024**3
    for card in sorted(CARDS, key=lambda c: -len(c.name)):  # "H100-PCIe" before "H100"
        if card.name.replace("-", " ") in device:
            return replace(card, memory_gib=memory)
    return None
